"""Typed configuration, registered with Hydra so that a typo in YAML or on the command line fails.

Key names follow NeMo-Aligner's `gpt_kto.yaml` / `gpt_dpo.yaml` so existing configs carry over
(`nemo_aligner.py` maps the keys of theirs that differ). Defaults live here, not in library code,
and suit a real model: a bundled demo's values (tiny model, lr 1e-3, ...) live in
`conf/example/`, which applies only when the run names no data and no checkpoint.
`prepare.py` resolves what depends on the checkpoint; `validate.py` holds the cross-field checks.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_kto.config.architecture import GPTArchitecture


@dataclass
class LoopConfig:
    """Training-loop limits (`trainer.kto.*` / `trainer.dpo.*`)."""

    max_epochs: int = 1
    """Passes over the training data."""
    max_steps: int = -1
    """Optimizer steps; -1 means max_epochs × steps per epoch."""
    # Any, not float: as in NeMo/Lightning, an int and a float mean different things here
    # (`1` is one batch, `1.0` all of them), which a float field would erase.
    val_check_interval: Any = 0.1
    """Validate every N steps (int) or every fraction of an epoch (float in (0, 1])."""
    save_interval: int = 100
    """Save a checkpoint every N steps; 0 saves only at the end."""
    limit_train_batches: Any = 1.0
    """Global batches per epoch: a count (int) or a fraction of the epoch (float in [0, 1])."""
    limit_val_batches: Any = 1.0
    """Validation global batches: a count (int) or a fraction (float in [0, 1])."""
    gradient_clip_val: float = 1.0
    """Global gradient-norm clip; 0 disables."""


@dataclass
class TrainerConfig:
    """`trainer.*`."""

    num_nodes: int = 1
    """Nodes in the job (checked against the launched world size when `devices` is set)."""
    devices: int | None = None
    """Processes per node; None accepts whatever torchrun launched."""
    precision: str | None = None
    """'bf16'/'bf16-mixed' (bf16 weights, fp32 master copy), '16'/'16-mixed' (the same in fp16
    with dynamic loss scaling) or '32'/'32-true'; None follows the device: bf16 on CUDA, 32 on a
    CPU (where half-precision matmuls are ~10x slower)."""
    max_time: str | None = None
    """Run-time limit 'DD:HH:MM:SS'; the run saves and exits cleanly when reached."""
    log_every_n_steps: int = 1
    """Write train metrics every N steps."""
    peak_flops_per_device: float | None = None
    """Peak FLOP/s of one device for MFU; None measures it once at start-up."""
    kto: LoopConfig = field(default_factory=LoopConfig)
    """Loop settings used by train_gpt_kto.py."""
    dpo: LoopConfig = field(default_factory=LoopConfig)
    """Loop settings used by train_gpt_dpo.py."""
    distributed_timeout_minutes: float = 30.0
    """Timeout of every collective (megatron's name): a rank that waits this long for a
    missing peer fails instead of hanging; > 0."""
    non_finite: str = "stop"
    """A NaN/Inf loss, log-prob, reward or gradient: 'stop' (every rank exits with one error
    line naming the step, the quantity and the rows) or 'skip' (no update that step; counted
    as `skipped_steps` in metrics.jsonl)."""


@dataclass
class CheckpointCallbackParams:
    """`exp_manager.checkpoint_callback_params.*`."""

    save_top_k: int = 3
    """Keep the last K complete checkpoints (≤ 0 keeps all)."""


@dataclass
class WandbKwargs:
    """`exp_manager.wandb_logger_kwargs.*`."""

    project: str | None = None
    """W&B project."""
    name: str | None = None
    """W&B run name."""


@dataclass
class ExpManagerConfig:
    """`exp_manager.*`: where a run writes and whether it resumes."""

    explicit_log_dir: str = "results/gpt_kto"
    """Run directory: metrics.jsonl, checkpoints/, tensorboard/."""
    resume_if_exists: bool = True
    """Resume from checkpoints/latest in explicit_log_dir when present."""
    create_checkpoint_callback: bool = True
    """Write checkpoints at all."""
    create_tensorboard_logger: bool = True
    """Write TensorBoard events (if tensorboard is installed)."""
    create_wandb_logger: bool = False
    """Log to Weights & Biases (needs the wandb extra)."""
    wandb_logger_kwargs: WandbKwargs = field(default_factory=WandbKwargs)
    """W&B settings."""
    checkpoint_callback_params: CheckpointCallbackParams = field(
        default_factory=CheckpointCallbackParams
    )
    """Checkpoint retention."""
    save_hf: bool = False
    """Also write the trained model as a Hugging Face directory, `<explicit_log_dir>/hf/`, at the
    final save (a LoRA run: the PEFT adapter directory); see hf_writer/output.py."""
    save_hf_every_save: bool = False
    """With save_hf: replace `hf/` at every checkpoint save, not only the final one."""
    save_hf_merged: bool = False
    """With save_hf and LoRA: also write base + adapters merged to `<explicit_log_dir>/hf_merged/`."""
    save_hf_max_shard_mb: float = 5000.0
    """Largest safetensors file of the Hugging Face output, in MiB (also what one rank holds)."""


@dataclass
class PretrainedCheckpointConfig:
    """`pretrained_checkpoint.*`."""

    restore_from_path: str | None = None
    """Weights to start from, and the architecture used: a Hugging Face model directory
    (config.json + safetensors, read directly, each rank its own slices), or a checkpoint of
    the conversion tool or of training."""


@dataclass
class KTOLossConfig:
    """`model.kto.*`."""

    ref_policy_kl_penalty: float = 0.1
    """β."""
    desirable_loss_weight: float = 1.0
    """λ_D."""
    undesirable_loss_weight: float = 1.0
    """λ_U."""
    loss_type: str = "kto"
    """'kto' or 'apo_zero_unpaired'."""
    preference_average_log_probs: bool = False
    """Rewards from per-token mean log-probs (length-normalised) instead of sums."""
    preference_loss_weight: float = 1.0
    """Weight of the KTO (preference) loss."""
    sft_loss_weight: float = 0.0
    """Weight of the NLL of desirable completions added to the loss."""
    sft_average_log_probs: bool = True
    """SFT NLL per token (True) or summed over the completion (False)."""
    reference_policy: str | None = None
    """'cpu_swap' (host copy swapped in), 'separate' (second model on the device),
    'precomputed' (the run's reference passes done before training; same KL partners as
    cpu_swap) or 'adapters_off' (LoRA: the same model with its adapters disabled, or switched to
    the frozen starting adapter — model.peft.reference); None means 'adapters_off' with LoRA
    (model.peft), else 'cpu_swap'."""
    log_prob_forward_micro_batch_size: int | None = None
    """Rows per micro-batch in forward-only passes; None means model.micro_batch_size."""


@dataclass
class DPOLossConfig:
    """`model.dpo.*`."""

    ref_policy_kl_penalty: float = 0.1
    """β."""
    # Any, not str: a name or a list of names (TRL's loss_type list), which one field type
    # cannot say in OmegaConf; validate checks the names.
    loss_type: Any = "sigmoid"
    """A name of losses.DPO_LOSS_TYPES (sigmoid, ipo, hinge, exo_pair, nca_pair, robust,
    sppo_hard, apo_zero, apo_down, discopop, sigmoid_norm, sft; NeMo-Aligner's rpo_sq,
    rpo_fwd_kl, rpo_bwd_kl, which read rewards from the data; reference-free: cpo, simpo, orpo)
    or a list of them (reference-free and reference-based names do not mix)."""
    loss_weights: Optional[list[float]] = None
    """One weight per loss_type entry (the loss is their weighted sum); None means all 1."""
    label_smoothing: float = 0.0
    """ε: label-flip rate read by sigmoid (conservative DPO), robust and exo_pair (> 0)."""
    discopop_tau: float = 0.05
    """τ of the discopop loss."""
    f_divergence_type: str = "reverse_kl"
    """f-DPO regulariser: reverse_kl (plain DPO), forward_kl, js_divergence or alpha_divergence;
    non-default only with sigmoid, sigmoid_norm, hinge, ipo, exo_pair, robust, discopop, sft."""
    f_alpha_divergence_coef: float = 0.5
    """α of f_divergence_type=alpha_divergence (refused with any other type unless 0.5)."""
    cpo_alpha: float = 1.0
    """Weight of the chosen completions' NLL in cpo and simpo (TRL's CPOConfig.cpo_alpha)."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin γ (TRL's CPOConfig.simpo_gamma)."""
    gt_reward_scale: float = 1.0
    """RPO losses (rpo_sq, rpo_fwd_kl, rpo_bwd_kl; NeMo-Aligner's): the reward gap they target
    is gt_reward_scale × (chosen_reward − rejected_reward), the rewards read from the data."""
    orpo_prompt_nll: bool = True
    """orpo: the NLL term scores the chosen rows' prompt tokens too, as TRL's ORPOTrainer
    (True); False: the chosen completion only (the ORPO paper's formula)."""
    ld_alpha: Optional[float] = None
    """LD-DPO (TRL's DPOConfig.ld_alpha): in every log-prob (policy and reference) the tokens
    beyond the pair's shorter completion count α times, α in [0, 1]; None: plain sums."""
    preference_average_log_probs: bool = False
    """Length-normalise: use per-token mean log-probs instead of sums (always on for simpo and
    orpo, which TRL defines on per-token means)."""
    preference_loss_weight: float = 1.0
    """Weight of the DPO (preference) loss."""
    sft_loss_weight: float = 0.0
    """Weight of the chosen completions' NLL added to the loss."""
    sft_average_log_probs: bool = True
    """SFT NLL per token (True) or summed over the completion (False)."""
    reference_policy: str | None = None
    """'cpu_swap', 'separate', 'precomputed' or 'adapters_off' (LoRA); None means
    'adapters_off' with LoRA (model.peft), else 'cpu_swap'. Reference-free loss types (cpo,
    simpo, orpo) use 'none' whatever is set here (a set value is noted as unused)."""
    log_prob_forward_micro_batch_size: int | None = None
    """Pairs per micro-batch in forward-only passes; None means model.micro_batch_size."""


