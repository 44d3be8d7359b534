"""Small helpers shared by the KTO and DPO loss modules (input checks, dtype, SFT term)."""

from __future__ import annotations

import torch
from torch import Tensor


def as_float(x: Tensor) -> Tensor:
    """Return ``x`` in at least float32, keeping the autograd graph.

    Summed log-probs of long completions are large numbers whose differences matter; bf16/fp16
    keep only 8/11 bits of mantissa, so the loss math always runs in float32 or wider.
    """
    if not x.is_floating_point() or torch.finfo(x.dtype).bits < 32:
        return x.float()
    return x


def check_batch(name_to_tensor: dict[str, Tensor]) -> int:
    """Check that every tensor is 1-D with the same length; return that length.

    Raises:
        ValueError: naming the offending argument and its shape.
    """
    size: int | None = None
    first = ""
    for name, t in name_to_tensor.items():
        if t.dim() != 1:
            raise ValueError(
                f"{name} must be a 1-D tensor of shape [B], got shape {tuple(t.shape)}"
            )
        if size is None:
            size, first = t.shape[0], name
        elif t.shape[0] != size:
            raise ValueError(
                f"{name} has {t.shape[0]} rows but {first} has {size}; all per-example inputs "
                "must have the same batch size"
            )
    return 0 if size is None else size


def per_token_mean(logps_sum: Tensor, num_tokens: Tensor) -> Tensor:
    """Length-normalised log-probs: ``logps_sum / num_tokens`` (a 0-token row gives 0, not NaN).

    Args:
        logps_sum: [B] log-probs summed over each completion (grad flows through).
        num_tokens: [B] completion token counts (constants).
    """
    check_batch({"logps_sum": logps_sum, "num_tokens": num_tokens})
    logps = as_float(logps_sum)
    return logps / num_tokens.to(logps.dtype).clamp(min=1.0)


def sft_nll(
    policy_logps_sum: Tensor, num_tokens: Tensor, desirable: Tensor, average: bool = True
) -> Tensor:
    """Per-example negative log-likelihood of the desirable completions.

    NLL_i = −policy_logps_sum_i / num_tokens_i (``average``, the default: per token, so the
    caller's mean over examples weighs each desirable completion equally whatever its length)
    or −policy_logps_sum_i (summed over the completion, NeMo-Aligner's
    ``sft_average_log_probs: false``) for desirable rows, and 0 for the others. A row with zero
    completion tokens contributes 0, never NaN.

    Args:
        policy_logps_sum: [B] summed completion log-probs of the policy (with grad).
        num_tokens: [B] number of completion tokens per example.
        desirable: [B] bool, True where the completion should be imitated.
        average: per-token mean (True) or sum (False).

    Returns:
        [B] float tensor, differentiable w.r.t. ``policy_logps_sum``.
    """
    check_batch(
        {"policy_logps_sum": policy_logps_sum, "num_tokens": num_tokens, "desirable": desirable}
    )
    nll = -(per_token_mean(policy_logps_sum, num_tokens) if average else as_float(policy_logps_sum))
    return torch.where(desirable.bool(), nll, torch.zeros_like(nll))


def mean_or_normalized(per_example: Tensor, normalizer: float | Tensor | None) -> Tensor:
    """Sum of ``per_example`` divided by ``normalizer`` (default: the number of rows).

    The model code passes the global batch size here when it splits a global batch into
    micro-batches whose losses are summed, so the step loss is still the global-batch mean.
    An empty batch gives 0 (with a graph), never NaN.
    """
    if normalizer is None:
        normalizer = max(per_example.shape[0], 1)
    return per_example.sum() / normalizer
