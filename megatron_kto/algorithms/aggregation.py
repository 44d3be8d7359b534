"""Exact aggregation of metrics over several global batches: a validation pass, a logging interval.

A model reports each global batch as a fixed-size (sum, count) tensor plus per-batch scalars
(`get_loss_and_metric_sums`; KTO's scalar is z₀). Averaging finalised per-batch means would
weight a batch with 2 desirable rows like one with 30, and count a class absent from a batch as
0.0; instead the tensors are added and finalised once, so a metric is the mean over every
example of the pass or interval (count-weighted), and a class absent from every batch reads 0.0.
Per-batch scalars (z₀) are averaged over the batches.

For a logged training row covering several steps (`trainer.log_every_n_steps > 1`, TRL's
convention that a row describes its whole interval): the loss and TRL metrics as above; `lr` is
the rate of the last update; `grad_norm` and `step_time` are means over the steps;
`skipped_step` counts skipped updates; `tokens_per_sec`, `samples_per_sec` and `mfu` are totals
over the interval divided by its total step time; `peak_memory_gb` is the largest reading.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Finalize = Callable[[torch.Tensor, dict[str, torch.Tensor]], dict[str, float]]


class MetricAccumulator:
    """Adds the (sum, count) tensors and the per-batch scalars of several global batches."""

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None
        self.scalars: dict[str, torch.Tensor] = {}
        self.batches = 0

    def add(self, sums: torch.Tensor, scalars: dict[str, torch.Tensor]) -> None:
        """Add one global batch (tensors stay on their device: no host synchronisation)."""
        self.sums = sums.detach().clone() if self.sums is None else self.sums + sums.detach()
        for name, value in scalars.items():
            value = torch.as_tensor(value).detach().to(torch.float64)
            self.scalars[name] = self.scalars[name] + value if name in self.scalars else value
        self.batches += 1

    def result(self, finalize: Finalize) -> dict[str, float]:
        """The metrics over every batch added (`finalize` is the model's `finalize_metrics`)."""
        if self.sums is None:
            raise ValueError("no batch was added")
        means = {name: value / self.batches for name, value in self.scalars.items()}
        return finalize(self.sums, means)


@dataclass
class StepCost:
    """What one optimizer step took, for the throughput fields of a logged row."""

    lr: float
    """Learning rate the update used."""
    grad_norm: float
    """Global gradient norm (0.0 when not computed)."""
    skipped: bool
    """The optimizer skipped the update (e.g. a non-finite gradient)."""
    seconds: float
    """Wall time of the step."""
    tokens: float
    """Real tokens processed, all data-parallel ranks."""
    flops: float
    """Model FLOPs of the step (`logging.throughput.ModelFlops`), all data-parallel ranks."""
    samples: int
    """Examples in the global batch."""
    peak_memory_gb: float
    """Peak memory so far."""


def throughput_fields(
    steps: list[StepCost], peak_flops: float | None, world_size: int
) -> dict[str, float]:
    """The non-loss fields of a logged row covering `steps` (one step or an interval)."""
    seconds = sum(s.seconds for s in steps)
    out = {
        "lr": steps[-1].lr,
        "grad_norm": sum(s.grad_norm for s in steps) / len(steps),
        "skipped_step": float(sum(s.skipped for s in steps)),
        "step_time": seconds / len(steps),
        "tokens_per_sec": sum(s.tokens for s in steps) / seconds,
        "samples_per_sec": sum(s.samples for s in steps) / seconds,
        "peak_memory_gb": max(s.peak_memory_gb for s in steps),
    }
    flops = sum(s.flops for s in steps)
    if peak_flops and flops:
        out["mfu"] = flops / seconds / (peak_flops * world_size)
    return out


class TrainInterval:
    """The steps since the last logged training row."""

    def __init__(self) -> None:
        self.metrics = MetricAccumulator()
        self.steps: list[StepCost] = []

    def add(self, sums: torch.Tensor, scalars: dict[str, torch.Tensor], cost: StepCost) -> None:
        """Record one step."""
        self.metrics.add(sums, scalars)
        self.steps.append(cost)

    def add_skipped(self, cost: StepCost) -> None:
        """Record a step whose update was skipped for non-finite values: its cost counts (in
        `skipped_step`), its metrics do not."""
        self.steps.append(cost)

    def pop(
        self,
        finalize: Finalize,
        peak_flops: float | None,
        world_size: int,
    ) -> dict[str, float]:
        """The row for the interval (at least one step), and start a new one."""
        # An interval of skipped steps only has no metrics, only its costs.
        row = self.metrics.result(finalize) if self.metrics.batches else {}
        row.update(throughput_fields(self.steps, peak_flops, world_size))
        self.__init__()
        return row