@dataclass
class LoRATuningConfig:
    """`model.peft.lora_tuning.*` (NeMo's names)."""

    # Unset (None) rank, alpha, dropout, targets and layers are read from the starting adapter
    # (model.peft.restore_from_path), which fixes them, else take the built-in defaults
    # (peft.settings.LORA_DEFAULTS); prepare.py writes the values used back here.
    adapter_dim: int | None = None
    """LoRA rank r; None: the starting adapter's, else 32."""
    alpha: float | None = None
    """Scaling numerator: adapters add (alpha / adapter_dim)·B·A·x; None: the starting adapter's,
    else adapter_dim."""
    adapter_dropout: float | None = None
    """Dropout on the adapters' input (training only); None: the starting adapter's, else 0."""
    # Any, not list[str]: peft's LoraConfig also takes one string (a regular expression), which
    # a list field would refuse; peft.settings.targets_and_layers checks the type.
    target_modules: Any = None
    """A list of NeMo names (attention_qkv, attention_dense, mlp_fc1, mlp_fc2, attention, mlp,
    all) or Hugging Face projections (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
    down_proj); or, as in peft, one string: a regular expression matching whole Hugging Face
    module names (model.layers.0.self_attn.q_proj), which selects the layers too. None: the
    starting adapter's, else [attention_qkv]."""
    layer_selection: list[int] | None = None
    """1-based layer numbers that get adapters; None: the starting adapter's, else every layer."""
    column_init_method: str = "xavier"
    """Init of A (the input-side matrix): 'xavier', 'normal', 'kaiming' (peft's) or 'zero'."""
    row_init_method: str = "zero"
    """Init of B (the output-side matrix); 'zero' makes step 0 equal the base model."""
    weight_tying: bool = False
    """NeMo's adapters shared across layers: not implemented (must be False)."""
    position_embedding_strategy: str | None = None
    """NeMo's weight-tying position embeddings: not implemented (must be None)."""


