"""Fixed-size (sum, count) metric aggregation: hand values, one-class batches, micro-batching."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_kto.losses import (
    DPO_METRICS,
    KTO_METRICS,
    MetricSums,
    dpo_metric_sums,
    finalize_dpo_metrics,
    finalize_kto_metrics,
    kto_metric_sums,
)


def _kto_batch() -> dict[str, torch.Tensor]:
    return {
        "rewards": torch.tensor([0.4, -0.2, 0.1, -0.6]),
        "policy_logps": torch.tensor([-10.0, -20.0, -30.0, -40.0]),
        "desirable": torch.tensor([True, False, True, False]),
        "logits_sum": torch.tensor([3.0, 8.0, 5.0, 4.0]),
        "num_tokens": torch.tensor([1, 4, 3, 4]),
        "losses": torch.tensor([0.5, 0.25, 0.75, 1.0]),
    }


def test_kto_metrics_hand_values() -> None:
    """Desirable rows 0, 2; undesirable rows 1, 3.

    rewards/chosen   = (0.4 + 0.1)/2 = 0.25;   rewards/rejected = (−0.2 − 0.6)/2 = −0.4
    rewards/margins  = 0.25 − (−0.4) = 0.65
    logps/chosen     = (−10 − 30)/2 = −20;     logps/rejected = (−20 − 40)/2 = −30
    logits/chosen    = (3 + 5)/(1 + 3) = 2;    logits/rejected = (8 + 4)/(4 + 4) = 1.5
    loss             = (0.5 + 0.25 + 0.75 + 1.0)/4 = 0.625;  kl passed through = 0.3
    """
    sums = kto_metric_sums(**_kto_batch())
    assert sums.shape == (KTO_METRICS.size,) == (14,)
    m = finalize_kto_metrics(sums, kl=torch.tensor(0.3))
    assert m == pytest.approx(
        {
            "rewards/chosen": 0.25,
            "rewards/rejected": -0.4,
            "rewards/margins": 0.65,
            "logps/chosen": -20.0,
            "logps/rejected": -30.0,
            "logits/chosen": 2.0,
            "logits/rejected": 1.5,
            "loss": 0.625,
            "kl": 0.3,
        }
    )


def test_micro_batch_sums_equal_whole_batch() -> None:
    """Adding per-micro-batch tensors (as the model code and the DP all-reduce do) gives the
    whole-batch result, even when a micro-batch holds only one class."""
    b = _kto_batch()
    whole = kto_metric_sums(**b)
    acc = KTO_METRICS.zeros()
    for idx in ([0], [1, 3], [2]):
        acc += kto_metric_sums(**{k: v[idx] for k, v in b.items()})
    torch.testing.assert_close(acc, whole)


@pytest.mark.parametrize("desirable", [True, False])
def test_one_class_batch_has_no_nan(desirable: bool) -> None:
    b = _kto_batch()
    b["desirable"] = torch.full((4,), desirable)
    m = finalize_kto_metrics(kto_metric_sums(**b), kl=0.0)
    assert all(math.isfinite(v) for v in m.values())
    missing = "rejected" if desirable else "chosen"
    assert m[f"rewards/{missing}"] == 0.0
    assert m[f"logps/{missing}"] == 0.0
    assert m[f"logits/{missing}"] == 0.0
    assert m["rewards/margins"] == 0.0


def test_empty_accumulator_finalizes_to_zeros() -> None:
    m = finalize_kto_metrics(KTO_METRICS.zeros(), kl=0.0)
    assert set(m.values()) == {0.0}


def test_dpo_metrics_hand_values() -> None:
    """Three pairs.

    rewards/chosen = (1 + 0 − 1)/3 = 0;  rewards/rejected = (0 + 0.5 − 2)/3 = −0.5
    rewards/accuracies = [1 > 0, 0 > 0.5, −1 > −2] = 2/3;  margins = 0 − (−0.5) = 0.5
    logps/chosen = −2, logps/rejected = −4; logits/chosen = 6/6 = 1, logits/rejected = 9/3 = 3
    loss = (0.3 + 0.6 + 0.9)/3 = 0.6
    """
    sums = dpo_metric_sums(
        chosen_rewards=torch.tensor([1.0, 0.0, -1.0]),
        rejected_rewards=torch.tensor([0.0, 0.5, -2.0]),
        policy_chosen_logps=torch.tensor([-1.0, -2.0, -3.0]),
        policy_rejected_logps=torch.tensor([-3.0, -4.0, -5.0]),
        chosen_logits_sum=torch.tensor([1.0, 2.0, 3.0]),
        chosen_num_tokens=torch.tensor([1, 2, 3]),
        rejected_logits_sum=torch.tensor([3.0, 3.0, 3.0]),
        rejected_num_tokens=torch.tensor([1, 1, 1]),
        losses=torch.tensor([0.3, 0.6, 0.9]),
    )
    assert sums.shape == (DPO_METRICS.size,)
    m = finalize_dpo_metrics(sums)
    assert m == pytest.approx(
        {
            "rewards/chosen": 0.0,
            "rewards/rejected": -0.5,
            "rewards/accuracies": 2 / 3,
            "rewards/margins": 0.5,
            "logps/chosen": -2.0,
            "logps/rejected": -4.0,
            "logits/chosen": 1.0,
            "logits/rejected": 3.0,
            "loss": 0.6,
        }
    )


def test_metric_sums_validation() -> None:
    with pytest.raises(ValueError, match="unique"):
        MetricSums(["a", "a"])
    ms = MetricSums(["a", "b"])
    with pytest.raises(ValueError, match="missing"):
        ms.pack({"a": (1.0, 1.0)})
    with pytest.raises(ValueError, match=r"\[4\]"):
        ms.finalize(torch.zeros(3))
    packed = ms.pack({"a": (torch.tensor(3.0, requires_grad=True), 2), "b": (1.0, 0)})
    assert not packed.requires_grad
    assert ms.finalize(packed) == {"a": 1.5, "b": 0.0}
