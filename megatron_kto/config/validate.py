"""Cross-field configuration checks, run before any model is built.

Each failure names the config key so the user can fix the YAML or override directly.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any


class ConfigError(ValueError):
    """An impossible or inconsistent configuration; the message starts with the key."""


def _need(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{key}: {message}")


def _choice(value: Any, key: str, choices: tuple[str, ...]) -> None:
    _need(value in choices, key, f"must be one of {list(choices)}, got {value!r}")


def data_parallel_size(cfg: Any, world_size: int) -> int:
    """DP degree implied by the world size and the model-parallel layout."""
    m = cfg.model
    model_parallel = m.tensor_model_parallel_size * m.pipeline_model_parallel_size
    _need(
        world_size % model_parallel == 0,
        "model.tensor_model_parallel_size",
        f"world size {world_size} is not divisible by TP ({m.tensor_model_parallel_size}) x "
        f"PP ({m.pipeline_model_parallel_size})",
    )
    return world_size // model_parallel


def validate(cfg: Any, world_size: int, algorithm: str) -> None:
    """Check a composed config for a run of `world_size` processes.

    Args:
        cfg: the composed `AlignmentConfig` (OmegaConf node or dataclass).
        world_size: number of launched processes.
        algorithm: 'kto' or 'dpo'.

    Raises:
        ConfigError: naming the offending key.
    """
    check_known_keys(cfg)
    m, t = cfg.model, cfg.trainer
    _choice(t.precision, "trainer.precision", ("32", "bf16"))
    if t.devices is not None:
        _need(
            t.devices * t.num_nodes == world_size,
            "trainer.devices",
            f"trainer.devices ({t.devices}) x trainer.num_nodes ({t.num_nodes}) != launched world "
            f"size {world_size}; launch with torchrun --nproc_per_node {t.devices} or set trainer.devices=null",
        )
    tp, pp, vpp = (
        m.tensor_model_parallel_size,
        m.pipeline_model_parallel_size,
        m.virtual_pipeline_model_parallel_size,
    )
    for key, value in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp)):
        _need(value >= 1, f"model.{key}", f"must be >= 1, got {value}")
    dp = data_parallel_size(cfg, world_size)
    _need(
        m.num_attention_heads % tp == 0,
        "model.num_attention_heads",
        f"{m.num_attention_heads} heads not divisible by TP={tp}",
    )
    groups = m.num_query_groups or m.num_attention_heads
    _need(
        groups % tp == 0,
        "model.num_query_groups",
        f"{groups} query groups not divisible by TP={tp}",
    )
    _need(
        not m.sequence_parallel or tp > 1,
        "model.sequence_parallel",
        "needs tensor_model_parallel_size > 1",
    )
    if vpp is not None:
        _need(
            pp > 1,
            "model.virtual_pipeline_model_parallel_size",
            "needs pipeline_model_parallel_size > 1",
        )
        _need(
            m.num_layers % (pp * vpp) == 0,
            "model.num_layers",
            f"{m.num_layers} layers not divisible by PP x VPP = {pp * vpp}",
        )
    else:
        _need(
            m.num_layers % pp == 0,
            "model.num_layers",
            f"{m.num_layers} layers not divisible by PP={pp}",
        )
    _need(m.micro_batch_size >= 1, "model.micro_batch_size", "must be >= 1")
    _need(
        m.logprob_chunk_size >= 0,
        "model.logprob_chunk_size",
        f"must be >= 0 (0 computes full logits), got {m.logprob_chunk_size}",
    )
    _need(
        m.global_batch_size % (m.micro_batch_size * dp) == 0,
        "model.global_batch_size",
        f"{m.global_batch_size} is not divisible by micro_batch_size ({m.micro_batch_size}) x "
        f"data-parallel size ({dp})",
    )
    per_rank = m.global_batch_size // dp
    if vpp is not None:
        num_micro = per_rank // m.micro_batch_size
        _need(
            num_micro % pp == 0,
            "model.global_batch_size",
            f"interleaved pipelining needs micro-batches per step ({num_micro}) divisible by PP={pp}",
        )
    _choice(m.normalization, "model.normalization", ("RMSNorm", "LayerNorm"))
    _choice(m.activation, "model.activation", ("swiglu", "gelu", "relu"))
    _choice(
        m.position_embedding_type, "model.position_embedding_type", ("rope", "learned_absolute")
    )
    _choice(
        m.activations_checkpoint_granularity,
        "model.activations_checkpoint_granularity",
        (None, "full", "selective"),
    )
    _choice(m.data.truncation_mode, "model.data.truncation_mode", ("keep_end", "keep_start"))
    _choice(m.tokenizer.library, "model.tokenizer.library", ("sentencepiece", "huggingface"))
    _choice(m.optim.name, "model.optim.name", ("adam", "fused_adam", "distributed_fused_adam"))
    _choice(m.optim.sched.name, "model.optim.sched.name", ("CosineAnnealing", "Constant", "Linear"))
    _need(
        len(m.optim.betas) == 2, "model.optim.betas", f"needs two values, got {list(m.optim.betas)}"
    )
    _need(m.optim.lr > 0, "model.optim.lr", "must be > 0")
    _need(
        len(m.data.data_prefix.train) > 0, "model.data.data_prefix.train", "no training files given"
    )
    _need(m.data.pad_to_multiple_of >= 1, "model.data.pad_to_multiple_of", "must be >= 1")
    max_len = m.data.max_length or m.encoder_seq_length
    _need(
        max_len <= m.encoder_seq_length,
        "model.data.max_length",
        f"{max_len} exceeds model.encoder_seq_length {m.encoder_seq_length}",
    )
    loop = t.kto if algorithm == "kto" else t.dpo
    key = f"trainer.{algorithm}"
    _need(
        loop.max_epochs >= 1 or loop.max_steps > 0,
        f"{key}.max_epochs",
        "set max_epochs >= 1 or max_steps > 0",
    )
    _need(loop.val_check_interval > 0, f"{key}.val_check_interval", "must be > 0")
    _need(loop.gradient_clip_val >= 0, f"{key}.gradient_clip_val", "must be >= 0")
    if algorithm == "kto":
        k = m.kto
        _choice(k.loss_type, "model.kto.loss_type", ("kto", "apo_zero_unpaired"))
        _choice(
            k.reference_policy,
            "model.kto.reference_policy",
            ("cpu_swap", "separate", "precomputed"),
        )
        _need(k.ref_policy_kl_penalty > 0, "model.kto.ref_policy_kl_penalty", "β must be > 0")
        _need(
            k.desirable_loss_weight >= 0 and k.undesirable_loss_weight >= 0,
            "model.kto.desirable_loss_weight",
            "weights must be >= 0",
        )
        _need(
            m.global_batch_size >= 2,
            "model.global_batch_size",
            "KL pairs need >= 2 examples per global batch (prompt i is paired with completion "
            f"i+1 mod the global batch size), got {m.global_batch_size}",
        )
        fwd = k.log_prob_forward_micro_batch_size
    else:
        d = m.dpo
        _choice(d.loss_type, "model.dpo.loss_type", ("sigmoid", "ipo", "hinge"))
        _choice(
            d.reference_policy,
            "model.dpo.reference_policy",
            ("cpu_swap", "separate", "precomputed"),
        )
        _need(d.ref_policy_kl_penalty > 0, "model.dpo.ref_policy_kl_penalty", "β must be > 0")
        _need(0.0 <= d.label_smoothing < 0.5, "model.dpo.label_smoothing", "must be in [0, 0.5)")
        fwd = d.log_prob_forward_micro_batch_size
    if fwd is not None:
        _need(
            per_rank % fwd == 0,
            f"model.{algorithm}.log_prob_forward_micro_batch_size",
            f"must divide the per-rank batch {per_rank}",
        )
    fwd = fwd or m.micro_batch_size
    if vpp is not None:
        # Forward-only passes (reference, KL rows) also run the interleaved schedule.
        _need(
            (per_rank // fwd) % pp == 0,
            f"model.{algorithm}.log_prob_forward_micro_batch_size",
            f"interleaved pipelining needs forward micro-batches per step ({per_rank // fwd}) "
            f"divisible by PP={pp}",
        )


def _suggestion(key: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_known_keys(cfg: Any) -> None:
    """Reject keys the schema does not define.

    Hydra already rejects unknown keys in YAML files and plain `key=value` overrides; a
    `+key=value` override, however, adds a key to any node, and such a key would be silently
    ignored. A dataclass config cannot hold unknown keys and is not checked.

    Raises:
        ConfigError: naming the first unknown key (with the closest known one, if any).
    """
    from omegaconf import DictConfig, OmegaConf

    from megatron_kto.config.schema import AlignmentConfig

    if not isinstance(cfg, DictConfig):
        return

    def walk(node: DictConfig, schema: DictConfig, prefix: str) -> None:
        for key in node.keys():
            if key not in schema:
                raise ConfigError(
                    f"{prefix}{key}: unknown config key{_suggestion(str(key), schema.keys())}"
                )
            child, expected = node._get_node(key), schema._get_node(key)
            if isinstance(child, DictConfig) and isinstance(expected, DictConfig):
                walk(child, expected, f"{prefix}{key}.")

    walk(cfg, OmegaConf.structured(AlignmentConfig), "")


def _exception_chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def composition_error_line(error: BaseException) -> str:
    """One line describing why Hydra/OmegaConf could not compose the config, key first.

    Hydra's own report spans several lines (override, OmegaConf's key/type dump, a hint about
    HYDRA_FULL_ERROR); this keeps what a user needs: the full key and the problem, plus the
    closest known key for a typo.
    """
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    for e in _exception_chain(error):
        if isinstance(e, OmegaConfBaseException) and e.full_key:
            if isinstance(e, ConfigKeyError | ConfigAttributeError):
                known = (
                    [f.name for f in dataclasses.fields(e.object_type)]
                    if dataclasses.is_dataclass(e.object_type)
                    else []
                )
                return f"{e.full_key}: unknown config key{_suggestion(str(e.key), known)}"
            # The first line is the problem; the rest is OmegaConf's key/type dump.
            lines = str(e.msg or e).strip().splitlines()
            return f"{e.full_key}: {lines[0] if lines else type(e).__name__}"
    if isinstance(error, OverrideParseException):
        return f"cannot parse override {error.override!r}: {str(error).splitlines()[0]}"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    first = lines[0] if lines else type(error).__name__
    if isinstance(error, MissingConfigException) and error.options:
        first += f" (available: {', '.join(error.options)})"
    return first


def run_entry_point(hydra_main: Callable[[], Any]) -> None:
    """Call a `@hydra.main` function; if the config cannot be composed (unknown key, value of
    the wrong type, override syntax, missing config file or group option), exit with code 2 and
    one `error:` line instead of Hydra's multi-line report.

    Errors raised while the run itself executes are not touched here (`run.main` reports the
    known ones in one line; anything else keeps its traceback).
    """
    from hydra.errors import HydraException

    # Without this Hydra prints its report itself and exits 1; with it, Hydra re-raises.
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        hydra_main()
    except HydraException as e:
        print(f"error: {composition_error_line(e)}", file=sys.stderr, flush=True)
        sys.exit(2)