@dataclass
class PEFTConfig:
    """`model.peft.*`: parameter-efficient fine-tuning."""

    peft_scheme: str = "none"
    """'none' (train every weight) or 'lora' (train adapters only; the base stays frozen)."""
    restore_from_path: str | None = None
    """Starting adapter: a Hugging Face PEFT adapter directory (adapter_config.json +
    adapter_model.safetensors); None starts from the configured init."""
    reference: str = "start"
    """LoRA reference policy: 'start' (base + a frozen copy of the starting adapter) or 'base'."""
    lora_tuning: LoRATuningConfig = field(default_factory=LoRATuningConfig)
    """LoRA settings (peft_scheme=lora)."""


@dataclass
class SchedConfig:
    """`model.optim.sched.*`."""

    name: str = "CosineAnnealing"
    """'CosineAnnealing', 'Constant' or 'Linear'."""
    warmup_steps: int = 10
    """Linear warm-up steps."""
    constant_steps: int = 0
    """Steps held at min_lr at the end (CosineAnnealing)."""
    min_lr: float | None = None
    """Final learning rate (at most lr); None means lr / 10."""


@dataclass
class OptimConfig:
    """`model.optim.*`."""

    name: str = "fused_adam"
    """'fused_adam'/'adam' or 'distributed_fused_adam' (shards optimizer state over DP)."""
    lr: float = 5e-6
    """Peak learning rate (KTO paper / NeMo-Aligner range for β≈0.1: 5e-7 .. 1e-5)."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    sched: SchedConfig = field(default_factory=SchedConfig)
    """Learning-rate schedule."""
    overlap_grad_sync: bool | None = None
    """Overlap the data-parallel gradient reduction with backward (megatron DDP
    overlap_grad_reduce); None leaves megatron_kto's default."""
    bucket_cap_mb: float | None = None
    """Gradient-reduction bucket size in MiB of fp32 gradients (megatron DDP bucket_size);
    None leaves megatron-core's default."""


