"""LD-DPO's token weights (Liu et al. 2024, "Length Desensitization in DPO"; TRL's ``ld_alpha``).

A pair's chosen and rejected completions share their first m = min(n_c, n_r) tokens' worth of
"public length"; the log-prob of a completion becomes

    ℓ = Σ_{t ≤ m} log π(y_t | …) + α · Σ_{t > m} log π(y_t | …)

for the policy and the reference alike (so the longer completion's excess tokens count α times).
TRL 1.16's ``DPOTrainer`` counts t over the completion tokens in order; here that is a weight
per scored position (1 up to the m-th completion token, α after it, 0 where nothing is scored),
which the forward pass multiplies into each token's log-prob before summing.
"""

from __future__ import annotations

import torch
from torch import Tensor


def ld_token_weights(
    chosen_scored: Tensor, rejected_scored: Tensor, alpha: float
) -> tuple[Tensor, Tensor]:
    """Per-position weights of a batch of pairs.

    Args:
        chosen_scored: [B, T] bool, True at the chosen completions' scored positions.
        rejected_scored: [B, T'] bool, the rejected completions'.
        alpha: α ∈ [0, 1], the weight of the tokens beyond the shorter completion's length.

    Returns:
        ([B, T], [B, T']) float32 weights.
    """

    def weights(scored: Tensor, shared: Tensor) -> Tensor:
        ordinal = scored.long().cumsum(dim=1)  # 1 at the first completion token
        head = torch.ones((), dtype=torch.float32, device=scored.device)
        tail = torch.full((), float(alpha), dtype=torch.float32, device=scored.device)
        w = torch.where(ordinal <= shared[:, None], head, tail)
        return w * scored

    shared = torch.minimum(chosen_scored.sum(dim=1), rejected_scored.sum(dim=1))
    return weights(chosen_scored, shared), weights(rejected_scored, shared)
