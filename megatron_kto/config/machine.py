"""What a configuration means on this machine: `trainer.precision` (spellings, and its
device-dependent default) and the attention backend the run will use — the checks that read the
machine rather than the config alone (see `runtime.attention_backend`, `runtime.gpu_settings`).
"""

from __future__ import annotations

from typing import Any

from megatron_kto.config.errors import ConfigError

__all__ = ["PRECISIONS", "attention_choice", "canonical_precision", "device_precision"]

#: trainer.precision spellings (NeMo/Lightning's) -> what the run does.
PRECISIONS = {
    "32": "32",
    "32-true": "32",
    "bf16": "bf16",
    "bf16-mixed": "bf16",
    "16": "16",
    "16-mixed": "16",
}


def device_precision(cuda: bool) -> str:
    """What an unset `trainer.precision` means: 'bf16' on CUDA, '32' on a CPU (where
    half-precision matmuls run about 10x slower than fp32)."""
    return "bf16" if cuda else "32"


def canonical_precision(value: Any) -> str:
    """'32', 'bf16' or '16' for any accepted `trainer.precision` spelling.

    The "-mixed" spellings mean what NeMo does with megatron_amp_O2: half-precision weights and
    compute with an fp32 master copy in the optimizer (fp16 adds dynamic loss scaling).

    Raises:
        ConfigError: naming trainer.precision and the accepted values.
    """
    key = str(value)
    if key not in PRECISIONS:
        raise ConfigError(f"trainer.precision: must be one of {list(PRECISIONS)}, got {value!r}")
    return PRECISIONS[key]


def attention_choice(cfg: Any, accelerator: Any = None) -> Any:
    """The attention backend the run will use (`runtime.attention_backend`) and why.

    Args:
        cfg: the composed config, precision and architecture resolved.
        accelerator: the machine (`gpu_settings.Accelerator`); default: this one.

    Returns:
        An `AttentionChoice`.

    Raises:
        ConfigError: the configured backend cannot run here, or nothing can (one line naming
            the key and what to set instead).
    """
    from megatron_kto.config.schema import architecture_of
    from megatron_kto.runtime.attention_backend import (
        AttentionFeatures,
        choose_attention_backend,
    )
    from megatron_kto.runtime.gpu_settings import Accelerator

    m = cfg.model
    features = AttentionFeatures.of(architecture_of(m))
    try:
        return choose_attention_backend(
            m.attention_backend,
            precision=canonical_precision(cfg.trainer.precision),
            packed=m.data.pack_sequences,
            accelerator=accelerator or Accelerator.detect(),
            features=features,
            sequence_parallel=m.sequence_parallel,
            context_parallel_size=m.context_parallel_size,
        )
    except ValueError as e:
        # The message already starts with the key.
        raise ConfigError(str(e)) from e