@dataclass
class DataPrefix:
    """`model.data.data_prefix.*`: data files per split."""

    train: list[str] = field(default_factory=list)
    """Training files (JSONL, JSON, Parquet, or a `datasets` directory)."""
    validation: list[str] = field(default_factory=list)
    """Validation files; empty disables validation."""


@dataclass
class DataConfig:
    """`model.data.*`."""

    data_prefix: DataPrefix = field(default_factory=DataPrefix)
    """Files per split."""
    max_length: int | None = None
    """Prompt + completion tokens; None means model.encoder_seq_length."""
    max_prompt_length: int | None = None
    """Prompt tokens kept; None means no separate prompt limit."""
    truncation_mode: str = "keep_end"
    """Prompt truncation: 'keep_end' (drop the left) or 'keep_start'."""
    pad_to_multiple_of: int = 1
    """Pad batch length to a multiple of this (8 helps tensor cores; unpacked batches only)."""
    pack_sequences: bool = True
    """Padding-free micro-batches: rows packed end to end, attention and positions per row."""
    shuffle: bool = True
    """Shuffle training data each epoch (seeded)."""
    num_workers: int = 0
    """DataLoader workers."""
    use_cache: bool = True
    """Cache tokenised data next to the data files."""
    default_chosen_reward: float | None = None
    """RPO losses (model.dpo.loss_type rpo_*): the chosen_reward of a paired row without one
    (NeMo-Aligner's key); None: such a row is an error."""
    default_rejected_reward: float | None = None
    """RPO losses: the rejected_reward of a paired row without one; None: an error."""


@dataclass
class TokenizerConfig:
    """`model.tokenizer.*`."""

    library: str | None = None
    """'sentencepiece' or 'huggingface'; None infers it from `model` (a .model file is
    SentencePiece, anything else Hugging Face)."""
    model: str | None = None
    """SentencePiece .model, or tokenizer.json / a directory holding it; None means the
    tokenizer files stored with pretrained_checkpoint.restore_from_path."""
    chat_template: str | None = None
    """Jinja chat template overriding the tokenizer's own (conversational data)."""


def _optional_architecture_fields() -> type:
    """A dataclass with every GPTArchitecture field (documented there), each optional.

    None means "not stated": the value comes from the pretrained checkpoint's
    architecture.json, else from GPTArchitecture's default. A value the config does state is
    checked against the checkpoint (`prepare.py`), so a preset or override can never silently
    lose to — or silently override — the weights' real shape.
    """
    hints = typing.get_type_hints(GPTArchitecture)
    return dataclasses.make_dataclass(
        "ArchitectureFields",
        [
            (f.name, Optional[hints[f.name]], field(default=None))  # noqa: UP045 (runtime type)
            for f in dataclasses.fields(GPTArchitecture)
        ],
    )


ArchitectureFields = _optional_architecture_fields()


