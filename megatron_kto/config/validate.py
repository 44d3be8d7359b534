"""Cross-field configuration checks, run before any model is built.

Each failure names the config key so the user can fix the YAML or override directly.
"""

from __future__ import annotations

from typing import Any

from megatron_kto.config.errors import ConfigError, need, need_one_of
from megatron_kto.config.keys import check_known_keys
from megatron_kto.config.latent_attention import check_latent_attention
from megatron_kto.config.layout import check_expert_layout, check_layout, data_parallel_size
from megatron_kto.config.machine import attention_choice, canonical_precision
from megatron_kto.config.max_time import parse_max_time
from megatron_kto.config.model_checks import (
    check_architecture,
    check_linear_attention,
    check_router_loss,
)
from megatron_kto.config.pipeline_split import chunk_sizes
from megatron_kto.losses.dpo_types import (
    NO_REFERENCE,
    DPOLossConfigError,
    check_loss_mixture,
    loss_type_names,
    needs_reference,
)
from megatron_kto.losses.f_divergence import check_f_divergence

__all__ = [
    "ConfigError",
    "check_layout",
    "data_parallel_size",
    "validate",
]


#: `trainer.non_finite`: what a non-finite loss or gradient norm does (algorithms/non_finite.py).
NON_FINITE_POLICIES = ("stop", "skip")


def _check_optimizer(o: Any) -> None:
    """What megatron-core's OptimizerParamScheduler asserts (max_lr >= min_lr >= 0, start_wd
    >= 0, ...) and torch's Adam rejects, checked here so the message names our keys."""
    need_one_of(o.name, "model.optim.name", ("adam", "fused_adam", "distributed_fused_adam"))
    need_one_of(o.sched.name, "model.optim.sched.name", ("CosineAnnealing", "Constant", "Linear"))
    need(len(o.betas) == 2, "model.optim.betas", f"needs two values, got {list(o.betas)}")
    need(
        all(0.0 <= b < 1.0 for b in o.betas),
        "model.optim.betas",
        f"each must be in [0, 1), got {list(o.betas)}",
    )
    need(o.eps > 0, "model.optim.eps", "must be > 0")
    need(o.lr > 0, "model.optim.lr", "must be > 0")
    need(o.weight_decay >= 0, "model.optim.weight_decay", "must be >= 0")
    need(o.sched.warmup_steps >= 0, "model.optim.sched.warmup_steps", "must be >= 0")
    need(o.sched.constant_steps >= 0, "model.optim.sched.constant_steps", "must be >= 0")
    min_lr = o.sched.min_lr
    if min_lr is not None:
        need(min_lr >= 0, "model.optim.sched.min_lr", f"must be >= 0, got {min_lr}")
        need(
            min_lr <= o.lr,
            "model.optim.sched.min_lr",
            f"{min_lr:g} is above model.optim.lr {o.lr:g} (the schedule decays from lr down to "
            "min_lr); lower it, or leave it unset for lr / 10",
        )
    if o.bucket_cap_mb is not None:
        need(o.bucket_cap_mb > 0, "model.optim.bucket_cap_mb", "must be > 0")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_fraction(value: Any) -> bool:
    return isinstance(value, float)


def _check_loop(loop: Any, key: str) -> None:
    """NeMo/Lightning semantics: an int is a number of steps/batches, a float a fraction."""
    need(
        loop.max_epochs >= 1 or loop.max_steps > 0,
        f"{key}.max_epochs",
        "set max_epochs >= 1 or max_steps > 0",
    )
    v = loop.val_check_interval
    need(
        (_is_count(v) and v >= 1) or (_is_fraction(v) and 0.0 < v <= 1.0),
        f"{key}.val_check_interval",
        f"an int (every N steps, >= 1) or a float (a fraction of an epoch, in (0, 1]); got {v!r}",
    )
    for name in ("limit_train_batches", "limit_val_batches"):
        v = getattr(loop, name)
        need(
            (_is_count(v) and v >= 0) or (_is_fraction(v) and 0.0 <= v <= 1.0),
            f"{key}.{name}",
            f"an int (a number of global batches) or a float (a fraction, in [0, 1]); got {v!r}",
        )
    need(loop.save_interval >= 0, f"{key}.save_interval", "must be >= 0")
    need(loop.gradient_clip_val >= 0, f"{key}.gradient_clip_val", "must be >= 0")


