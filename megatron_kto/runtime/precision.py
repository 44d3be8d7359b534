"""`trainer.precision` (canonical: '32', 'bf16', '16'; `config.machine.canonical_precision`) ->
the torch dtype a run computes and keeps its weights in. The one table of it."""

from __future__ import annotations

import torch

PRECISION_DTYPES: dict[str, torch.dtype] = {
    "32": torch.float32,
    "bf16": torch.bfloat16,
    "16": torch.float16,
}


def precision_dtype(precision: str) -> torch.dtype:
    """The dtype of a canonical precision ('32', 'bf16', '16').

    Raises:
        ValueError: any other value, naming trainer.precision.
    """
    if precision not in PRECISION_DTYPES:
        raise ValueError(f"trainer.precision must be '32', 'bf16' or '16', got {precision!r}")
    return PRECISION_DTYPES[precision]
