"""Dataset statistics and the KTO class-balance advice printed at start-up.

The KTO paper (Ethayarajh et al. 2024, section 4.2) recommends loss weights such that

    (λ_D · n_D) / (λ_U · n_U) ∈ [1, 4/3]

where n_D, n_U are the numbers of desirable and undesirable examples. :func:`suggest_loss_weights`
returns the smallest change that puts the ratio into that range (it moves
``model.kto.desirable_loss_weight`` and keeps ``model.kto.undesirable_loss_weight`` at 1).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

DESIRABLE_WEIGHT_KEY = "model.kto.desirable_loss_weight"
UNDESIRABLE_WEIGHT_KEY = "model.kto.undesirable_loss_weight"
RATIO_LOW, RATIO_HIGH = 1.0, 4.0 / 3.0


@dataclass
class DatasetStats:
    """What building a dataset did with the data.

    Attributes:
        kind: ``"kto"`` or ``"dpo"``.
        files: the data files read.
        rows_read: raw rows read (a paired row counts once).
        examples: examples kept (KTO rows, or DPO pairs).
        desirable: kept KTO rows labelled desirable (0 for DPO).
        undesirable: kept KTO rows labelled undesirable (0 for DPO).
        dropped: examples dropped by the length policy, per reason.
        prompts_truncated: kept examples whose prompt was truncated.
        completions_truncated: kept examples with a truncated completion.
        prompts_merged: kept examples whose tokenised prompt is not a prefix of the tokenised
            prompt + completion (a token merges across the seam, or the chat template renders
            the prompt differently alone): the completion starts where they diverge, as in TRL.
    """

    kind: str
    files: list[str] = field(default_factory=list)
    rows_read: int = 0
    examples: int = 0
    desirable: int = 0
    undesirable: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    prompts_truncated: int = 0
    completions_truncated: int = 0
    prompts_merged: int = 0

    @property
    def dropped_total(self) -> int:
        """Examples dropped for any reason."""
        return sum(self.dropped.values())

    def count_drop(self, reason: str) -> None:
        """Count one dropped example."""
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (stored in the cache metadata)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DatasetStats:
        """Inverse of :meth:`to_dict`."""
        return cls(**data)

    @property
    def warnings(self) -> list[str]:
        """Class-balance warnings (KTO only) for loss weights 1/1; empty if nothing to say."""
        return class_balance_warnings(self) if self.kind == "kto" else []

    def summary(self, desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> str:
        """Multi-line human-readable report (what the trainer prints at start-up).

        Args:
            desirable_weight: the configured ``model.kto.desirable_loss_weight``.
            undesirable_weight: the configured ``model.kto.undesirable_loss_weight``.

        Returns:
            The report, ending with class-balance warnings judged with those weights.
        """
        files = ", ".join(self.files)
        lines = [f"{self.kind.upper()} data from {files}: {self.rows_read} rows read"]
        if self.kind == "kto":
            lines.append(
                f"  kept {self.examples} examples: {self.desirable} desirable, "
                f"{self.undesirable} undesirable"
            )
        else:
            lines.append(f"  kept {self.examples} pairs")
        drops = ", ".join(f"{k}={v}" for k, v in sorted(self.dropped.items())) or "none"
        lines.append(f"  dropped by the length policy: {self.dropped_total} ({drops})")
        lines.append(
            f"  truncated: {self.prompts_truncated} prompts, "
            f"{self.completions_truncated} completions"
        )
        if self.prompts_merged:
            lines.append(
                f"  WARNING: {self.prompts_merged} examples: the tokenised prompt is not a prefix "
                "of the tokenised prompt + completion (a token merges across the seam, or the "
                "chat template renders the prompt differently alone); their completion starts "
                "where the two diverge, as in TRL. For plain text, start completions with the "
                "separating space."
            )
        if self.kind == "kto":
            warnings = class_balance_warnings(self, desirable_weight, undesirable_weight)
            lines.extend(f"  WARNING: {w}" for w in warnings)
        return "\n".join(lines)


def merge_stats(parts: Iterable[DatasetStats]) -> DatasetStats:
    """Add up the statistics of several files (all of the same kind)."""
    parts = list(parts)
    total = DatasetStats(kind=parts[0].kind if parts else "kto")
    for part in parts:
        if part.kind != total.kind:
            raise ValueError(f"cannot merge {part.kind} statistics into {total.kind} statistics")
        total.files.extend(part.files)
        total.rows_read += part.rows_read
        total.examples += part.examples
        total.desirable += part.desirable
        total.undesirable += part.undesirable
        total.prompts_truncated += part.prompts_truncated
        total.completions_truncated += part.completions_truncated
        total.prompts_merged += part.prompts_merged
        for reason, count in part.dropped.items():
            total.dropped[reason] = total.dropped.get(reason, 0) + count
    return total


def imbalance_ratio(
    n_desirable: int,
    n_undesirable: int,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> float:
    """(λ_D · n_D) / (λ_U · n_U); ``inf`` when there are no undesirable examples."""
    denominator = undesirable_weight * n_undesirable
    return math.inf if denominator == 0 else desirable_weight * n_desirable / denominator


def suggest_loss_weights(n_desirable: int, n_undesirable: int) -> tuple[float, float] | None:
    """Loss weights that put the KTO imbalance ratio into [1, 4/3].

    Args:
        n_desirable: desirable examples.
        n_undesirable: undesirable examples.

    Returns:
        ``(desirable_weight, undesirable_weight)``, with the undesirable weight 1 and the
        desirable one rounded to 3 decimals inside the range (1, 1 when already balanced), or
        None for a one-class dataset, where no weighting balances anything.
    """
    if n_desirable == 0 or n_undesirable == 0:
        return None
    ratio = n_desirable / n_undesirable
    if RATIO_LOW <= ratio <= RATIO_HIGH:
        return 1.0, 1.0
    if ratio < RATIO_LOW:
        # Round up so the rounded weight still reaches the lower bound.
        weight = math.ceil(1000 * RATIO_LOW / ratio) / 1000
    else:
        # Round down so the rounded weight stays under the upper bound.
        weight = math.floor(1000 * RATIO_HIGH / ratio) / 1000
    return weight, 1.0


def one_class_warning(stats: DatasetStats) -> str | None:
    """The warning for a KTO dataset with only one class (None otherwise).

    It does not depend on the configured weights, so the dataset builder logs it directly.
    """
    n_d, n_u = stats.desirable, stats.undesirable
    if n_d + n_u == 0 or (n_d and n_u):
        return None
    only, missing = ("desirable", "undesirable") if n_u == 0 else ("undesirable", "desirable")
    return (
        f"one-class dataset: only {only} examples ({n_d} desirable, {n_u} undesirable). "
        f"KTO still trains, but nothing contrasts the {only} examples with {missing} ones; "
        f"{DESIRABLE_WEIGHT_KEY} and {UNDESIRABLE_WEIGHT_KEY} cannot balance this, and the "
        f"{missing} weight has no effect. Add {missing} examples if this is unintended."
    )


def class_balance_warnings(
    stats: DatasetStats, desirable_weight: float = 1.0, undesirable_weight: float = 1.0
) -> list[str]:
    """Warnings about one-class or imbalanced KTO data, naming the config keys to change.

    Args:
        stats: KTO dataset statistics.
        desirable_weight: the configured λ_D.
        undesirable_weight: the configured λ_U.

    Returns:
        Zero or one warning line.
    """
    n_d, n_u = stats.desirable, stats.undesirable
    if n_d + n_u == 0:
        return []
    one_class = one_class_warning(stats)
    if one_class is not None:
        return [one_class]
    ratio = imbalance_ratio(n_d, n_u, desirable_weight, undesirable_weight)
    if RATIO_LOW <= ratio <= RATIO_HIGH:
        return []
    suggestion = suggest_loss_weights(n_d, n_u)
    assert suggestion is not None  # both classes are present here
    return [
        f"class imbalance: (λ_D·n_D)/(λ_U·n_U) = ({desirable_weight:g}·{n_d})/"
        f"({undesirable_weight:g}·{n_u}) = {ratio:.3f}, outside the KTO paper's [1, 4/3]; "
        f"consider {DESIRABLE_WEIGHT_KEY}={suggestion[0]:g} {UNDESIRABLE_WEIGHT_KEY}={suggestion[1]:g}"
    ]
