"""The masks SDPA attention builds itself: sliding-window bands, and megatron's boolean masks in
SDPA's additive form (`models.attention`, `models.cp_attention`)."""

from __future__ import annotations

import functools

import torch


def window_mask(sq: int, sk: int, window: int, device: torch.device) -> torch.Tensor:
    """Causal sliding-window mask [sq, sk], True = masked: the queries are the last `sq` of the
    `sk` positions (bottom-right aligned), and query position p sees keys p − window + 1 .. p."""
    q = torch.arange(sk - sq, sk, device=device)[:, None]
    k = torch.arange(sk, device=device)[None]
    return (k > q) | (k <= q - window)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """megatron's boolean mask (True = masked) as SDPA's additive one: 0 or the dtype's minimum.

    Finite, not -inf: a query row whose keys are all masked (a padding row under a padding mask)
    would be NaN with -inf fills and poison the backward; with the dtype's minimum it is uniform,
    as megatron's masked_fill(-10000) softmax gives, and its output is discarded anyway.
    """
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        mask, torch.finfo(dtype).min
    )


@functools.lru_cache(maxsize=8)
def window_band(window: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The additive [W, 2W − 1] band mask of a full query block of `SDPAttention._windowed`
    (W queries, the last W of 2W − 1 key positions); a shorter last block of c queries takes its
    top-left [c, c + W − 1] corner. Built once per (window, dtype, device) and shared by every
    layer and micro-batch, so autograd keeps one copy (W·(2W − 1) elements) however many layers
    save it."""
    return additive_mask(window_mask(window, 2 * window - 1, window, device), dtype)
