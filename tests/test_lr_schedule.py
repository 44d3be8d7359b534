"""The LR schedule built around megatron-core's OptimizerParamScheduler."""

from __future__ import annotations

import math

import pytest

from megatron_kto.models.training_setup import build_scheduler


class _Optimizer:
    """The one thing OptimizerParamScheduler touches: `param_groups`."""

    def __init__(self):
        self.param_groups = [{"lr": 0.0, "weight_decay": 0.0}]


def _rates(steps: int, **kwargs) -> list[float]:
    opt = _Optimizer()
    scheduler = build_scheduler(opt, weight_decay=0.0, **kwargs)
    rates = []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])  # the rate the next update uses
        scheduler.step(increment=1)
    return rates


def test_warmup_never_updates_with_lr_zero_then_cosine_to_min():
    """Warm-up step k uses lr·(k+1)/(W+1); then cosine from lr to min_lr over the rest."""
    lr, min_lr, w, total = 1e-3, 1e-4, 4, 20
    rates = _rates(total + 1, name="CosineAnnealing", lr=lr, min_lr=min_lr, warmup_steps=w,
                   constant_steps=0, max_steps=total)  # fmt: skip
    assert rates[:w] == pytest.approx([lr * (k + 1) / (w + 1) for k in range(w)])
    assert rates[w] == pytest.approx(lr)
    k = 12  # inside the decay: megatron's cosine over (step - W) / (total - W)
    expected = min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * (k - w) / (total - w)))
    assert rates[k] == pytest.approx(expected)
    assert rates[total] == pytest.approx(min_lr)


def test_constant_schedule_without_warmup():
    rates = _rates(5, name="Constant", lr=3e-4, min_lr=0.0, warmup_steps=0, constant_steps=0,
                   max_steps=5)  # fmt: skip
    assert rates == pytest.approx([3e-4] * 5)
