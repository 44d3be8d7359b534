"""DPO-family loss math on plain tensors.

For pair i, h_i = (π_c − ref_c) − (π_r − ref_r), the difference of the chosen and rejected
policy/reference log-ratios ("logits" below); β is ``beta``; ε is ``label_smoothing``.

``sigmoid`` (DPO, https://arxiv.org/abs/2305.18290; with ε > 0 the conservative DPO of
    Mitchell 2023, "A note on DPO with noisy preferences"):
    −(1 − ε) · log σ(β h) − ε · log σ(−β h)
``ipo`` (https://arxiv.org/abs/2310.12036, eq. 17, β plays τ):  (h − 1/(2β))²
``hinge`` (SLiC, https://arxiv.org/abs/2305.10425):  max(0, 1 − β h)

**Length normalisation is the caller's job**: pass per-token-mean log-probs (summed log-prob ÷
completion token count, for policy *and* reference) instead of sums and every formula above
becomes its length-normalised variant. TRL's ``ipo`` always normalises this way, so to match
TRL's IPO pass per-token means.

TRL 1.16 no longer applies ``label_smoothing`` to ``sigmoid`` (it only uses it in its ``robust``
and ``exo_pair`` losses); this module keeps the conservative-DPO form, which reduces to TRL's
``sigmoid`` at ε = 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_kto.losses._common import as_float, check_batch, mean_or_normalized, sft_nll

DPOLossType = Literal["sigmoid", "ipo", "hinge"]
DPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "ipo", "hinge")


@dataclass(frozen=True)
class DPOLossOutput:
    """Per-pair DPO results.

    Attributes:
        losses: [B] loss per pair, with grad.
        chosen_rewards: [B] β·(π_c − ref_c), detached.
        rejected_rewards: [B] β·(π_r − ref_r), detached.
    """

    losses: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor


@dataclass(frozen=True)
class DPOTotalLossOutput:
    """What the model's loss function needs from one call.

    Attributes:
        loss: scalar Σ_i per_example[i] / normalizer (mean over pairs by default), with grad.
        per_example: [B] DPO loss + sft_loss_weight · SFT NLL of the chosen completion.
        dpo_losses: [B] the preference part alone.
        sft_terms: [B] un-weighted per-token-mean NLL of the chosen completion (0 if disabled).
        chosen_rewards: [B] detached.
        rejected_rewards: [B] detached.
    """

    loss: Tensor
    per_example: Tensor
    dpo_losses: Tensor
    sft_terms: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float,
    loss_type: DPOLossType = "sigmoid",
    label_smoothing: float = 0.0,
) -> DPOLossOutput:
    """Per-pair DPO / IPO / hinge loss.

    Args:
        policy_chosen_logps: [B] policy log-probs of the chosen completions (with grad); sums
            over completion tokens, or per-token means for length normalisation.
        policy_rejected_logps: [B] same for the rejected completions.
        ref_chosen_logps: [B] reference log-probs of the chosen completions (constant).
        ref_rejected_logps: [B] reference log-probs of the rejected completions (constant).
        beta: β (τ for IPO); must be > 0.
        loss_type: ``"sigmoid"``, ``"ipo"`` or ``"hinge"``.
        label_smoothing: ε ∈ [0, 0.5), the assumed probability that a preference label is
            flipped; only meaningful for ``sigmoid``.

    Returns:
        :class:`DPOLossOutput`.

    Raises:
        ValueError: on an unknown ``loss_type``, β ≤ 0, ε outside [0, 0.5), ε > 0 with a loss
            type that ignores it, or mismatched shapes.
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; expected one of {DPO_LOSS_TYPES}")
    if beta <= 0:
        raise ValueError(f"beta must be > 0 (IPO divides by it), got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if label_smoothing != 0.0 and loss_type != "sigmoid":
        # Silently ignoring it would make a config look like it did something it did not.
        raise ValueError(
            f"label_smoothing={label_smoothing} only applies to loss_type='sigmoid', "
            f"not {loss_type!r}; set label_smoothing to 0.0"
        )
    check_batch(
        {
            "policy_chosen_logps": policy_chosen_logps,
            "policy_rejected_logps": policy_rejected_logps,
            "ref_chosen_logps": ref_chosen_logps,
            "ref_rejected_logps": ref_rejected_logps,
        }
    )
    pc = as_float(policy_chosen_logps)
    pr = as_float(policy_rejected_logps).to(pc.dtype)
    # The reference is a constant of the step: no gradient may reach it.
    rc = as_float(ref_chosen_logps.detach()).to(pc.dtype)
    rr = as_float(ref_rejected_logps.detach()).to(pc.dtype)

    chosen_logratios = pc - rc
    rejected_logratios = pr - rr
    logits = chosen_logratios - rejected_logratios

    if loss_type == "sigmoid":
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * logits)
        if label_smoothing != 0.0:
            losses = losses - label_smoothing * F.logsigmoid(-beta * logits)
    elif loss_type == "ipo":
        losses = (logits - 1.0 / (2.0 * beta)) ** 2
    else:  # hinge
        losses = torch.relu(1.0 - beta * logits)

    return DPOLossOutput(
        losses=losses,
        chosen_rewards=(beta * chosen_logratios).detach(),
        rejected_rewards=(beta * rejected_logratios).detach(),
    )