def validate(
    cfg: Any, world_size: int, algorithm: str, architecture_file: str | None = None
) -> None:
    """Check a composed config for a run of `world_size` processes.

    Args:
        cfg: the composed `AlignmentConfig` (OmegaConf node or dataclass), with the
            architecture fields of `cfg.model` resolved (`prepare.prepare_run_config`).
        world_size: number of launched processes.
        algorithm: 'kto' or 'dpo'.
        architecture_file: the checkpoint's architecture.json the model.* shape was read from,
            if any (layout errors then name the layout key and that file).

    Raises:
        ConfigError: naming the offending key.
    """
    check_known_keys(cfg)
    m = cfg.model
    _check_trainer(cfg.trainer, world_size)
    dp = _check_parallel_layout(cfg, world_size, architecture_file)
    _check_batches(m, dp)
    _check_recompute(m)
    attention_choice(cfg)
    _check_data(m, architecture_file)
    _check_optimizer(m.optim)
    _check_loop(cfg.trainer.kto if algorithm == "kto" else cfg.trainer.dpo, f"trainer.{algorithm}")
    _check_objective(m, algorithm)
    _check_hf_output(cfg.exp_manager, m)
    _check_forward_micro_batch(m, algorithm, dp)
    check_linear_attention(m)
    check_latent_attention(m)


def _split(m: Any) -> tuple[int, int | None, int | None, int | None]:
    """PP, VPP and the first / last stages' layer counts."""
    return (
        m.pipeline_model_parallel_size,
        m.virtual_pipeline_model_parallel_size,
        m.num_layers_in_first_pipeline_stage,
        m.num_layers_in_last_pipeline_stage,
    )


def _check_trainer(t: Any, world_size: int) -> None:
    """`trainer.*` outside the loop: precision, logging, time limit, and the launched devices."""
    canonical_precision(t.precision)
    need(t.log_every_n_steps >= 1, "trainer.log_every_n_steps", "must be >= 1")
    need(t.distributed_timeout_minutes > 0, "trainer.distributed_timeout_minutes", "must be > 0")
    need_one_of(t.non_finite, "trainer.non_finite", NON_FINITE_POLICIES)
    if t.max_time:
        try:
            parse_max_time(t.max_time)
        except ValueError as e:
            raise ConfigError(f"trainer.max_time: {e}") from e
    if t.devices is not None:
        need(
            t.devices * t.num_nodes == world_size,
            "trainer.devices",
            f"trainer.devices ({t.devices}) x trainer.num_nodes ({t.num_nodes}) != launched world "
            f"size {world_size}; launch with torchrun --nproc_per_node {t.devices} or set trainer.devices=null",
        )


def _check_parallel_layout(cfg: Any, world_size: int, architecture_file: str | None) -> int:
    """TP / PP / VPP / CP / EP / ETP / SP against the model's shape and the world size; returns
    the data-parallel size."""
    m = cfg.model
    tp, pp, vpp = (
        m.tensor_model_parallel_size,
        m.pipeline_model_parallel_size,
        m.virtual_pipeline_model_parallel_size,
    )
    cp = m.context_parallel_size
    for key, value in (
        ("tensor_model_parallel_size", tp),
        ("pipeline_model_parallel_size", pp),
        ("context_parallel_size", cp),
    ):
        need(value >= 1, f"model.{key}", f"must be >= 1, got {value}")
    dp = data_parallel_size(cfg, world_size)
    check_architecture(m)
    _, _, first, last = _split(m)
    check_layout(m, tp, pp, vpp, first=first, last=last, architecture_file=architecture_file)
    # megatron-core spreads experts over the data- and context-parallel ranks together.
    check_expert_layout(
        m,
        m.expert_model_parallel_size,
        dp * cp,
        architecture_file=architecture_file,
        tp=tp,
        etp=m.expert_tensor_parallel_size,
    )
    check_router_loss(m)
    need(
        not (m.num_moe_experts and tp > 1) or m.sequence_parallel,
        "model.sequence_parallel",
        "a mixture-of-experts model with tensor_model_parallel_size > 1 trains with sequence "
        "parallelism (megatron-core requires it): set model.sequence_parallel=true",
    )
    need(
        not m.sequence_parallel or tp > 1,
        "model.sequence_parallel",
        "needs tensor_model_parallel_size > 1",
    )
    if vpp is not None:
        need(
            pp > 1,
            "model.virtual_pipeline_model_parallel_size",
            "needs pipeline_model_parallel_size > 1",
        )
    return dp


