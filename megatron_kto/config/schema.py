"""Typed configuration, registered with Hydra so that a typo in YAML or on the command line fails.

Key names follow NeMo-Aligner's `gpt_kto.yaml` / `gpt_dpo.yaml` so existing configs carry over.
Defaults live here, not in library code; `validate.py` holds the cross-field checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_kto.models.architecture import GPTArchitecture
from megatron_kto.models.output_head import DEFAULT_LOGPROB_CHUNK_SIZE


@dataclass
class LoopConfig:
    """Training-loop limits (`trainer.kto.*` / `trainer.dpo.*`)."""

    max_epochs: int = 1
    """Passes over the training data."""
    max_steps: int = -1
    """Optimizer steps; -1 means max_epochs × steps per epoch."""
    val_check_interval: float = 10
    """Validate every N steps (int) or every fraction of an epoch (float < 1)."""
    save_interval: int = 0
    """Save a checkpoint every N steps; 0 saves only at the end."""
    limit_train_batches: float = 1.0
    """Global batches per epoch: fraction (≤ 1.0) or count (> 1)."""
    limit_val_batches: float = 1.0
    """Validation global batches: fraction (≤ 1.0) or count (> 1)."""
    gradient_clip_val: float = 1.0
    """Global gradient-norm clip; 0 disables."""


@dataclass
class TrainerConfig:
    """`trainer.*`."""

    num_nodes: int = 1
    """Nodes in the job (checked against the launched world size when `devices` is set)."""
    devices: int | None = None
    """Processes per node; None accepts whatever torchrun launched."""
    precision: str = "32"
    """'32' or 'bf16'."""
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


@dataclass
class PretrainedCheckpointConfig:
    """`pretrained_checkpoint.*`."""

    restore_from_path: str | None = None
    """Checkpoint (conversion tool or training) to start from; its architecture is used."""


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
    sft_loss_weight: float = 0.0
    """Weight of the NLL of desirable completions added to the loss."""
    reference_policy: str = "cpu_swap"
    """'cpu_swap' (host copy swapped in), 'separate' (second model on the device), or
    'precomputed' (one pass over the data before training; KL partners fixed by dataset index)."""
    log_prob_forward_micro_batch_size: int | None = None
    """Rows per micro-batch in forward-only passes; None means model.micro_batch_size."""


@dataclass
class DPOLossConfig:
    """`model.dpo.*`."""

    ref_policy_kl_penalty: float = 0.1
    """β."""
    loss_type: str = "sigmoid"
    """'sigmoid', 'ipo' or 'hinge'."""
    label_smoothing: float = 0.0
    """Conservative-DPO label smoothing (sigmoid only)."""
    preference_average_log_probs: bool = False
    """Length-normalise: use per-token mean log-probs instead of sums."""
    sft_loss_weight: float = 0.0
    """Weight of the chosen completions' NLL added to the loss."""
    reference_policy: str = "cpu_swap"
    """'cpu_swap', 'separate' or 'precomputed'."""
    log_prob_forward_micro_batch_size: int | None = None
    """Pairs per micro-batch in forward-only passes; None means model.micro_batch_size."""


@dataclass
class SchedConfig:
    """`model.optim.sched.*`."""

    name: str = "CosineAnnealing"
    """'CosineAnnealing', 'Constant' or 'Linear'."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    constant_steps: int = 0
    """Steps held at min_lr at the end (CosineAnnealing)."""
    min_lr: float = 0.0
    """Final learning rate."""


@dataclass
class OptimConfig:
    """`model.optim.*`."""

    name: str = "fused_adam"
    """'fused_adam'/'adam' or 'distributed_fused_adam' (shards optimizer state over DP)."""
    lr: float = 1e-4
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    sched: SchedConfig = field(default_factory=SchedConfig)
    """Learning-rate schedule."""


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
    """Pad batch length to a multiple of this (8 helps tensor cores)."""
    shuffle: bool = True
    """Shuffle training data each epoch (seeded)."""
    num_workers: int = 0
    """DataLoader workers."""
    use_cache: bool = True
    """Cache tokenised data next to the data files."""


@dataclass
class TokenizerConfig:
    """`model.tokenizer.*`."""

    library: str = "sentencepiece"
    """'sentencepiece' or 'huggingface'."""
    model: str = "examples/data/tokenizer/tiny_sp.model"
    """SentencePiece .model, or tokenizer.json / a directory holding it."""
    chat_template: str | None = None
    """Jinja chat template overriding the tokenizer's own (conversational data)."""


@dataclass
class ModelConfig(GPTArchitecture):
    """`model.*`: architecture (GPTArchitecture fields), layout, batch sizes, loss, optim, data."""

    tensor_model_parallel_size: int = 1
    """TP degree."""
    pipeline_model_parallel_size: int = 1
    """PP degree."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline rank (interleaved schedule)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs TP > 1)."""
    micro_batch_size: int = 1
    """Rows per training micro-batch."""
    global_batch_size: int = 8
    """Examples per optimizer step across all data-parallel ranks."""
    seed: int = 1234
    """Base random seed (init, dropout, data order)."""
    activations_checkpoint_granularity: str | None = None
    """None, 'full' or 'selective'."""
    activations_checkpoint_num_layers: int = 1
    """Layers per recompute block ('full')."""
    logprob_chunk_size: int = DEFAULT_LOGPROB_CHUNK_SIZE
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
    """Extract the GPTArchitecture fields from a (structured or plain) model config."""
    return GPTArchitecture(**{name: getattr(model, name) for name in GPTArchitecture.field_names()})
