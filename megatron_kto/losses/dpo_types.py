"""The DPO loss catalogue: one table from ``model.dpo.loss_type`` names to pure per-pair losses.

Each entry maps a :class:`DPOPairs` (the per-pair log-ratios of one micro-batch and the loss
parameters) to a [B] tensor of per-pair losses. Only losses that read nothing beyond the pairs
themselves are here, plus ``aot`` / ``aot_unpaired``, which pair values by rank over the whole
global batch: they read each pair's constant rank partners (:mod:`~megatron_kto.losses.batch_sort`,
``sorts_batch``), which a run computes from a forward-only policy pass over the global batch.

Notation: c = π_c − ref_c, r = π_r − ref_r (sums over completion tokens, or per-token means when
the caller length-normalises), h = c − r, x = β·h, ε = ``label_smoothing``, τ = ``discopop_tau``,
n_c / n_r the completion token counts. Formulas follow TRL 1.16's ``DPOTrainer._compute_loss``:

========================  ========================================================  =========
name                      per-pair loss                                             ε
========================  ========================================================  =========
``sigmoid``               −(1 − ε)·log σ(x) − ε·log σ(−x)  (cDPO; TRL: ε ignored)    optional
``ipo``                   (h − 1/(2β))²                                             —
``hinge``                 max(0, 1 − x)                                             —
``exo_pair``              σ(x)(log σ(x) − log(1 − ε)) + σ(−x)(log σ(−x) − log ε)    required
``nca_pair``              −log σ(βc) − ½·log σ(−βc) − ½·log σ(−βr)                  —
``robust``                (−(1 − ε)·log σ(x) + ε·log σ(−x)) / (1 − 2ε)              optional
``bco_pair``              −log σ(βc) − log σ(−βr)  (TRL 1.16: no running mean δ)     —
``sppo_hard``             (c − 1/(2β))² + (r + 1/(2β))²                             —
``aot``                   ℓ_ε(β(x_(k) − y_(k))), x = π_c − π_r, y = ref_c − ref_r sorted  optional
``aot_unpaired``          ℓ_ε(β(c_(k) − r_(k))), c and r sorted separately            optional
``apo_zero``              1 − σ(βc) + σ(βr)                                         —
``apo_down``              σ(βc) + 1 − σ(x)                                          —
``discopop``              (1 − m)·(−log σ(x)) + m·exp(−x),  m = σ(x/τ)              —
``sigmoid_norm``          −log σ(β(c/n_c − r/n_r))  (per-token log-ratios)          —
``sft``                   −π_c / n_c  (chosen NLL per token)                        —
``cpo``                   −(1 − ε)·log σ(x) − ε·log σ(−x) + α·NLL    (no reference)   optional
``simpo``                 −(1 − ε)·log σ(y) − ε·log σ(−y) + α·NLL    (no reference)   optional
``orpo``                  −β·log σ(o) + NLL                          (no reference)   —
``rpo_sq``                (x − g)²                                 (rewards g)       —
``rpo_fwd_kl``            Σ± σ(±x)(log σ(±x) − log σ(±g))          (rewards g)       —
``rpo_bwd_kl``            Σ± σ(±g)(log σ(±g) − log σ(±x))          (rewards g)       —
========================  ========================================================  =========

**NeMo-Aligner's RPO** (``model.dpo.preference_loss: rpo_*``, its ``megatron_gpt_dpo_model.py``):
g = ``gt_reward_scale`` × (chosen reward − rejected reward), the pair's reward gap from the data
(``needs_rewards``); ``rpo_sq`` regresses the implicit reward gap x = β·h onto g, the two KL forms
compare the Bernoulli preference distributions (σ(x), σ(−x)) of the policy and (σ(g), σ(−g)) of
the rewards: ``rpo_fwd_kl`` = KL(policy ‖ rewards), ``rpo_bwd_kl`` = KL(rewards ‖ policy).

**Reference-free objectives** (``needs_reference=False``: the run builds no reference model and
runs no reference pass; c and r are then the policy log-probs themselves, ref = 0). As TRL 1.16's
experimental ``CPOTrainer`` (``loss_type="sigmoid"`` / ``"simpo"``) and ``ORPOTrainer``:

- ``cpo`` (Xu et al. 2024): x = β·(π_c − π_r) on summed log-probs; α = ``cpo_alpha``.
- ``simpo`` (Meng et al. 2024): y = β·(π_c/n_c − π_r/n_r) − γ on per-token means, γ =
  ``simpo_gamma``; TRL's CPOTrainer adds α·NLL here too (α = 0 gives the paper's SimPO).
- ``orpo`` (Hong et al. 2024): o = log odds(ℓ_c) − log odds(ℓ_r), odds(ℓ) = e^ℓ/(1 − e^ℓ), on
  per-token means ℓ = π/n; β is the paper's λ; the NLL weight is 1.

ℓ_ε(z) = −(1 − ε)·log σ(z) − ε·log σ(−z); the sorts are over the global batch (TRL sorts the
batch one process is given), so a run at any data-parallel size and micro-batch size equals TRL's
on one process with the whole global batch.

NLL is TRL's: the chosen completions' negative log-likelihood as one token-weighted mean over
the pairs given (Σ_i −π_c,i / Σ_i n_c,i, a micro-batch in training), added to every pair's loss
(so the mean over pairs adds it once). TRL's ORPO takes that NLL over the chosen rows' prompt
tokens too: a run does the same by passing those rows' whole sums (``dpo_loss``'s
``chosen_nll_logps``; ``model.dpo.orpo_prompt_nll``, `models.prompt_nll`).

TRL's ``ipo`` divides the log-ratios by the token counts itself; ours (unchanged) does so when
the caller passes per-token means (``model.dpo.preference_average_log_probs``). TRL's ``sft`` is
the token-weighted mean NLL over its micro-batch; ours is each pair's per-token NLL averaged over
pairs (equal when the chosen completions have equal lengths), so it does not depend on how a
global batch is split into micro-batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_kto.losses.batch_sort import SortPartners


@dataclass(frozen=True)
class DPOPairs:
    """What a DPO loss reads about a micro-batch of pairs (all tensors [B], float).

    Attributes:
        chosen_logratios: c = π_c − ref_c as given (sums or per-token means), with grad.
        rejected_logratios: r = π_r − ref_r, with grad.
        chosen_logratios_per_token: c / n_c (None when no token counts were given).
        rejected_logratios_per_token: r / n_r (None when no token counts were given).
        chosen_nll_per_token: −π_c / n_c (None when no token counts were given).
        beta: β > 0.
        label_smoothing: ε ∈ [0, 0.5).
        discopop_tau: τ > 0 of ``discopop``.
        chosen_nll_token_mean: [B], every entry Σ_i −π_c,i / Σ_i n_c,i over the pairs (None when
            no token counts were given); the NLL of the reference-free objectives.
        simpo_gamma: γ of ``simpo``.
        cpo_alpha: α, the NLL weight of ``cpo`` and ``simpo``.
        partners: each pair's rank partners over the global batch (``aot``, ``aot_unpaired``;
            None for the other losses).
        reward_margins: g, each pair's scaled reward gap from the data (the RPO losses; None
            for the others).
    """

    chosen_logratios: Tensor
    rejected_logratios: Tensor
    chosen_logratios_per_token: Tensor | None
    rejected_logratios_per_token: Tensor | None
    chosen_nll_per_token: Tensor | None
    beta: float
    label_smoothing: float
    discopop_tau: float
    chosen_nll_token_mean: Tensor | None = None
    simpo_gamma: float = 0.5
    cpo_alpha: float = 1.0
    partners: SortPartners | None = None
    reward_margins: Tensor | None = None

    @property
    def logits(self) -> Tensor:
        """h = c − r."""
        return self.chosen_logratios - self.rejected_logratios


def _sigmoid(p: DPOPairs) -> Tensor:
    x, eps = p.beta * p.logits, p.label_smoothing
    losses = -(1.0 - eps) * F.logsigmoid(x)
    if eps != 0.0:
        losses = losses - eps * F.logsigmoid(-x)
    return losses


def _ipo(p: DPOPairs) -> Tensor:
    return (p.logits - 1.0 / (2.0 * p.beta)) ** 2


def _hinge(p: DPOPairs) -> Tensor:
    return torch.relu(1.0 - p.beta * p.logits)


def _exo_pair(p: DPOPairs) -> Tensor:
    # KL(softmax over {chosen, rejected} of the implicit rewards ‖ [1 − ε, ε]), EXO eq. 16.
    x, eps = p.beta * p.logits, p.label_smoothing
    chosen_term = torch.sigmoid(x) * (F.logsigmoid(x) - math.log1p(-eps))
    rejected_term = torch.sigmoid(-x) * (F.logsigmoid(-x) - math.log(eps))
    return chosen_term + rejected_term


def _nca_pair(p: DPOPairs) -> Tensor:
    bc, br = p.beta * p.chosen_logratios, p.beta * p.rejected_logratios
    return -F.logsigmoid(bc) - 0.5 * F.logsigmoid(-bc) - 0.5 * F.logsigmoid(-br)


def _robust(p: DPOPairs) -> Tensor:
    # Unbiased under a label-flip rate ε (Chowdhury et al. 2024): the flipped term is subtracted.
    x, eps = p.beta * p.logits, p.label_smoothing
    return (-(1.0 - eps) * F.logsigmoid(x) + eps * F.logsigmoid(-x)) / (1.0 - 2.0 * eps)


def _bco_pair(p: DPOPairs) -> Tensor:
    # TRL 1.16's form: the BCO paper's running reward mean δ is gone (δ = 0).
    return -F.logsigmoid(p.beta * p.chosen_logratios) - F.logsigmoid(-p.beta * p.rejected_logratios)


def _sppo_hard(p: DPOPairs) -> Tensor:
    half_over_beta = 0.5 / p.beta
    return (p.chosen_logratios - half_over_beta) ** 2 + (p.rejected_logratios + half_over_beta) ** 2


def _apo_zero(p: DPOPairs) -> Tensor:
    return (
        1.0
        - torch.sigmoid(p.beta * p.chosen_logratios)
        + torch.sigmoid(p.beta * p.rejected_logratios)
    )


def _apo_down(p: DPOPairs) -> Tensor:
    return torch.sigmoid(p.beta * p.chosen_logratios) + 1.0 - torch.sigmoid(p.beta * p.logits)


def _discopop(p: DPOPairs) -> Tensor:
    x = p.beta * p.logits
    mix = torch.sigmoid(x / p.discopop_tau)
    return (1.0 - mix) * -F.logsigmoid(x) + mix * torch.exp(-x)


def _sigmoid_norm(p: DPOPairs) -> Tensor:
    assert p.chosen_logratios_per_token is not None  # dpo_loss checks needs_token_counts
    assert p.rejected_logratios_per_token is not None
    h = p.chosen_logratios_per_token - p.rejected_logratios_per_token
    return -F.logsigmoid(p.beta * h)


def _sft(p: DPOPairs) -> Tensor:
    assert p.chosen_nll_per_token is not None  # dpo_loss checks needs_token_counts
    return p.chosen_nll_per_token


def _smoothed_sigmoid(x: Tensor, eps: float) -> Tensor:
    losses = -(1.0 - eps) * F.logsigmoid(x)
    return losses - eps * F.logsigmoid(-x) if eps != 0.0 else losses


def _aot(p: DPOPairs) -> Tensor:
    assert p.partners is not None  # dpo_loss computes them when the caller gives none
    return _smoothed_sigmoid(p.beta * (p.logits + p.partners.aot_offset), p.label_smoothing)


def _aot_unpaired(p: DPOPairs) -> Tensor:
    assert p.partners is not None
    eps, beta = p.label_smoothing, p.beta
    own_chosen = _smoothed_sigmoid(beta * (p.chosen_logratios - p.partners.unpaired_rejected), eps)
    # r_i's own term sits at another pair's rank: its value is counted there, its gradient here.
    rejected_term = _smoothed_sigmoid(
        beta * (p.partners.unpaired_chosen - p.rejected_logratios), eps
    )
    return own_chosen + (rejected_term - rejected_term.detach())


def _nll(p: DPOPairs) -> Tensor:
    assert p.chosen_nll_token_mean is not None  # dpo_loss checks needs_token_counts
    return p.chosen_nll_token_mean


def _cpo(p: DPOPairs) -> Tensor:
    losses = _smoothed_sigmoid(p.beta * p.logits, p.label_smoothing)
    return losses + p.cpo_alpha * _nll(p) if p.cpo_alpha != 0.0 else losses


def _simpo(p: DPOPairs) -> Tensor:
    assert p.chosen_logratios_per_token is not None  # dpo_loss checks needs_token_counts
    assert p.rejected_logratios_per_token is not None
    h = p.chosen_logratios_per_token - p.rejected_logratios_per_token
    losses = _smoothed_sigmoid(p.beta * h - p.simpo_gamma, p.label_smoothing)
    return losses + p.cpo_alpha * _nll(p) if p.cpo_alpha != 0.0 else losses


def log1mexp(x: Tensor) -> Tensor:
    """log(1 − eˣ) for x < 0, accurate on both sides of −log 2 (Mächler 2012)."""
    # Near 0, 1 − eˣ cancels: −expm1(x) keeps its digits; far below, log1p(−eˣ) does.
    return torch.where(x < -math.log(2.0), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_log_odds(chosen_mean_logps: Tensor, rejected_mean_logps: Tensor) -> Tensor:
    """ORPO's log odds ratio o = log(odds_c / odds_r), odds(ℓ) = e^ℓ / (1 − e^ℓ), per pair.

    Args:
        chosen_mean_logps: [B] per-token mean log-probs ℓ_c < 0 of the chosen completions.
        rejected_mean_logps: [B] ℓ_r < 0.
    """
    return (chosen_mean_logps - rejected_mean_logps) - (
        log1mexp(chosen_mean_logps) - log1mexp(rejected_mean_logps)
    )


def _orpo(p: DPOPairs) -> Tensor:
    assert p.chosen_logratios_per_token is not None  # dpo_loss checks needs_token_counts
    assert p.rejected_logratios_per_token is not None
    log_odds = orpo_log_odds(p.chosen_logratios_per_token, p.rejected_logratios_per_token)
    return -p.beta * F.logsigmoid(log_odds) + _nll(p)


def _rpo_sq(p: DPOPairs) -> Tensor:
    assert p.reward_margins is not None  # dpo_loss checks needs_rewards
    return (p.beta * p.logits - p.reward_margins) ** 2


def _bernoulli_kl(log_p: Tensor, log_q: Tensor, log_p_flip: Tensor, log_q_flip: Tensor) -> Tensor:
    """KL((p, 1 − p) ‖ (q, 1 − q)) from log p, log q, log(1 − p), log(1 − q)."""
    return torch.exp(log_p) * (log_p - log_q) + torch.exp(log_p_flip) * (log_p_flip - log_q_flip)


def _rpo_fwd_kl(p: DPOPairs) -> Tensor:
    assert p.reward_margins is not None
    x, g = p.beta * p.logits, p.reward_margins
    return _bernoulli_kl(F.logsigmoid(x), F.logsigmoid(g), F.logsigmoid(-x), F.logsigmoid(-g))


def _rpo_bwd_kl(p: DPOPairs) -> Tensor:
    assert p.reward_margins is not None
    x, g = p.beta * p.logits, p.reward_margins
    return _bernoulli_kl(F.logsigmoid(g), F.logsigmoid(x), F.logsigmoid(-g), F.logsigmoid(-x))


@dataclass(frozen=True)
class DPOLossKind:
    """One catalogue entry.

    Attributes:
        fn: DPOPairs → [B] per-pair losses.
        label_smoothing: whether ε is read ('optional'), must be > 0 ('required') or is not
            read ('unused'; a non-zero ε with only such losses is refused).
        needs_token_counts: reads the per-token fields of :class:`DPOPairs`.
        needs_reference: reads reference log-probs; False: the run builds no reference model
            and runs no reference pass (the objective's log-ratios are the policy log-probs).
        averages_log_probs: TRL computes it on per-token mean log-probs, so a run passes means
            (its rewards and ``logps/*`` metrics are then per token, as TRL's).
        sorts_batch: pairs values by rank over the global batch: reads
            :attr:`DPOPairs.partners`, so a run first passes the policy over the global batch
            forward-only (:func:`~megatron_kto.losses.batch_sort.sort_partners`).
    """

    fn: Callable[[DPOPairs], Tensor]
    label_smoothing: Literal["unused", "optional", "required"] = "unused"
    needs_token_counts: bool = False
    needs_reference: bool = True
    averages_log_probs: bool = False
    sorts_batch: bool = False
    needs_rewards: bool = False


DPO_LOSSES: dict[str, DPOLossKind] = {
    "sigmoid": DPOLossKind(_sigmoid, label_smoothing="optional"),
    "ipo": DPOLossKind(_ipo),
    "hinge": DPOLossKind(_hinge),
    "exo_pair": DPOLossKind(_exo_pair, label_smoothing="required"),
    "nca_pair": DPOLossKind(_nca_pair),
    "robust": DPOLossKind(_robust, label_smoothing="optional"),
    "bco_pair": DPOLossKind(_bco_pair),
    "sppo_hard": DPOLossKind(_sppo_hard),
    "aot": DPOLossKind(_aot, label_smoothing="optional", sorts_batch=True),
    "aot_unpaired": DPOLossKind(_aot_unpaired, label_smoothing="optional", sorts_batch=True),
    "apo_zero": DPOLossKind(_apo_zero),
    "apo_down": DPOLossKind(_apo_down),
    "discopop": DPOLossKind(_discopop),
    "sigmoid_norm": DPOLossKind(_sigmoid_norm, needs_token_counts=True),
    "sft": DPOLossKind(_sft, needs_token_counts=True),
    "cpo": DPOLossKind(
        _cpo, label_smoothing="optional", needs_token_counts=True, needs_reference=False
    ),
    "simpo": DPOLossKind(
        _simpo,
        label_smoothing="optional",
        needs_token_counts=True,
        needs_reference=False,
        averages_log_probs=True,
    ),
    "orpo": DPOLossKind(
        _orpo, needs_token_counts=True, needs_reference=False, averages_log_probs=True
    ),
    "rpo_sq": DPOLossKind(_rpo_sq, needs_rewards=True),
    "rpo_fwd_kl": DPOLossKind(_rpo_fwd_kl, needs_rewards=True),
    "rpo_bwd_kl": DPOLossKind(_rpo_bwd_kl, needs_rewards=True),
}
DPO_LOSS_TYPES: tuple[str, ...] = tuple(DPO_LOSSES)

#: The `reference_policy` of a run whose objective reads no reference: nothing is built or run.
NO_REFERENCE = "none"


class DPOLossConfigError(ValueError):
    """A refused (loss_type, loss_weights, label_smoothing, discopop_tau) combination.

    Attributes:
        field: the argument at fault, so a config layer can name its key.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def loss_type_names(loss_type: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """``loss_type`` as a tuple of names (a single name or a list of them, as in TRL)."""
    return (loss_type,) if isinstance(loss_type, str) else tuple(loss_type)


def needs_reference(loss_type: str | list[str] | tuple[str, ...]) -> bool:
    """Whether a loss type or list reads reference log-probs (the entries of a checked list
    agree; an unknown name counts as reading one, `check_loss_mixture` refuses it)."""
    names = loss_type_names(loss_type)
    return any(t not in DPO_LOSSES or DPO_LOSSES[t].needs_reference for t in names)


def sorts_batch(loss_type: str | list[str] | tuple[str, ...]) -> bool:
    """Whether a (checked) loss type or list pairs values by rank over the global batch."""
    return any(DPO_LOSSES[t].sorts_batch for t in loss_type_names(loss_type) if t in DPO_LOSSES)


def needs_rewards(loss_type: str | list[str] | tuple[str, ...]) -> bool:
    """Whether a (checked) loss type or list reads each pair's reward gap from the data."""
    return any(DPO_LOSSES[t].needs_rewards for t in loss_type_names(loss_type) if t in DPO_LOSSES)


def averages_log_probs(loss_type: str | list[str] | tuple[str, ...]) -> bool:
    """Whether a (checked) loss type or list is computed on per-token mean log-probs."""
    names = loss_type_names(loss_type)
    return any(DPO_LOSSES[t].averages_log_probs for t in names if t in DPO_LOSSES)


def check_loss_mixture(
    loss_types: tuple[str, ...],
    loss_weights: tuple[float, ...] | None,
    label_smoothing: float,
    discopop_tau: float = 0.05,
    cpo_alpha: float = 1.0,
) -> tuple[float, ...]:
    """Check a (names, weights, ε, τ, α) combination; return the weights (default all 1).

    Raises:
        DPOLossConfigError: one line saying what is wrong (unknown names list the supported
            ones), with the argument at fault in ``field``.
    """
    if not loss_types:
        raise DPOLossConfigError("loss_type", "loss_type is empty; give one name or a list")
    unknown = [t for t in loss_types if not isinstance(t, str) or t not in DPO_LOSSES]
    if unknown:
        raise DPOLossConfigError(
            "loss_type",
            f"unknown DPO loss_type {', '.join(map(repr, unknown))}; supported: "
            f"{', '.join(DPO_LOSS_TYPES)}",
        )
    free = [t for t in loss_types if not DPO_LOSSES[t].needs_reference]
    if free and len(free) != len(loss_types):
        based = [t for t in loss_types if DPO_LOSSES[t].needs_reference]
        raise DPOLossConfigError(
            "loss_type",
            f"loss_type mixes reference-free {free} with reference-based {based}: a run either "
            "has a reference model or not; list only one kind",
        )
    weights = tuple(loss_weights) if loss_weights is not None else (1.0,) * len(loss_types)
    if len(weights) != len(loss_types):
        raise DPOLossConfigError(
            "loss_weights",
            f"loss_weights has {len(weights)} entries but loss_type has {len(loss_types)}; "
            "give one weight per loss type",
        )
    if not 0.0 <= label_smoothing < 0.5:
        raise DPOLossConfigError(
            "label_smoothing", f"label_smoothing must be in [0, 0.5), got {label_smoothing}"
        )
    uses = {DPO_LOSSES[t].label_smoothing for t in loss_types}
    if label_smoothing != 0.0 and uses == {"unused"}:
        # Silently ignoring it would make a config look like it did something it did not.
        readers = [t for t, k in DPO_LOSSES.items() if k.label_smoothing != "unused"]
        raise DPOLossConfigError(
            "label_smoothing",
            f"label_smoothing={label_smoothing} is not read by loss_type {list(loss_types)}; "
            f"only by {readers}; set label_smoothing to 0.0",
        )
    if label_smoothing == 0.0 and "required" in uses:
        raise DPOLossConfigError(
            "label_smoothing",
            "label_smoothing must be > 0 for loss_type 'exo_pair' (the EXO paper suggests 1e-3)",
        )
    if "discopop" in loss_types and not discopop_tau > 0:
        raise DPOLossConfigError("discopop_tau", f"discopop_tau must be > 0, got {discopop_tau}")
    if not cpo_alpha >= 0:
        raise DPOLossConfigError("cpo_alpha", f"cpo_alpha must be >= 0, got {cpo_alpha}")
    return weights