def _check_batches(m: Any, dp: int) -> None:
    """Micro / global batch sizes against the data-parallel size and the pipeline schedule."""
    pp, vpp = m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size
    need(m.micro_batch_size >= 1, "model.micro_batch_size", "must be >= 1")
    need(
        m.logprob_chunk_size >= 0,
        "model.logprob_chunk_size",
        f"must be >= 0 (0 computes full logits), got {m.logprob_chunk_size}",
    )
    need(
        m.global_batch_size % (m.micro_batch_size * dp) == 0,
        "model.global_batch_size",
        f"{m.global_batch_size} is not divisible by micro_batch_size ({m.micro_batch_size}) x "
        f"data-parallel size ({dp})",
    )
    if vpp is not None:
        num_micro = m.global_batch_size // dp // m.micro_batch_size
        need(
            num_micro % pp == 0,
            "model.global_batch_size",
            f"interleaved pipelining needs micro-batches per step ({num_micro}) divisible by PP={pp}",
        )


def _check_data(m: Any, architecture_file: str | None) -> None:
    """`model.data.*` and `model.tokenizer.library`: files, lengths and their choices."""
    need_one_of(m.data.truncation_mode, "model.data.truncation_mode", ("keep_end", "keep_start"))
    need_one_of(m.tokenizer.library, "model.tokenizer.library", ("sentencepiece", "huggingface"))
    need(
        len(m.data.data_prefix.train) > 0, "model.data.data_prefix.train", "no training files given"
    )
    need(m.data.pad_to_multiple_of >= 1, "model.data.pad_to_multiple_of", "must be >= 1")
    max_len = m.data.max_length or m.encoder_seq_length
    limit = (
        f"the position limit {m.encoder_seq_length} in {architecture_file}"
        if architecture_file
        else f"model.encoder_seq_length {m.encoder_seq_length}"
    )
    need(max_len <= m.encoder_seq_length, "model.data.max_length", f"{max_len} exceeds {limit}")
    if m.data.max_prompt_length is not None:
        need(
            1 <= m.data.max_prompt_length < max_len,
            "model.data.max_prompt_length",
            f"must be between 1 and max_length - 1 ({max_len - 1}), got {m.data.max_prompt_length}",
        )


def _check_objective(m: Any, algorithm: str) -> None:
    """`model.kto.*` / `model.dpo.*`: loss type(s), β, weights and the f-divergence."""
    loss = m.kto if algorithm == "kto" else m.dpo
    need(
        loss.preference_loss_weight >= 0,
        f"model.{algorithm}.preference_loss_weight",
        "must be >= 0",
    )
    need(loss.sft_loss_weight >= 0, f"model.{algorithm}.sft_loss_weight", "must be >= 0")
    if algorithm == "kto":
        _check_kto(m)
        return
    d = m.dpo
    need(d.ref_policy_kl_penalty > 0, "model.dpo.ref_policy_kl_penalty", "β must be > 0")
    try:
        names = loss_type_names(d.loss_type)
        check_loss_mixture(names, d.loss_weights, d.label_smoothing, d.discopop_tau, d.cpo_alpha)
        check_f_divergence(names, d.f_divergence_type, d.f_alpha_divergence_coef)
    except DPOLossConfigError as e:
        raise ConfigError(f"model.dpo.{e.field}: {e}") from None
    if d.ld_alpha is not None:
        _check_ld_alpha(d, names)
    need(
        d.reference_policy != NO_REFERENCE or not needs_reference(names),
        "model.dpo.reference_policy",
        f"'{NO_REFERENCE}' only with a reference-free loss_type (cpo, simpo, orpo), got "
        f"loss_type {list(names)}",
    )


def _check_ld_alpha(d: Any, names: tuple[str, ...]) -> None:
    """LD-DPO is DPOTrainer's (reference-based); its `sft` reads unweighted log-probs, which a
    run with the weights in its forward pass does not have."""
    need(0.0 <= d.ld_alpha <= 1.0, "model.dpo.ld_alpha", f"must be in [0, 1], got {d.ld_alpha}")
    need(
        needs_reference(names),
        "model.dpo.ld_alpha",
        f"LD-DPO weights DPO's reference-based log-ratios; not with loss_type {list(names)} "
        "(TRL's CPO/ORPO trainers have no ld_alpha); unset it",
    )
    need(
        "sft" not in names and d.sft_loss_weight == 0,
        "model.dpo.ld_alpha",
        "not with an SFT term (loss_type sft or model.dpo.sft_loss_weight): it reads the "
        "unweighted log-probs; drop one of them",
    )


