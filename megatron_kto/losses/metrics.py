"""Fixed-size (sum, count) metric aggregation for KTO and DPO.

Every micro-batch turns its metrics into one flat tensor of (sum, count) pairs in a fixed order
(:class:`MetricSums`). The model code adds those tensors over micro-batches, all-reduces the
result once (a fixed-size collective: no rank can hang on a variable-size gather, STYLE.md 8),
and calls ``finalize`` which divides safely: a metric whose count is 0 (e.g. ``rewards/rejected``
in a batch with no undesirable example) reads 0.0, never NaN.

Metric names follow TRL: ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``,
``rewards/accuracies`` (DPO), ``logps/chosen``, ``logps/rejected``, ``logits/chosen``,
``logits/rejected``, ``kl`` (KTO), plus ``loss``; the reference-free objectives add TRL's
``nll_loss`` (CPO, SimPO, ORPO) and ``log_odds_ratio`` / ``log_odds_chosen`` (ORPO). Averaging matches TRL: rewards and logps are
means over examples; logits are means over completion *tokens* of the vocabulary-mean logit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_kto.losses.dpo_types import DPO_LOSSES

# float64: sums of log-probs over a global batch and token counts in the millions are exact
# enough, and the tensor is a handful of numbers, so the wider all-reduce costs nothing.
METRIC_DTYPE = torch.float64


class MetricSums:
    """A fixed, ordered list of metric names carried as a flat ``[2K]`` tensor.

    Layout: ``[sum_0, count_0, sum_1, count_1, ...]`` in the order of ``names``.
    """

    def __init__(self, names: Sequence[str]) -> None:
        if len(set(names)) != len(names):
            raise ValueError(f"metric names must be unique, got {list(names)}")
        self.names: tuple[str, ...] = tuple(names)

    @property
    def size(self) -> int:
        """Length of the flat tensor, 2 × number of metrics."""
        return 2 * len(self.names)

    def zeros(self, device: torch.device | str | None = None) -> Tensor:
        """An all-zero accumulator (add micro-batch tensors into it)."""
        return torch.zeros(self.size, dtype=METRIC_DTYPE, device=device)

    def pack(
        self,
        pairs: Mapping[str, tuple[Tensor | float, Tensor | float]],
        device: torch.device | str | None = None,
    ) -> Tensor:
        """Build the flat tensor from ``{name: (sum, count)}``, which must name every metric.

        Values are detached and converted to float64 on ``device`` (default: the device of the
        first tensor among the values, else CPU). Python numbers become device tensors through a
        fill kernel, not a host->device copy, so packing never waits for the device.
        """
        missing = [n for n in self.names if n not in pairs]
        extra = [n for n in pairs if n not in self.names]
        if missing or extra:
            raise ValueError(f"metric pairs mismatch: missing {missing}, unexpected {extra}")
        if device is None:
            device = next(
                (v.device for pair in pairs.values() for v in pair if isinstance(v, Tensor)), "cpu"
            )
        flat = [
            v.detach().to(device=device, dtype=METRIC_DTYPE).reshape(())
            if isinstance(v, Tensor)
            else torch.full((), float(v), dtype=METRIC_DTYPE, device=device)
            for name in self.names
            for v in pairs[name]
        ]
        return torch.stack(flat)

    def finalize(self, sums: Tensor, extra: Mapping[str, float] | None = None) -> dict[str, float]:
        """Divide each sum by its count (count 0 → 0.0) and return plain floats.

        When both ``rewards/chosen`` and ``rewards/rejected`` are tracked, ``rewards/margins``
        = rewards/chosen − rewards/rejected is added, and is 0.0 unless both classes were seen
        (a margin against a missing class would just repeat one side's reward). ``extra``
        entries (e.g. ``kl``) are copied in as floats.
        """
        if sums.shape != (self.size,):
            raise ValueError(
                f"expected a [{self.size}] metric tensor for {self.names}, got {tuple(sums.shape)}"
            )
        pairs = sums.detach().to("cpu", METRIC_DTYPE).reshape(-1, 2).tolist()
        out: dict[str, float] = {}
        counts: dict[str, float] = {}
        for name, (total, count) in zip(self.names, pairs):
            out[name] = total / count if count > 0 else 0.0
            counts[name] = count
        if "rewards/chosen" in out and "rewards/rejected" in out:
            both = counts["rewards/chosen"] > 0 and counts["rewards/rejected"] > 0
            out["rewards/margins"] = (
                out["rewards/chosen"] - out["rewards/rejected"] if both else 0.0
            )
        for name, value in (extra or {}).items():
            out[name] = float(value)
        return out


KTO_METRICS = MetricSums(
    (
        "rewards/chosen",
        "rewards/rejected",
        "logps/chosen",
        "logps/rejected",
        "logits/chosen",
        "logits/rejected",
        "loss",
    )
)

DPO_METRICS = MetricSums(
    (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "logps/chosen",
        "logps/rejected",
        "logits/chosen",
        "logits/rejected",
        "loss",
    )
)


#: CPO / SimPO (TRL's CPOTrainer): DPO's metrics + the chosen NLL (token-weighted mean).
CPO_METRICS = MetricSums((*DPO_METRICS.names, "nll_loss"))
#: ORPO (TRL's ORPOTrainer): + the mean log σ(log odds ratio) and mean log odds ratio.
ORPO_METRICS = MetricSums((*CPO_METRICS.names, "log_odds_ratio", "log_odds_chosen"))


def dpo_metric_set(loss_types: tuple[str, ...]) -> MetricSums:
    """The metrics a DPO-family run logs: TRL's trainer for its (checked) loss types."""
    if "orpo" in loss_types:
        return ORPO_METRICS
    if any(not DPO_LOSSES[t].needs_reference for t in loss_types):
        return CPO_METRICS
    return DPO_METRICS


def reference_free_metric_sums(
    metrics: MetricSums,
    dpo_sums: Tensor,
    chosen_nll_sum: Tensor,
    chosen_num_tokens: Tensor,
    log_odds: Tensor | None,
) -> Tensor:
    """``dpo_sums`` (:func:`dpo_metric_sums`) extended to ``metrics`` (CPO/ORPO_METRICS).

    Args:
        chosen_nll_sum: scalar Σ_i −π_c,i (summed log-probs) over the micro-batch.
        chosen_num_tokens: [B] chosen completion token counts (``nll_loss`` is per token).
        log_odds: [B] ORPO's log odds ratio per pair (read when ``metrics`` has it).
    """
    pairs: dict[str, tuple[Tensor | float, Tensor | float]] = {
        "nll_loss": (chosen_nll_sum, chosen_num_tokens.sum())
    }
    if "log_odds_ratio" in metrics.names:
        assert log_odds is not None
        n = log_odds.shape[0]
        pairs["log_odds_ratio"] = (F.logsigmoid(log_odds.detach().to(METRIC_DTYPE)).sum(), n)
        pairs["log_odds_chosen"] = (log_odds.detach().to(METRIC_DTYPE).sum(), n)
    extra = MetricSums(metrics.names[len(DPO_METRICS.names) :]).pack(pairs, dpo_sums.device)
    return torch.cat([dpo_sums, extra])


def _masked_sum(values: Tensor, mask: Tensor) -> Tensor:
    values = values.detach().to(METRIC_DTYPE)
    return torch.where(mask, values, torch.zeros_like(values)).sum()


def kto_metric_sums(
    rewards: Tensor,
    policy_logps: Tensor,
    desirable: Tensor,
    logits_sum: Tensor,
    num_tokens: Tensor,
    losses: Tensor,
) -> Tensor:
    """(sum, count) pairs of the KTO metrics for one micro-batch, in ``KTO_METRICS`` order.

    Args:
        rewards: [B] β·r.
        policy_logps: [B] summed completion log-probs of the policy.
        desirable: [B] bool.
        logits_sum: [B] per example, the vocabulary-mean logit summed over completion tokens.
        num_tokens: [B] completion token counts.
        losses: [B] per-example total loss (KTO + weighted SFT).

    Returns:
        [2 · len(KTO_METRICS.names)] float64 tensor on the device of ``rewards``.
    """
    d = desirable.bool()
    u = ~d
    n_d = d.sum()
    n_u = u.sum()
    return KTO_METRICS.pack(
        {
            "rewards/chosen": (_masked_sum(rewards, d), n_d),
            "rewards/rejected": (_masked_sum(rewards, u), n_u),
            "logps/chosen": (_masked_sum(policy_logps, d), n_d),
            "logps/rejected": (_masked_sum(policy_logps, u), n_u),
            "logits/chosen": (_masked_sum(logits_sum, d), _masked_sum(num_tokens, d)),
            "logits/rejected": (_masked_sum(logits_sum, u), _masked_sum(num_tokens, u)),
            "loss": (losses.detach().to(METRIC_DTYPE).sum(), losses.shape[0]),
        },
        device=rewards.device,
    )


def finalize_kto_metrics(sums: Tensor, kl: Tensor | float) -> dict[str, float]:
    """Finalize all-reduced KTO sums; ``kl`` is the z₀ actually used in the loss."""
    kl_value = float(kl.detach().item()) if isinstance(kl, Tensor) else float(kl)
    return KTO_METRICS.finalize(sums, extra={"kl": kl_value})


def dpo_metric_sums(
    chosen_rewards: Tensor,
    rejected_rewards: Tensor,
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    chosen_logits_sum: Tensor,
    chosen_num_tokens: Tensor,
    rejected_logits_sum: Tensor,
    rejected_num_tokens: Tensor,
    losses: Tensor,
) -> Tensor:
    """(sum, count) pairs of the DPO metrics for one micro-batch, in ``DPO_METRICS`` order.

    ``rewards/accuracies`` counts pairs whose chosen reward is strictly larger (as TRL).
    ``*_logits_sum`` are, per pair, the vocabulary-mean logit summed over completion tokens.
    """
    n = chosen_rewards.shape[0]
    accurate = (chosen_rewards.detach() > rejected_rewards.detach()).to(METRIC_DTYPE)

    def total(x: Tensor) -> Tensor:
        return x.detach().to(METRIC_DTYPE).sum()

    return DPO_METRICS.pack(
        {
            "rewards/chosen": (total(chosen_rewards), n),
            "rewards/rejected": (total(rejected_rewards), n),
            "rewards/accuracies": (accurate.sum(), n),
            "logps/chosen": (total(policy_chosen_logps), n),
            "logps/rejected": (total(policy_rejected_logps), n),
            "logits/chosen": (total(chosen_logits_sum), total(chosen_num_tokens)),
            "logits/rejected": (total(rejected_logits_sum), total(rejected_num_tokens)),
            "loss": (total(losses), losses.shape[0]),
        },
        device=chosen_rewards.device,
    )


def finalize_dpo_metrics(sums: Tensor) -> dict[str, float]:
    """Finalize all-reduced DPO sums (adds ``rewards/margins``)."""
    return DPO_METRICS.finalize(sums)
