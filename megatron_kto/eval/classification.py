"""How well a scalar score separates desirable from undesirable examples (pure numpy)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


def _average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks of `values`, tied values sharing the mean of their ranks."""
    order = np.argsort(values, kind="mergesort")
    sorted_values = values[order]
    first = np.r_[True, sorted_values[1:] != sorted_values[:-1]]
    starts = np.flatnonzero(first)
    ends = np.r_[starts[1:], len(values)] - 1
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[order] = ((starts + ends) / 2.0 + 1.0)[np.cumsum(first) - 1]
    return ranks


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve of `scores` for the positive class `labels == True`.

    Equals the probability that a random positive scores higher than a random negative, ties
    counting one half (the Mann-Whitney U statistic over n_pos * n_neg): 0.5 is chance, 1.0 a
    perfect separation. All-equal scores give exactly 0.5.

    Args:
        scores: [N] real scores (higher = more likely positive).
        labels: [N] booleans.

    Returns:
        The AUC in [0, 1].

    Raises:
        ValueError: if either class is empty (the AUC is undefined), or shapes differ.
    """
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    labels = np.asarray(labels, dtype=bool).reshape(-1)
    if scores.shape != labels.shape:
        raise ValueError(f"{scores.shape[0]} scores but {labels.shape[0]} labels")
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError(
            f"AUC needs both classes, got {n_pos} desirable and {n_neg} undesirable examples"
        )
    rank_sum = _average_ranks(scores)[labels].sum()
    u = rank_sum - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


@dataclass
class RewardReport:
    """Summary of implicit rewards on a labelled set."""

    num_examples: int
    num_desirable: int
    num_undesirable: int
    auc: float
    """ROC AUC of the reward for desirable vs undesirable."""
    accuracy: float | None
    """Share of examples with (reward > 0) == desirable; None for a reference-free objective's
    rewards (β·log π, never above 0)."""
    mean_reward_desirable: float
    mean_reward_undesirable: float
    margin: float
    """mean_reward_desirable - mean_reward_undesirable."""

    def to_dict(self) -> dict[str, float | int]:
        """Plain dict (for JSON)."""
        return asdict(self)

    def format(self) -> str:
        """Human-readable lines."""
        return "\n".join(
            [
                f"examples: {self.num_examples} ({self.num_desirable} desirable, "
                f"{self.num_undesirable} undesirable)",
                f"AUC: {self.auc:.4f}",
                f"accuracy (reward > 0 <=> desirable): {self.accuracy:.4f}"
                if self.accuracy is not None
                else "accuracy: n/a (reference-free rewards β·log π are never above 0)",
                f"mean reward: desirable {self.mean_reward_desirable:+.4f}, "
                f"undesirable {self.mean_reward_undesirable:+.4f}, margin {self.margin:+.4f}",
            ]
        )


def summarize(rewards: np.ndarray, labels: np.ndarray, sign_accuracy: bool = True) -> RewardReport:
    """AUC, sign accuracy and per-class mean rewards.

    Args:
        rewards: [N] implicit rewards.
        labels: [N] True for desirable.
        sign_accuracy: report the sign accuracy (False for reference-free rewards).

    Raises:
        ValueError: if either class is empty.
    """
    rewards = np.asarray(rewards, dtype=np.float64).reshape(-1)
    labels = np.asarray(labels, dtype=bool).reshape(-1)
    auc = roc_auc(rewards, labels)
    desirable, undesirable = rewards[labels], rewards[~labels]
    return RewardReport(
        num_examples=int(rewards.size),
        num_desirable=int(desirable.size),
        num_undesirable=int(undesirable.size),
        auc=auc,
        accuracy=float(((rewards > 0) == labels).mean()) if sign_accuracy else None,
        mean_reward_desirable=float(desirable.mean()),
        mean_reward_undesirable=float(undesirable.mean()),
        margin=float(desirable.mean() - undesirable.mean()),
    )
