"""KTO loss math (Ethayarajh et al. 2024, https://arxiv.org/abs/2402.01306) on plain tensors.

Notation (DESIGN.md section 1): for example i, ``policy_logps[i]`` and ``ref_logps[i]`` are the
log-probs of the completion summed over its tokens; r_i = policy_logps[i] − ref_logps[i]; β is
``beta``; z₀ is the KL reference point.

``loss_type="kto"``
    desirable:   λ_D · (1 − σ(β(r − z₀)))
    undesirable: λ_U · (1 − σ(β(z₀ − r)))
``loss_type="apo_zero_unpaired"`` (APO-zero, unpaired; https://arxiv.org/abs/2408.06266)
    desirable:   λ_D · (1 − σ(βr))
    undesirable: λ_U · σ(βr)

Nothing here talks to other ranks: the caller all-reduces the KL sums, calls
:func:`kl_reference_point` and passes z₀ in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from megatron_kto.losses._common import (
    as_float,
    check_batch,
    mean_or_normalized,
    per_token_mean,
    sft_nll,
)

KTOLossType = Literal["kto", "apo_zero_unpaired"]
KTO_LOSS_TYPES: tuple[str, ...] = ("kto", "apo_zero_unpaired")


def uses_kl_reference_point(loss_type: str) -> bool:
    """Whether the loss reads z₀ — if not, the KL rows need no forward pass at all (TRL 1.16
    skips them too for ``apo_zero_unpaired`` and logs ``kl`` = 0)."""
    if loss_type not in KTO_LOSS_TYPES:
        raise ValueError(f"unknown KTO loss_type {loss_type!r}; expected one of {KTO_LOSS_TYPES}")
    return loss_type == "kto"


@dataclass(frozen=True)
class KTOLossOutput:
    """Per-example KTO results.

    Attributes:
        losses: [B] weighted preference loss per example (λ already applied), with grad.
        rewards: [B] implicit rewards β·r, detached.
    """

    losses: Tensor
    rewards: Tensor


@dataclass(frozen=True)
class KTOTotalLossOutput:
    """What the model's loss function needs from one call.

    Attributes:
        loss: scalar, Σ_i per_example[i] / normalizer (the mean over the given examples by
            default); this is what gets back-propagated.
        per_example: [B] preference_loss_weight · kto loss + sft_loss_weight · sft term, with
            grad (use ``.detach()`` for the ``loss`` metric).
        kto_losses: [B] the preference part alone (unweighted by preference_loss_weight).
        sft_terms: [B] the un-weighted SFT NLL (0 for undesirable rows, all 0 when the SFT
            weight is 0).
        rewards: [B] β·r, detached.
    """

    loss: Tensor
    per_example: Tensor
    kto_losses: Tensor
    sft_terms: Tensor
    rewards: Tensor


def kl_reference_point(sum_r_kl: Tensor | float, count: Tensor | float) -> Tensor:
    """KL reference point z₀ = max(0, sum_r_kl / count), detached; 0 when count is 0.

    Args:
        sum_r_kl: Σ over the KL rows of (policy − ref) summed log-probs, already reduced over
            every data-parallel rank (so the mean is sample-weighted, not a mean of means).
        count: number of KL rows behind ``sum_r_kl`` (also already reduced).

    Returns:
        0-d float tensor (float32 at least) on the device of ``sum_r_kl``, no grad.
    """
    total = as_float(torch.as_tensor(sum_r_kl).detach())
    n = torch.as_tensor(count, device=total.device).to(total.dtype).detach()
    safe_n = torch.where(n > 0, n, torch.ones_like(n))
    mean = torch.where(n > 0, total / safe_n, torch.zeros_like(total))
    return mean.clamp(min=0.0).reshape(())


def kto_loss(
    policy_logps: Tensor,
    ref_logps: Tensor,
    desirable: Tensor,
    kl: Tensor | float,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    loss_type: KTOLossType = "kto",
) -> KTOLossOutput:
    """Per-example KTO (or unpaired APO-zero) loss.

    Args:
        policy_logps: [B] summed completion log-probs under the policy (with grad).
        ref_logps: [B] summed completion log-probs under the reference (treated as constant).
        desirable: [B] bool (or 0/1), True for desirable examples.
        kl: scalar z₀ from :func:`kl_reference_point` (treated as constant; unused by
            ``apo_zero_unpaired``).
        beta: β, the ``ref_policy_kl_penalty``.
        desirable_weight: λ_D.
        undesirable_weight: λ_U.
        loss_type: ``"kto"`` or ``"apo_zero_unpaired"``.

    Returns:
        :class:`KTOLossOutput` with ``losses`` and ``rewards``, both [B] float32 (or wider).

    Raises:
        ValueError: on an unknown ``loss_type``, β ≤ 0 or mismatched shapes.
    """
    if loss_type not in KTO_LOSS_TYPES:
        raise ValueError(f"unknown KTO loss_type {loss_type!r}; expected one of {KTO_LOSS_TYPES}")
    if beta <= 0:
        raise ValueError(f"beta (ref_policy_kl_penalty) must be > 0, got {beta}")
    check_batch({"policy_logps": policy_logps, "ref_logps": ref_logps, "desirable": desirable})
    policy = as_float(policy_logps)
    # Gradient flows to the policy only: the reference and z₀ are constants of the step.
    ref = as_float(ref_logps.detach()).to(policy.dtype)
    z0 = torch.as_tensor(kl, device=policy.device).detach().to(policy.dtype)
    is_desirable = desirable.bool()

    logratio = policy - ref
    if loss_type == "kto":
        # 1 − σ(x) is written σ(−x): equal in exact arithmetic, but σ(−x) keeps precision when
        # σ(x) rounds to 1 in float32.
        desirable_losses = torch.sigmoid(-beta * (logratio - z0))
        undesirable_losses = torch.sigmoid(-beta * (z0 - logratio))
    else:  # apo_zero_unpaired
        desirable_losses = torch.sigmoid(-beta * logratio)
        undesirable_losses = torch.sigmoid(beta * logratio)

    losses = torch.where(
        is_desirable,
        desirable_weight * desirable_losses,
        undesirable_weight * undesirable_losses,
    )
    return KTOLossOutput(losses=losses, rewards=(beta * logratio).detach())


def kto_total_loss(
    policy_logps: Tensor,
    ref_logps: Tensor,
    desirable: Tensor,
    kl: Tensor | float,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    loss_type: KTOLossType = "kto",
    sft_loss_weight: float = 0.0,
    num_tokens: Tensor | None = None,
    normalizer: float | Tensor | None = None,
    average_log_probs: bool = False,
    sft_average_log_probs: bool = True,
    preference_loss_weight: float = 1.0,
) -> KTOTotalLossOutput:
    """KTO loss plus the optional SFT term, reduced to the scalar that gets back-propagated.

    loss = Σ_i (preference_loss_weight · kto_loss_i + sft_loss_weight · sft_nll_i) / normalizer,
    where ``normalizer`` defaults to B (i.e. the mean over the given examples).

    Args:
        policy_logps, ref_logps: [B] completion log-probs **summed** over tokens.
        desirable, kl, beta, desirable_weight, undesirable_weight, loss_type: as in
            :func:`kto_loss` (``kl`` must be computed with the same ``average_log_probs``).
        sft_loss_weight: weight of the SFT term (0 disables it).
        num_tokens: [B] completion token counts; required for the SFT term and for
            ``average_log_probs``.
        normalizer: divide the sum by this instead of B (e.g. the global batch size when
            micro-batch losses are summed rather than averaged).
        average_log_probs: the rewards use per-token mean log-probs (NeMo-Aligner's
            ``preference_average_log_probs``): r = (policy − ref) / num_tokens.
        sft_average_log_probs: the SFT NLL per token (True) or summed (False).
        preference_loss_weight: weight of the KTO term.

    Returns:
        :class:`KTOTotalLossOutput`.

    Raises:
        ValueError: if the SFT term or averaging is requested without ``num_tokens``.
    """
    if num_tokens is None and (sft_loss_weight != 0.0 or average_log_probs):
        raise ValueError(
            "sft_loss_weight is non-zero or average_log_probs is set but num_tokens was not "
            "given; pass the per-example completion token counts"
        )
    if average_log_probs:
        policy_pref = per_token_mean(policy_logps, num_tokens)
        ref_pref = per_token_mean(ref_logps.detach(), num_tokens)
    else:
        policy_pref, ref_pref = policy_logps, ref_logps
    out = kto_loss(
        policy_pref,
        ref_pref,
        desirable,
        kl,
        beta,
        desirable_weight=desirable_weight,
        undesirable_weight=undesirable_weight,
        loss_type=loss_type,
    )
    per_example = preference_loss_weight * out.losses
    if sft_loss_weight != 0.0:
        sft_terms = sft_nll(policy_logps, num_tokens, desirable, average=sft_average_log_probs)
        per_example = per_example + sft_loss_weight * sft_terms
    else:
        sft_terms = torch.zeros_like(out.losses)
    return KTOTotalLossOutput(
        loss=mean_or_normalized(per_example, normalizer),
        per_example=per_example,
        kto_losses=out.losses,
        sft_terms=sft_terms,
        rewards=out.rewards,
    )