@dataclass
class ModelConfig(ArchitectureFields):
    """`model.*`: architecture (GPTArchitecture fields, optional), layout, batch sizes, loss,
    optim, data."""

    tensor_model_parallel_size: int = 1
    """TP degree."""
    pipeline_model_parallel_size: int = 1
    """PP degree."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline rank (interleaved schedule)."""
    num_layers_in_first_pipeline_stage: int | None = None
    """Layers of the first pipeline stage (megatron's key); None = the even split. With it (or
    the last stage's count) the other stages share the remaining layers evenly, so layer
    counts PP does not divide (DeepSeek-V3's 61) can be pipelined."""
    num_layers_in_last_pipeline_stage: int | None = None
    """Layers of the last pipeline stage (megatron's key); None = the even split."""
    context_parallel_size: int = 1
    """CP degree (NeMo's key): every row is split along the sequence over this many ranks
    (world = TP x PP x CP x DP); weights are not sharded by it, so checkpoints move freely
    between CP sizes. For rows too long for one GPU's activations (16k-128k tokens)."""
    expert_model_parallel_size: int = 1
    """EP degree (mixture-of-experts models): each MoE layer's experts are split over this many
    data-parallel ranks; it must divide the data-parallel size and the expert count."""
    expert_tensor_parallel_size: int | None = None
    """Expert TP degree (NeMo's key; mixture-of-experts models): ranks each routed expert's
    linears are split over, independently of the attention's TP. None = the same as
    tensor_model_parallel_size. The experts' grid ETP x EP x expert-DP x PP spans the same world,
    so ETP x EP must divide world / PP, and ETP the experts' hidden size."""
    moe_router_bias_update_rate: float = 0.0
    """NeMo's key: per-step update of a sigmoid router's expert bias (megatron-core's
    aux-loss-free load balancing: bias += rate x sign(mean load - expert load), in
    finalize_model_grads); 0 (default) keeps the bias as the checkpoint has it."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs TP > 1); batches are right-padded to a multiple of TP."""
    attention_backend: str = "auto"
    """'auto' (te with Transformer Engine + CUDA, else sdpa), 'te', 'sdpa' (torch SDPA) or 'local'."""
    micro_batch_size: int = 1
    """Rows per training micro-batch."""
    global_batch_size: int = 64
    """Examples per optimizer step across all data-parallel ranks."""
    seed: int = 1234
    """Base random seed (init, dropout, data order)."""
    activations_checkpoint_granularity: str | None = None
    """Activation recomputation: None, 'full' (whole layers) or 'selective' (core attention)."""
    activations_checkpoint_method: str | None = None
    """'full' only: 'uniform' or 'block'; None means 'uniform'."""
    activations_checkpoint_num_layers: int | None = None
    """'full' only: layers per recompute block (uniform) or recomputed layers per model chunk
    (block); None means 1."""
    logprob_chunk_size: int = 1024
    """Output layer on completion tokens only, this many at a time (0: full logits everywhere)."""
    kto: KTOLossConfig = field(default_factory=KTOLossConfig)
    """KTO loss."""
    dpo: DPOLossConfig = field(default_factory=DPOLossConfig)
    """DPO loss."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    data: DataConfig = field(default_factory=DataConfig)
    """Data."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """Tokenizer."""
    peft: PEFTConfig = field(default_factory=PEFTConfig)
    """Parameter-efficient fine-tuning (LoRA)."""


@dataclass
class AlignmentConfig:
    """The whole run configuration (root of gpt_kto.yaml / gpt_dpo.yaml)."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    exp_manager: ExpManagerConfig = field(default_factory=ExpManagerConfig)
    pretrained_checkpoint: PretrainedCheckpointConfig = field(
        default_factory=PretrainedCheckpointConfig
    )
    model: ModelConfig = field(default_factory=ModelConfig)
    name: str = "megatron_gpt_kto"
    """Run name (for loggers)."""


def register() -> None:
    """Register the schema with Hydra's ConfigStore (as `alignment_schema`)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="alignment_schema", node=AlignmentConfig)


def architecture_of(model: Any) -> GPTArchitecture:
    """The GPTArchitecture a (structured or plain) model config states; unset (None) fields take
    GPTArchitecture's defaults."""
    values = {name: getattr(model, name, None) for name in GPTArchitecture.field_names()}
    return GPTArchitecture(**{k: v for k, v in values.items() if v is not None})
