"""Precision names -> torch dtypes, the two tables of them:

- `PRECISION_DTYPES`: `trainer.precision` (canonical: '32', 'bf16', '16';
  `config.machine.canonical_precision`) -> the dtype a run computes and keeps its weights in;
- `EXPORT_DTYPES`: an export's `--dtype` / `exp_manager.save_hf_dtype` (Hugging Face's
  `torch_dtype` spelling) -> the dtype its weights are written in.
"""

from __future__ import annotations

import torch

PRECISION_DTYPES: dict[str, torch.dtype] = {
    "32": torch.float32,
    "bf16": torch.bfloat16,
    "16": torch.float16,
}

EXPORT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def precision_dtype(precision: str) -> torch.dtype:
    """The dtype of a canonical precision ('32', 'bf16', '16').

    Raises:
        ValueError: any other value, naming trainer.precision.
    """
    if precision not in PRECISION_DTYPES:
        raise ValueError(f"trainer.precision must be '32', 'bf16' or '16', got {precision!r}")
    return PRECISION_DTYPES[precision]