def dpo_total_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float,
    loss_type: DPOLossType = "sigmoid",
    label_smoothing: float = 0.0,
    sft_loss_weight: float = 0.0,
    chosen_num_tokens: Tensor | None = None,
    normalizer: float | Tensor | None = None,
    average_log_probs: bool = False,
    sft_average_log_probs: bool = True,
    preference_loss_weight: float = 1.0,
) -> DPOTotalLossOutput:
    """DPO loss plus the optional SFT term on the chosen completions, reduced to a scalar.

    loss = Σ_i (preference_loss_weight · dpo_loss_i + sft_loss_weight · sft_nll_i) / normalizer,
    ``normalizer`` defaulting to B, where sft_nll_i is the chosen completion's NLL per token
    (``sft_average_log_probs``) or summed.

    Args:
        policy_chosen_logps .. label_smoothing: as in :func:`dpo_loss`.
        sft_loss_weight: weight of the SFT term (0 disables it).
        chosen_num_tokens: [B] chosen completion token counts; required when the SFT term is on.
        normalizer: divide the sum by this instead of B.
        average_log_probs: the given log-probs are per-token means (length normalisation);
            the SFT term then recovers the sums as mean × chosen_num_tokens.
        sft_average_log_probs: the SFT NLL per token (True) or summed (False).
        preference_loss_weight: weight of the DPO term.

    Returns:
        :class:`DPOTotalLossOutput`.

    Raises:
        ValueError: if the SFT term is requested without ``chosen_num_tokens``.
    """
    out = dpo_loss(
        policy_chosen_logps,
        policy_rejected_logps,
        ref_chosen_logps,
        ref_rejected_logps,
        beta,
        loss_type=loss_type,
        label_smoothing=label_smoothing,
    )
    if sft_loss_weight != 0.0:
        if chosen_num_tokens is None:
            raise ValueError(
                "sft_loss_weight is non-zero but chosen_num_tokens was not given; pass the chosen "
                "completion token counts"
            )
        all_chosen = torch.ones_like(policy_chosen_logps, dtype=torch.bool)
        sums = (
            as_float(policy_chosen_logps)
            * chosen_num_tokens.to(as_float(policy_chosen_logps).dtype)
            if average_log_probs
            else policy_chosen_logps
        )
        sft_terms = sft_nll(sums, chosen_num_tokens, all_chosen, average=sft_average_log_probs)
        per_example = preference_loss_weight * out.losses + sft_loss_weight * sft_terms
    else:
        sft_terms = torch.zeros_like(out.losses)
        per_example = preference_loss_weight * out.losses
    return DPOTotalLossOutput(
        loss=mean_or_normalized(per_example, normalizer),
        per_example=per_example,
        dpo_losses=out.losses,
        sft_terms=sft_terms,
        chosen_rewards=out.chosen_rewards,
        rejected_rewards=out.rejected_rewards,
    )