def _check_kto(m: Any) -> None:
    """KTO's loss type, β, class weights, and the global batch its KL pairs need."""
    k = m.kto
    need_one_of(k.loss_type, "model.kto.loss_type", ("kto", "apo_zero_unpaired"))
    need(k.ref_policy_kl_penalty > 0, "model.kto.ref_policy_kl_penalty", "β must be > 0")
    need(
        k.desirable_loss_weight >= 0 and k.undesirable_loss_weight >= 0,
        "model.kto.desirable_loss_weight",
        "weights must be >= 0",
    )
    need(
        m.global_batch_size >= 2,
        "model.global_batch_size",
        "KL pairs need >= 2 examples per global batch (prompt i is paired with completion "
        f"i+1 mod the global batch size), got {m.global_batch_size}",
    )


def _check_forward_micro_batch(m: Any, algorithm: str, dp: int) -> None:
    """`model.<algorithm>.log_prob_forward_micro_batch_size`: the micro-batch of the
    forward-only passes (reference, KL rows) against the per-rank batch and the schedule."""
    key = f"model.{algorithm}.log_prob_forward_micro_batch_size"
    fwd = (m.kto if algorithm == "kto" else m.dpo).log_prob_forward_micro_batch_size
    per_rank = m.global_batch_size // dp
    if fwd is not None:
        need(fwd >= 1, key, "must be >= 1")
        need(per_rank % fwd == 0, key, f"must divide the per-rank batch {per_rank}")
    fwd = fwd or m.micro_batch_size
    pp = m.pipeline_model_parallel_size
    if m.virtual_pipeline_model_parallel_size is not None:
        # Forward-only passes (reference, KL rows) also run the interleaved schedule.
        need(
            (per_rank // fwd) % pp == 0,
            key,
            f"interleaved pipelining needs forward micro-batches per step ({per_rank // fwd}) "
            f"divisible by PP={pp}",
        )


def _check_hf_output(e: Any, m: Any) -> None:
    """exp_manager.save_hf*: the options that refine save_hf need it (and LoRA, for merging)."""
    for key in ("save_hf_every_save", "save_hf_merged"):
        need(
            not getattr(e, key) or e.save_hf, f"exp_manager.{key}", "needs exp_manager.save_hf=true"
        )
    need(
        not e.save_hf_merged or str(m.peft.peft_scheme) == "lora",
        "exp_manager.save_hf_merged",
        "merges LoRA adapters: needs model.peft.peft_scheme=lora",
    )
    need(e.save_hf_max_shard_mb > 0, "exp_manager.save_hf_max_shard_mb", "must be > 0")


def _chunk_sizes(m: Any) -> list[int]:
    """The layers of every model chunk: PP x VPP equal ones, or megatron-core's uneven split
    (`pipeline_split.chunk_sizes`, which imports megatron-core: only then)."""
    pp, vpp, first, last = _split(m)
    if first is None and last is None:
        return [m.num_layers // (pp * (vpp or 1))]
    return chunk_sizes(m.num_layers, pp, vpp, first, last)


def _check_recompute(m: Any) -> None:
    """Activation-recomputation keys (NeMo names) against megatron-core's rules."""
    granularity = m.activations_checkpoint_granularity
    need_one_of(
        granularity, "model.activations_checkpoint_granularity", (None, "full", "selective")
    )
    method, num_layers = m.activations_checkpoint_method, m.activations_checkpoint_num_layers
    if granularity != "full":
        # megatron-core ignores the method and rejects a count unless whole layers are recomputed.
        for key, value in (
            ("activations_checkpoint_method", method),
            ("activations_checkpoint_num_layers", num_layers),
        ):
            need(
                value is None,
                f"model.{key}",
                f"only applies to activations_checkpoint_granularity=full (got granularity "
                f"{granularity!r}); set it to null",
            )
        return
    need_one_of(method, "model.activations_checkpoint_method", (None, "uniform", "block"))
    method, num_layers = method or "uniform", num_layers or 1
    sizes = _chunk_sizes(m)
    layers_per_chunk = min(sizes)
    need(
        1 <= num_layers <= layers_per_chunk,
        "model.activations_checkpoint_num_layers",
        f"must be between 1 and the {layers_per_chunk} layers of each model chunk "
        f"(the smallest; num_layers / (PP x VPP) when even), got {num_layers}",
    )
    need(
        method != "uniform" or all(n % num_layers == 0 for n in sizes),
        "model.activations_checkpoint_num_layers",
        f"with method 'uniform' it must divide the layers of each model chunk "
        f"({', '.join(map(str, sorted(set(sizes))))}), got {num_layers}",
    )
