"""`reference_policy=precomputed`: the reference forward passes of a run, done before training.

The table holds reference log-probs by example (train examples first, then validation
examples; `index` in a batch is the row):

* **KTO** ``[N, 1 + E]``: column 0 is the example's own row; column ``1 + e`` its KL row in
  epoch ``e`` (validation: its KL row in the validation pass). KL partners are chosen over each
  global batch exactly as training chooses them (`data.kl_pairs`, the sampler order is
  deterministic), so a precomputed run sees the same KL rows — hence the same z₀ — as a
  `cpu_swap` run: the table is computed for the global batches the run will consume (``E`` =
  epochs touched by `max_steps`, the first `steps_per_epoch` batches of each; the first
  `limit_val_batches` validation batches). Later epochs only need their KL rows.
* **DPO** ``[N, 2]``: chosen and rejected rows of every example.

Each rank computes its data-parallel share of each global batch, collated and micro-batched as
the live reference pass would be, and the shares are summed over DP. Entries the run never needs
are NaN; looking one up is an error (`models.reference.PrecomputedReference`).

The table is written to `<log_dir>/reference_logps/` with a fingerprint of what it was computed
from, and reused by resumed runs — a resumed run must not recompute it, because by then the
policy weights are no longer the reference.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_kto.models.forward import LOGP_SUM, data_parallel_all_reduce
from megatron_kto.models.schedule import to_device

TABLE_FILE = "table.npy"
FINGERPRINT_FILE = "fingerprint.json"


@dataclass(frozen=True)
class Coverage:
    """Which global batches of each split the run consumes (`algorithms.dpo.LoopSettings`)."""

    max_steps: int
    steps_per_epoch: int
    limit_val_batches: int

    @property
    def epochs(self) -> int:
        """Training epochs touched (KL columns of the KTO table)."""
        return max(1, -(-self.max_steps // self.steps_per_epoch))

    def passes(self, split: Any) -> Iterator[tuple[int, int]]:
        """(epoch, global batches consumed) of each pass over `split`."""
        if split.name != "train":
            yield 0, min(self.limit_val_batches, split.num_global_batches)
            return
        for epoch in range(self.epochs):
            left = self.max_steps - epoch * self.steps_per_epoch
            yield epoch, min(self.steps_per_epoch, left, split.num_global_batches)


def _kto_batches(split: Any, coverage: Coverage) -> Iterator[tuple[int, list]]:
    """(epoch, global batch as `(index, partner, epoch)` entries) for every consumed batch."""
    for epoch, batches in coverage.passes(split):
        for indices, partners in split.global_batches(epoch, batches):
            yield epoch, [(i, p, epoch) for i, p in zip(indices, partners)]


def _share(rows: list, dp_rank: int, dp_size: int) -> list:
    per_rank = len(rows) // dp_size
    return rows[dp_rank * per_rank : (dp_rank + 1) * per_rank]


def _compute_kto(model: Any, splits: Sequence[Any], runtime: Any, coverage: Coverage):
    total = sum(len(s.dataset) for s in splits)
    columns = 1 + coverage.epochs
    values = torch.zeros(total, columns, dtype=torch.float64, device=runtime.device)
    filled = torch.zeros(total, columns, dtype=torch.float64, device=runtime.device)
    s = model.settings
    for split in splits:
        seen = np.zeros(len(split.dataset), dtype=bool)  # the same on every rank
        for epoch, entries in _kto_batches(split, coverage):
            share = _share(entries, runtime.data_parallel_rank, runtime.data_parallel_size)
            local = np.asarray([i for i, _, _ in share])
            need_samples = not seen[local].all()
            seen[np.asarray([i for i, _, _ in entries])] = True
            batch = to_device(split.collate([split.dataset[e] for e in share]), runtime.device)
            rows = batch["index"]
            if not s.uses_kl_rows:  # the loss ignores z0: no KL row exists (column stays 0)
                if need_samples:
                    values[rows, 0] = model.forward_logprobs(batch, model.chunks).double()
                    filled[rows, 0] = 1.0
                filled[rows, 1 + epoch] = 1.0
                continue
            if need_samples:
                logps = model.forward_logprobs(batch, model.chunks).double()
                values[rows, 0], filled[rows, 0] = logps[: len(share)], 1.0
                kl = logps[len(share) :]
            else:  # later epochs: the rows are known, only the KL partners changed
                kl = model.kl_row_stats(batch, model.chunks)[:, LOGP_SUM].double()
            values[rows, 1 + epoch], filled[rows, 1 + epoch] = kl, 1.0
    return values, filled


def examples_per_pass(micro_batch_size: int, runtime: Any) -> int:
    """Examples per forward pass so that every pass suits megatron-core's schedule.

    A pass over E examples runs their 2E rows (chosen + rejected) in micro-batches of
    `micro_batch_size` rows. The interleaved schedule needs a number of micro-batches that is a
    multiple of PP (`schedules.py`, forward_backward_pipelining_with_interleaving:
    `microbatch_group_size_per_vp_stage`, which defaults to PP, must be <= the count and divide
    it); the other schedules take any count, so one micro-batch of E rows per half is kept there.
    """
    if runtime.virtual_pipeline_parallel_size is None:
        return micro_batch_size
    pp = runtime.pipeline_parallel_size
    # 2E / micro_batch_size = k * PP with the smallest k: E = micro_batch_size * PP / 2 (PP even).
    return micro_batch_size * (pp // 2 if pp % 2 == 0 else pp)


def _compute_dpo(model: Any, splits: Sequence[Any], runtime: Any):
    total = sum(len(s.dataset) for s in splits)
    values = torch.zeros(total, 2, dtype=torch.float64, device=runtime.device)
    chunk = model.settings.forward_micro_batch_size
    interleaved = runtime.virtual_pipeline_parallel_size is not None
    per_pass = examples_per_pass(chunk, runtime)
    dp_rank, dp_size = runtime.data_parallel_rank, runtime.data_parallel_size
    for split in splits:
        n = len(split.dataset)
        # Contiguous chunks dealt round-robin over DP ranks; TP/PP peers of one DP rank get the
        # same list, which is all the forward-only schedule needs (it has no DP collective).
        for start in range(dp_rank * per_pass, n, dp_size * per_pass):
            items = [split.dataset[i] for i in range(start, min(start + per_pass, n))]
            if interleaved:
                # A short last pass is topped up with copies of its last example, which write
                # the same values to the same table row; the micro-batch count stays valid.
                items += items[-1:] * (per_pass - len(items))
            mbs = chunk if interleaved else len(items)
            batch = to_device(split.collate(items), runtime.device)
            logps = model.forward_logprobs(batch, model.chunks, micro_batch_size=mbs)
            values[batch["index"]] = torch.stack(logps.chunk(2), dim=1).double()
    return values, torch.ones_like(values)


def compute_table(
    model: Any, splits: Sequence[Any], runtime: Any, coverage: Coverage
) -> torch.Tensor:
    """Reference log-probs the run will look up, computed with the model's current (i.e.
    initial = reference) weights. Collective over the job.

    Args:
        model: `MegatronGPTKTOModel` or `MegatronGPTDPOModel`.
        splits: `data.pipeline.Split`s (train first) built with consecutive index offsets from 0.
        runtime: the `Runtime`.
        coverage: the global batches the run consumes (KTO).

    Returns:
        float32 table on the CPU ([N, 1 + epochs] KTO, [N, 2] DPO), identical on every rank;
        NaN where the run needs nothing (KTO without KL rows: the KL columns are 0, never read).
    """
    kto = splits[0].kl_prompt_keys is not None
    if kto:
        values, filled = _compute_kto(model, splits, runtime, coverage)
    else:
        values, filled = _compute_dpo(model, splits, runtime)
    # Every entry was computed by exactly one DP rank (or by none: NaN).
    data_parallel_all_reduce(values)
    data_parallel_all_reduce(filled)
    values[filled == 0] = float("nan")
    return values.float().cpu()


def covers(table: torch.Tensor, splits: Sequence[Any], coverage: Coverage) -> bool:
    """Whether `table` has every entry the run will look up."""
    if splits[0].kl_prompt_keys is None:
        return not bool(torch.isnan(table).any())
    if table.shape[1] < 1 + coverage.epochs:
        return False
    offset = 0
    for split in splits:
        for epoch, entries in _kto_batches(split, coverage):
            rows = torch.as_tensor([offset + i for i, _, _ in entries])
            if torch.isnan(table[rows][:, [0, 1 + epoch]]).any():
                return False
        offset += len(split.dataset)
    return True


def load_or_compute(
    model: Any,
    splits: Sequence[Any],
    runtime: Any,
    coverage: Coverage,
    out_dir: Path,
    fingerprint: dict[str, Any],
    resuming: bool,
) -> torch.Tensor:
    """Load the table from `out_dir` if its fingerprint matches and it covers the run, else
    compute and save it.

    Must run before a checkpoint is loaded into the model (the weights must be the reference's).

    Raises:
        RuntimeError: the run resumes from a checkpoint but its table is missing, stale, or
            does not cover the steps asked for (recomputing would use trained weights as the
            reference).
    """
    out_dir = Path(out_dir)
    meta_path, table_path = out_dir / FINGERPRINT_FILE, out_dir / TABLE_FILE
    if meta_path.is_file() and table_path.is_file():
        if json.loads(meta_path.read_text()) == fingerprint:
            table = torch.from_numpy(np.load(table_path))
            if covers(table, splits, coverage):
                return table
            if resuming:
                raise RuntimeError(
                    f"{table_path}: the precomputed reference log-probs cover fewer steps than "
                    f"this run asks for (max_steps {coverage.max_steps}); a resumed run cannot "
                    "add to them, so keep the original trainer.*.max_steps/max_epochs"
                )
        elif resuming:
            raise RuntimeError(
                f"{out_dir}: precomputed reference log-probs were made from other data/weights"
            )
    elif resuming:
        raise RuntimeError(
            f"{table_path}: missing; a resumed precomputed-reference run cannot recompute it"
        )
    table = compute_table(model, splits, runtime, coverage)
    if runtime.is_rank0:
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = table_path.with_suffix(".tmp.npy")
        np.save(tmp, table.numpy())
        os.replace(tmp, table_path)
        meta_path.write_text(json.dumps(fingerprint, sort_keys=True))
    torch.distributed.barrier()
    return table
