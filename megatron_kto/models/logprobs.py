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


def token_logprobs(vocab_parallel_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log π(label_t | tokens_≤t) for every position, 0 where the label is `IGNORE_INDEX`.

    Args:
        vocab_parallel_logits: [B, T, V/TP] logits of this TP rank (any float dtype).
        labels: [B, T] next-token targets, `IGNORE_INDEX` for prompt and padding positions.

    Returns:
        [B, T] float32 log-probabilities (differentiable w.r.t. the logits).
    """
    mask = labels != IGNORE_INDEX
    target = torch.where(mask, labels, torch.zeros_like(labels))
    # `.float()` returns the same tensor for fp32 logits, and megatron's function normalises its
    # input in place; callers that still need raw logits must read them before this call.
    neg_logp = tensor_parallel.vocab_parallel_cross_entropy(vocab_parallel_logits.float(), target)
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


def mean_logit_sums(
    vocab_parallel_logits: torch.Tensor, labels: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Per-sequence sum over scored positions of the mean logit over the vocabulary.

    Used for TRL's `logits/chosen|rejected` metrics. Reduces over the TP group (a [B, T] tensor,
    not the vocabulary); call before `token_logprobs` overwrites fp32 logits.

    Args:
        vocab_parallel_logits: [B, T, V/TP] logits of this TP rank.
        labels: [B, T] targets with `IGNORE_INDEX`.
        vocab_size: the full (padded) vocabulary size to average over.

    Returns:
        [B] detached float32 sums; divide by the token count for a mean.
    """
    with torch.no_grad():
        per_token = vocab_parallel_logits.float().sum(dim=-1)
        torch.distributed.all_reduce(
            per_token, group=parallel_state.get_tensor_model_parallel_group()
        )
        per_token = per_token / vocab_size
        return (per_token * (labels != IGNORE_INDEX)).sum(dim=-1)
