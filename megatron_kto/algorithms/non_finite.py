"""Non-finite values in a training step (`trainer.non_finite`): stop with one line, or skip.

In bf16 and fp32, megatron-core's optimizer does not look for NaN/Inf: only fp16's loss scaler
finds an overflow (and then skips the update itself: `update_ok` False, counted in
`skipped_step`). Its DDP check (`DistributedDataParallelConfig.check_for_nan_in_grad`) raises
on the one rank whose local gradient is NaN, before the data-parallel reduction the other ranks
are already waiting in — they would hang until the collective timeout — and its rerun state
machine, which would make that safe, needs a loop of its own. So the check is here, after the
step's gradients are reduced and before the optimizer steps:

- the loss and the metrics (log-probs, rewards, logits, z₀) are already the same on every rank
  (reduced), so each rank finds the same non-finite names without communicating;
- the reference log-probs of each rank's rows and the gradients each rank holds differ by rank:
  one fixed-size all-reduce (MAX over the world) agrees on them.

When a step is found non-finite, `non_finite_rows` names its examples: one forward-only pass of
the policy over the batch (the step's weights are untouched) finds the rows whose log-probs (or
reference log-probs) are not finite, and one fixed-size all-gather over data-parallel ranks
collects their dataset indices. That pass runs only on such a step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_kto.checkpointing.files import read_latest

#: Names of the rank-dependent quantities `agreed_flags` checks, in order.
REFERENCE = "reference log-probs"
GRADIENT = "gradient norm"


def non_finite_names(metrics: Mapping[str, float]) -> list[str]:
    """The metric names (TRL names: loss, rewards/*, logps/*, logits/*, kl) whose value is NaN
    or Inf, in the metrics' order."""
    return [name for name, value in metrics.items() if not math.isfinite(float(value))]


def gradients_finite(chunks: Sequence[torch.nn.Module]) -> torch.Tensor:
    """Whether every gradient in the megatron DDP buffers of `chunks` is finite (0-d bool, on
    the buffers' device).

    Reads each buffer's norm, as megatron-core's own `check_grads` does: a reduction that
    allocates nothing the size of the gradients (a NaN or Inf anywhere makes it non-finite).
    """
    norms = [
        torch.linalg.vector_norm(buffer.grad_data)
        for chunk in chunks
        for buffer in [*chunk.buffers, *chunk.expert_parallel_buffers]
    ]
    return torch.isfinite(torch.stack(norms)).all() if norms else torch.ones((), dtype=torch.bool)


def agreed_flags(reference_logps: torch.Tensor, grads_ok: torch.Tensor | None) -> list[str]:
    """[REFERENCE, GRADIENT] names that are non-finite on any rank (one all-reduce of 2 numbers).

    Args:
        reference_logps: this rank's reference log-probs of the step's rows.
        grads_ok: `gradients_finite` of this rank, or None not to check gradients (fp16, whose
            loss scaler handles overflows).
    """
    device = reference_logps.device
    grads_bad = ~grads_ok if grads_ok is not None else torch.zeros((), dtype=torch.bool)
    bad = torch.stack([~torch.isfinite(reference_logps).all(), grads_bad.to(device)]).to(
        dtype=torch.float32
    )
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return [name for name, flag in zip((REFERENCE, GRADIENT), bad.tolist()) if flag > 0]


def bad_rows(
    policy_logps: torch.Tensor, reference_logps: torch.Tensor, rows: int, blocks: int
) -> torch.Tensor:
    """bool [rows]: examples whose log-probs are not all finite.

    Args:
        policy_logps, reference_logps: [k * rows] log-probs laid out as k blocks of `rows`
            (KTO: samples then KL rows; DPO: chosen then rejected).
        blocks: the first `blocks` blocks are the examples' own rows (row i of each belongs to
            example i): DPO 2, KTO 1 — a KL row pairs example i's prompt with another
            example's completion, whose own sample row shows the same fault.
    """
    own = blocks * rows
    finite = torch.isfinite(policy_logps[:own].view(blocks, rows)).all(0)
    finite &= torch.isfinite(reference_logps[:own].view(blocks, rows)).all(0)
    return ~finite


def gather_rows(index: torch.Tensor, bad: torch.Tensor) -> tuple[list[int], list[int]]:
    """(dataset indices of the bad rows, of all rows) over the data-parallel ranks: one
    all-gather of a fixed [rows, 2] tensor per rank."""
    local = torch.stack([index.to(torch.float64), bad.to(torch.float64)], dim=1)
    if parallel_state.get_data_parallel_world_size() > 1:
        group = parallel_state.get_data_parallel_group()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local, group=group)
        local = torch.cat(parts)
    pairs = [(int(i), flag > 0) for i, flag in local.tolist()]
    return [i for i, flag in pairs if flag], [i for i, _ in pairs]


class NonFiniteStep(Exception):
    """Raised by the trainer (on every rank, at the same step) under `trainer.non_finite=stop`.

    Attributes:
        step: the step that was not taken (1-based).
        quantities: what was non-finite (metric names, `REFERENCE`, `GRADIENT`).
        rows: where the step's offending rows came from (`file:line`), or all its rows when no
            row alone was non-finite.
        all_rows: `rows` are all the step's rows (no single row was found non-finite).
    """

    def __init__(self, step: int, quantities: list[str], rows: list[str], all_rows: bool):
        super().__init__(f"step {step}: non-finite {', '.join(quantities)}")
        self.step = step
        self.quantities = quantities
        self.rows = rows
        self.all_rows = all_rows

    def describe(self, max_rows: int = 8) -> str:
        """`step N: non-finite <quantities>; rows <file:line, ...>` (at most `max_rows` rows)."""
        shown = ", ".join(self.rows[:max_rows])
        more = len(self.rows) - max_rows
        if more > 0:
            shown += f" and {more} more"
        which = "the step's rows (none alone non-finite)" if self.all_rows else "rows"
        return f"{self}; {which}: {shown}"


def stop_message(error: NonFiniteStep, log_dir: Path) -> str:
    """The one line a stopped non-finite step prints: the step, the quantities, the rows, the
    checkpoint still good and what to do."""
    root = log_dir / "checkpoints"
    name, _ = read_latest(root)
    kept = (
        f"the last good checkpoint, {root / name}, is untouched and a rerun resumes from it"
        if name
        else "no checkpoint was saved before it"
    )
    return (
        f"{error.describe()}; stopped (trainer.non_finite=stop): {kept}; check those rows and "
        f"the weights, or set trainer.non_finite=skip to skip such steps"
    )
