"""Per-token log-probabilities from vocabulary-parallel logits.

The logits of a TP rank hold only its slice of the vocabulary. megatron-core's
`vocab_parallel_cross_entropy` already computes −log softmax(target) with max / sum-exp /
target-logit all-reduces over the TP group (never gathering the vocabulary), and it has the
matching backward; we use it rather than writing a second one.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state, tensor_parallel

IGNORE_INDEX = -100


def real_columns(vocab_parallel_logits: torch.Tensor, vocab_size: int | None) -> int:
    """How many of this TP rank's logit columns are real tokens (the rest pad the vocabulary
    to a TP-divisible size; they are not tokens and take no part in the softmax)."""
    width = vocab_parallel_logits.shape[-1]
    if vocab_size is None:
        return width
    start = parallel_state.get_tensor_model_parallel_rank() * width
    return max(0, min(width, vocab_size - start))


def token_logprobs(
    vocab_parallel_logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None
) -> torch.Tensor:
    """log π(label_t | tokens_≤t) for every position, 0 where the label is `IGNORE_INDEX`.

    Args:
        vocab_parallel_logits: [B, T, V/TP] logits of this TP rank (any float dtype).
        labels: [B, T] next-token targets, `IGNORE_INDEX` for prompt and padding positions.
        vocab_size: the real vocabulary size; padded columns beyond it are excluded from the
            softmax, so log-probs equal those of the unpadded model (e.g. a Hugging Face one).
            None: every column counts.

    Returns:
        [B, T] float32 log-probabilities (differentiable w.r.t. the logits).
    """
    mask = labels != IGNORE_INDEX
    target = torch.where(mask, labels, torch.zeros_like(labels))
    logits = vocab_parallel_logits.float()
    real = real_columns(logits, vocab_size)
    if real < logits.shape[-1]:
        # Out of place (the caller's logits stay intact); finite, so max-subtraction cannot NaN.
        padded = torch.arange(logits.shape[-1], device=logits.device) >= real
        logits = logits.masked_fill(padded, torch.finfo(logits.dtype).min)
    # megatron's function normalises its input in place; for fp32 logits without padding that is
    # the caller's tensor, so callers that still need raw logits must read them before this call.
    neg_logp = tensor_parallel.vocab_parallel_cross_entropy(logits, target)
    return -neg_logp * mask


def masked_sum(
    token_values: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence sum of `token_values` over scored positions, and the number of those positions.

    Returns:
        (sum [B], count [B]); mean = sum / count.clamp(min=1).
    """
    mask = labels != IGNORE_INDEX
    return (token_values * mask).sum(dim=-1), mask.sum(dim=-1)


def masked_mean(token_values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean over scored positions (0 for a sequence with none)."""
    total, count = masked_sum(token_values, labels)
    return total / count.clamp(min=1)


def mean_logits(vocab_parallel_logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Per-position mean logit over the real vocabulary ([..., T] float32, no gradient).

    Reduces over the TP group (a [..., T] tensor, not the vocabulary); call before
    `token_logprobs` overwrites fp32 logits.
    """
    with torch.no_grad():
        real = real_columns(vocab_parallel_logits, vocab_size)
        per_token = vocab_parallel_logits[..., :real].float().sum(dim=-1)
        torch.distributed.all_reduce(
            per_token, group=parallel_state.get_tensor_model_parallel_group()
        )
        return per_token / vocab_size


def mean_logit_sums(
    vocab_parallel_logits: torch.Tensor, labels: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Per-sequence sum over scored positions of the mean logit over the vocabulary.

    Used for TRL's `logits/chosen|rejected` metrics. Reduces over the TP group (a [B, T] tensor,
    not the vocabulary); call before `token_logprobs` overwrites fp32 logits.

    Args:
        vocab_parallel_logits: [B, T, V/TP] logits of this TP rank.
        labels: [B, T] targets with `IGNORE_INDEX`.
        vocab_size: the real vocabulary size to average over (padded columns are left out).

    Returns:
        [B] detached float32 sums; divide by the token count for a mean.
    """
    return (mean_logits(vocab_parallel_logits, vocab_size) * (labels != IGNORE_INDEX)).sum(dim=-1)


def position_columns(
    logp: torch.Tensor,
    mask: torch.Tensor,
    logit_mean: torch.Tensor,
    weights: torch.Tensor | None,
    nll_only: torch.Tensor | None,
) -> torch.Tensor:
    """Per-position values whose row sums are the statistics' columns ([n, 3], or [n, 5] with
    `nll_only`).

    Args:
        logp: [n] log-probs of the positions' labels.
        mask: [n] 1 where a label is scored, 0 elsewhere.
        logit_mean: [n] mean logit over the real vocabulary (0 where not scored).
        weights: [n] LD-DPO weights of the log-probs in `LOGP_SUM`, or None.
        nll_only: [n] 1 where the label is scored for the NLL columns only, or None.
    """
    weighted = logp if weights is None else logp * weights
    if nll_only is None:
        return torch.stack([weighted, mask, logit_mean], dim=-1)
    keep = mask * (1 - nll_only.to(mask.dtype))
    columns = [weighted * keep, keep, logit_mean * keep, logp * mask, mask]
    return torch.stack(columns, dim=-1)
