"""DPO-family loss math on plain tensors: the per-pair losses of the catalogue
(:mod:`megatron_kto.losses.dpo_types`, one table keyed by ``loss_type``), a weighted mixture of
them (TRL's ``loss_type`` list with ``loss_weights``, MPO-style) and the optional SFT term.

For pair i, h_i = (π_c − ref_c) − (π_r − ref_r), the difference of the chosen and rejected
policy/reference log-ratios ("logits" below); β is ``beta``; ε is ``label_smoothing``.

**Length normalisation is the caller's job**: pass per-token-mean log-probs (summed log-prob ÷
completion token count, for policy *and* reference) instead of sums and every formula becomes
its length-normalised variant. TRL's ``ipo`` always normalises this way, so to match TRL's IPO
pass per-token means. ``sigmoid_norm`` and ``sft`` normalise by themselves from the token counts.

TRL 1.16 no longer applies ``label_smoothing`` to ``sigmoid`` (it only uses it in its ``robust``
and ``exo_pair`` losses); this module keeps the conservative-DPO form, which reduces to TRL's
``sigmoid`` at ε = 0.

**f-divergences** (:mod:`megatron_kto.losses.f_divergence`): with ``f_divergence_type`` other
than ``reverse_kl`` each log-ratio u is replaced by its score s(u) before the loss reads it (the
per-token variants divide the score by the token count, as TRL does); the reported rewards stay
β·u. With per-token-mean inputs the score is taken of the mean log-ratio, s(u/n), which is what
our length-normalised ``ipo`` then reads (TRL's ``ipo``: s(u)/n).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_kto.losses._common import (
    as_float,
    check_batch,
    mean_or_normalized,
    per_token_mean,
    sft_nll,
)
from megatron_kto.losses.batch_sort import SortPartners
from megatron_kto.losses.batch_sort import sort_partners as batch_sort_partners
from megatron_kto.losses.dpo_types import (
    DPO_LOSS_TYPES,
    DPO_LOSSES,
    DPOPairs,
    check_loss_mixture,
    loss_type_names,
    needs_reference,
    needs_rewards,
    sorts_batch,
)
from megatron_kto.losses.f_divergence import (
    DEFAULT_ALPHA,
    check_f_divergence,
    f_divergence_scores,
)

__all__ = ["DPO_LOSS_TYPES", "DPOLossOutput", "DPOTotalLossOutput", "dpo_loss", "dpo_total_loss"]

LossTypes = str | list[str] | tuple[str, ...]


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
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    beta: float,
    loss_type: LossTypes = "sigmoid",
    label_smoothing: float = 0.0,
    loss_weights: list[float] | tuple[float, ...] | None = None,
    discopop_tau: float = 0.05,
    chosen_num_tokens: Tensor | None = None,
    rejected_num_tokens: Tensor | None = None,
    average_log_probs: bool = False,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = DEFAULT_ALPHA,
    simpo_gamma: float = 0.5,
    cpo_alpha: float = 1.0,
    sort_partners: SortPartners | None = None,
    chosen_nll_logps: Tensor | None = None,
    chosen_nll_num_tokens: Tensor | None = None,
    reward_margins: Tensor | None = None,
) -> DPOLossOutput:
    """Per-pair DPO-family loss: one catalogue entry, or a weighted sum of several.

    losses_i = Σ_k loss_weights[k] · DPO_LOSSES[loss_type[k]](pair i).

    Args:
        policy_chosen_logps: [B] policy log-probs of the chosen completions (with grad); sums
            over completion tokens, or per-token means (``average_log_probs``).
        policy_rejected_logps: [B] same for the rejected completions.
        ref_chosen_logps: [B] reference log-probs of the chosen completions (constant); None
            for the reference-free loss types (``cpo``, ``simpo``, ``orpo``: ref = 0).
        ref_rejected_logps: [B] reference log-probs of the rejected completions (constant).
        beta: β (τ for IPO); must be > 0.
        loss_type: a name of :data:`DPO_LOSS_TYPES` or a list of them.
        label_smoothing: ε ∈ [0, 0.5), the assumed probability that a preference label is
            flipped; read by ``sigmoid`` (conservative DPO), ``robust`` and ``exo_pair`` (> 0).
        loss_weights: one weight per ``loss_type`` entry (default all 1).
        discopop_tau: τ of ``discopop``.
        chosen_num_tokens: [B] chosen completion token counts (``sigmoid_norm``, ``sft``).
        rejected_num_tokens: [B] rejected completion token counts (``sigmoid_norm``).
        average_log_probs: the given log-probs are already per-token means.
        f_divergence_type: the regulariser (``reverse_kl``, ``forward_kl``, ``js_divergence``,
            ``alpha_divergence``); other than ``reverse_kl`` only for the loss types of
            :data:`~megatron_kto.losses.f_divergence.F_DIVERGENCE_LOSS_TYPES`.
        f_alpha_divergence_coef: α of ``alpha_divergence``.
        simpo_gamma: γ, the target margin of ``simpo``.
        cpo_alpha: α, the weight of the chosen NLL in ``cpo`` and ``simpo``.
        sort_partners: the pairs' rank partners over the global batch (``aot``,
            ``aot_unpaired``); None: the pairs given are the whole batch, and they are computed
            from them.
        chosen_nll_logps: [B] summed log-probs the reference-free NLL reads instead of the
            chosen completions' (TRL's ORPO: prompt and completion tokens), with grad; None:
            the completions'.
        chosen_nll_num_tokens: [B] their token counts (with ``chosen_nll_logps``).
        reward_margins: [B] g = gt_reward_scale × (chosen reward − rejected reward) from the
            data, constant; read by the RPO losses (``rpo_sq``, ``rpo_fwd_kl``, ``rpo_bwd_kl``).

    Returns:
        :class:`DPOLossOutput`; the reference-free types' rewards are β × the policy log-probs
        (as TRL's CPO/ORPO trainers).

    Raises:
        ValueError: on an unknown ``loss_type``, β ≤ 0, ε outside [0, 0.5), ε > 0 with loss
            types that ignore it, ε = 0 with ``exo_pair``, an f-divergence the loss types do not
            take, missing token counts or reference log-probs, or mismatched shapes.
    """
    names = loss_type_names(loss_type)
    weights = check_loss_mixture(names, loss_weights, label_smoothing, discopop_tau, cpo_alpha)
    check_f_divergence(names, f_divergence_type, f_alpha_divergence_coef)
    if beta <= 0:
        raise ValueError(f"beta must be > 0 (IPO divides by it), got {beta}")
    tensors = {
        "policy_chosen_logps": policy_chosen_logps,
        "policy_rejected_logps": policy_rejected_logps,
    }
    if needs_reference(names):
        if ref_chosen_logps is None or ref_rejected_logps is None:
            raise ValueError(f"loss_type {list(names)} needs reference log-probs")
        tensors |= {"ref_chosen_logps": ref_chosen_logps, "ref_rejected_logps": ref_rejected_logps}
    counted = chosen_num_tokens is not None and rejected_num_tokens is not None
    if counted:
        tensors |= {
            "chosen_num_tokens": chosen_num_tokens,
            "rejected_num_tokens": rejected_num_tokens,
        }
    if needs_rewards(names):
        if reward_margins is None:
            raise ValueError(f"loss_type {list(names)} needs the pairs' reward_margins")
        tensors["reward_margins"] = reward_margins
    needs_counts = [t for t in names if DPO_LOSSES[t].needs_token_counts]
    if needs_counts and not counted:
        raise ValueError(
            f"loss_type {needs_counts} needs chosen_num_tokens and rejected_num_tokens"
        )
    check_batch(tensors)
    pc = as_float(policy_chosen_logps)
    pr = as_float(policy_rejected_logps).to(pc.dtype)
    if needs_reference(names):
        # The reference is a constant of the step: no gradient may reach it.
        chosen_logratios = pc - as_float(ref_chosen_logps.detach()).to(pc.dtype)
        rejected_logratios = pr - as_float(ref_rejected_logps.detach()).to(pc.dtype)
    else:  # reference-free: the "log-ratios" are the policy log-probs (ref = 0)
        chosen_logratios, rejected_logratios = pc, pr
    # f-DPO: the losses read the scores s(u) (u itself for reverse_kl); the rewards stay β·u.
    chosen_scores = f_divergence_scores(
        chosen_logratios, f_divergence_type, f_alpha_divergence_coef
    )
    rejected_scores = f_divergence_scores(
        rejected_logratios, f_divergence_type, f_alpha_divergence_coef
    )
    per_token = {"chosen_logratios_per_token": None, "rejected_logratios_per_token": None}
    chosen_nll_per_token = None
    if counted:
        if average_log_probs:
            per_token = {
                "chosen_logratios_per_token": chosen_scores,
                "rejected_logratios_per_token": rejected_scores,
            }
            chosen_nll_per_token = -pc
        else:
            per_token = {
                "chosen_logratios_per_token": per_token_mean(chosen_scores, chosen_num_tokens),
                "rejected_logratios_per_token": per_token_mean(
                    rejected_scores, rejected_num_tokens
                ),
            }
            chosen_nll_per_token = -per_token_mean(pc, chosen_num_tokens)
        if chosen_nll_logps is not None and chosen_nll_num_tokens is not None:
            chosen_nll_token_mean = chosen_nll_token_mean_of(
                as_float(chosen_nll_logps).to(pc.dtype), chosen_nll_num_tokens, False
            )
        else:
            chosen_nll_token_mean = chosen_nll_token_mean_of(
                pc, chosen_num_tokens, average_log_probs
            )
    else:
        chosen_nll_token_mean = None
    if sorts_batch(names) and sort_partners is None:
        sort_partners = batch_sort_partners(pc, pr, ref_chosen_logps, ref_rejected_logps)
    pairs = DPOPairs(
        chosen_logratios=chosen_scores,
        rejected_logratios=rejected_scores,
        chosen_nll_per_token=chosen_nll_per_token,
        beta=beta,
        label_smoothing=label_smoothing,
        discopop_tau=discopop_tau,
        chosen_nll_token_mean=chosen_nll_token_mean,
        simpo_gamma=simpo_gamma,
        cpo_alpha=cpo_alpha,
        partners=sort_partners if sorts_batch(names) else None,
        reward_margins=(
            as_float(reward_margins.detach()).to(pc.dtype) if needs_rewards(names) else None
        ),
        **per_token,
    )
    if len(names) == 1 and weights[0] == 1.0:
        losses = DPO_LOSSES[names[0]].fn(pairs)  # bit-identical to the un-mixed loss
    else:
        losses = sum(w * DPO_LOSSES[t].fn(pairs) for t, w in zip(names, weights, strict=True))

    return DPOLossOutput(
        losses=losses,
        chosen_rewards=(beta * chosen_logratios).detach(),
        rejected_rewards=(beta * rejected_logratios).detach(),
    )


def chosen_nll_token_mean_of(
    chosen_logps: Tensor, chosen_num_tokens: Tensor, average_log_probs: bool
) -> Tensor:
    """TRL's CPO/ORPO NLL: Σ_i −π_c,i / Σ_i n_c,i over the given pairs, as a [B] tensor (the
    same value in every entry, with grad), from sums or (``average_log_probs``) per-token means.
    """
    counts = chosen_num_tokens.to(chosen_logps.dtype)
    sums = chosen_logps * counts if average_log_probs else chosen_logps
    return (-sums.sum() / counts.sum().clamp(min=1.0)).expand(chosen_logps.shape[0])


def dpo_total_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    beta: float,
    loss_type: LossTypes = "sigmoid",
    label_smoothing: float = 0.0,
    sft_loss_weight: float = 0.0,
    chosen_num_tokens: Tensor | None = None,
    normalizer: float | Tensor | None = None,
    average_log_probs: bool = False,
    sft_average_log_probs: bool = True,
    preference_loss_weight: float = 1.0,
    loss_weights: list[float] | tuple[float, ...] | None = None,
    discopop_tau: float = 0.05,
    rejected_num_tokens: Tensor | None = None,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = DEFAULT_ALPHA,
    simpo_gamma: float = 0.5,
    cpo_alpha: float = 1.0,
    sort_partners: SortPartners | None = None,
    chosen_nll_logps: Tensor | None = None,
    chosen_nll_num_tokens: Tensor | None = None,
    reward_margins: Tensor | None = None,
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
        loss_weights, discopop_tau, rejected_num_tokens, f_divergence_type,
            f_alpha_divergence_coef, simpo_gamma, cpo_alpha, sort_partners,
            chosen_nll_logps, chosen_nll_num_tokens, reward_margins: as in :func:`dpo_loss`.

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
        loss_weights=loss_weights,
        discopop_tau=discopop_tau,
        chosen_num_tokens=chosen_num_tokens if rejected_num_tokens is not None else None,
        rejected_num_tokens=rejected_num_tokens,
        average_log_probs=average_log_probs,
        f_divergence_type=f_divergence_type,
        f_alpha_divergence_coef=f_alpha_divergence_coef,
        simpo_gamma=simpo_gamma,
        cpo_alpha=cpo_alpha,
        sort_partners=sort_partners,
        chosen_nll_logps=chosen_nll_logps,
        chosen_nll_num_tokens=chosen_nll_num_tokens,
        reward_margins=reward_margins,
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
