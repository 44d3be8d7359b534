"""f-divergence regularisers of DPO (f-DPO, Wang et al. 2023), as in TRL 1.16's ``DPOTrainer``.

DPO's reverse-KL regulariser gives the implicit reward β·u with u = log(π/ref) the log-ratio of a
completion. With another f-divergence the reward becomes β·f′(t) at t = π/ref = exp(u), so each
log-ratio is replaced by a *score* s(u) = f′(exp(u)) before the loss reads the chosen − rejected
difference:

===================  ==================================  ==========================================
f_divergence_type    f′(t)                               s(u)
===================  ==================================  ==========================================
``reverse_kl``       log t                               u  (plain DPO)
``forward_kl``       1 − 1/t                             1 − exp(−u)
``js_divergence``    log(2t / (t + 1))                   log 2 + log σ(u)
``alpha_divergence`` (t^(α−1) − 1) / (α − 1)             (exp((α − 1)·u) − 1) / (α − 1)
===================  ==================================  ==========================================

``alpha_divergence`` with |α − 1| < 1e-6 is its limit, ``reverse_kl``; α = 0 is ``forward_kl``.
Its exponent (α − 1)·u is clamped at 80 (11 for fp16) so exp stays finite, as in TRL.

The f-DPO reparameterisation leaves a β·log Z(x) term that cancels only in the chosen − rejected
difference, so only the loss types built on that difference take a non-default f-divergence
(:data:`F_DIVERGENCE_LOSS_TYPES`, TRL's list); the rewards reported as metrics stay β·u (TRL
logs them so too).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_kto.losses.dpo_types import DPOLossConfigError

F_DIVERGENCE_TYPES: tuple[str, ...] = (
    "reverse_kl",
    "forward_kl",
    "js_divergence",
    "alpha_divergence",
)
#: Loss types that read the log-ratios only through chosen − rejected (TRL 1.16's list).
F_DIVERGENCE_LOSS_TYPES: frozenset[str] = frozenset(
    {"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"}
)
DEFAULT_ALPHA = 0.5

# exp(80) ≈ 5.5e34 fits fp32/bf16; exp(11) ≈ 6e4 fits fp16 (max 65504).
_EXP_CLAMP = {torch.float16: 11.0}


def f_divergence_scores(
    logratios: Tensor, f_divergence_type: str = "reverse_kl", alpha: float = DEFAULT_ALPHA
) -> Tensor:
    """The score s(u) of each log-ratio u under an f-divergence (table in the module docstring).

    Args:
        logratios: log π − log ref per completion, any shape, with grad.
        f_divergence_type: a name of :data:`F_DIVERGENCE_TYPES`.
        alpha: α of ``alpha_divergence`` (read by no other type).

    Returns:
        A tensor like ``logratios``; ``logratios`` itself for ``reverse_kl``.

    Raises:
        ValueError: on an unknown ``f_divergence_type``.
    """
    if f_divergence_type == "reverse_kl":
        return logratios
    if f_divergence_type == "forward_kl":
        return 1.0 - torch.exp(-logratios)
    if f_divergence_type == "js_divergence":
        return math.log(2.0) + F.logsigmoid(logratios)
    if f_divergence_type == "alpha_divergence":
        if abs(alpha - 1.0) < 1e-6:  # the limit α → 1 of (t^(α−1) − 1)/(α − 1) is log t
            return logratios
        dtype = logratios.dtype
        # Exponentiate in fp32 at least, clamped so that the result fits `dtype` again.
        t = ((alpha - 1.0) * logratios).to(torch.promote_types(dtype, torch.float32))
        t = torch.clamp(t, max=_EXP_CLAMP.get(dtype, 80.0))
        return (torch.exp(t) - 1.0).to(dtype) * (1.0 / (alpha - 1.0))
    raise ValueError(
        f"unknown f_divergence_type {f_divergence_type!r}; supported: {', '.join(F_DIVERGENCE_TYPES)}"
    )


def check_f_divergence(
    loss_types: tuple[str, ...], f_divergence_type: str, alpha: float = DEFAULT_ALPHA
) -> None:
    """Refuse an f-divergence the loss types cannot take, or an α nothing reads.

    TRL 1.16 raises on a non-default f-divergence with other loss types, and ignores α unless
    ``alpha_divergence`` is chosen; we refuse both (a config must not look like it did something
    it did not).

    Raises:
        DPOLossConfigError: one line naming ``f_divergence_type`` or ``f_alpha_divergence_coef``
            in ``field``.
    """
    if f_divergence_type not in F_DIVERGENCE_TYPES:
        raise DPOLossConfigError(
            "f_divergence_type",
            f"unknown f_divergence_type {f_divergence_type!r}; supported: "
            f"{', '.join(F_DIVERGENCE_TYPES)}",
        )
    others = [t for t in loss_types if t not in F_DIVERGENCE_LOSS_TYPES]
    if f_divergence_type != "reverse_kl" and others:
        raise DPOLossConfigError(
            "f_divergence_type",
            f"f_divergence_type={f_divergence_type!r} applies only to loss types built on the "
            f"chosen - rejected reward difference: {', '.join(sorted(F_DIVERGENCE_LOSS_TYPES))}; "
            f"not to {', '.join(others)}; use reverse_kl with them",
        )
    if not math.isfinite(alpha):
        raise DPOLossConfigError(
            "f_alpha_divergence_coef", f"f_alpha_divergence_coef must be finite, got {alpha}"
        )
    if alpha != DEFAULT_ALPHA and f_divergence_type != "alpha_divergence":
        raise DPOLossConfigError(
            "f_alpha_divergence_coef",
            f"f_alpha_divergence_coef={alpha} is read only with f_divergence_type="
            f"'alpha_divergence' (got {f_divergence_type!r}); remove it or set that type",
        )
