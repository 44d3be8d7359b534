"""`reference_policy=precomputed`: one reference forward pass over the data before training.

The table holds, per example (train examples first, then validation examples, see
`data.kl_pairs.IndexedExamples`), the reference log-probs of its two rows (sample + KL row for
KTO; chosen + rejected for DPO). It is written to `<log_dir>/reference_logps/` with a
fingerprint of what it was computed from, and reused by every epoch and by resumed runs — a
resumed run must not recompute it, because by then the policy weights are no longer the
reference.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_kto.models.forward import data_parallel_all_reduce
from megatron_kto.models.schedule import to_device

TABLE_FILE = "table.npy"
FINGERPRINT_FILE = "fingerprint.json"


def _rank_chunks(num_examples: int, chunk: int, dp_rank: int, dp_size: int) -> list[range]:
    # Contiguous chunks dealt round-robin over DP ranks; TP/PP peers of one DP rank get the same
    # list, which is all the forward-only schedule needs (it has no DP collective).
    starts = range(dp_rank * chunk, num_examples, dp_size * chunk)
    return [range(s, min(s + chunk, num_examples)) for s in starts]


def compute_table(model: Any, splits: Sequence[Any], runtime: Any, chunk: int) -> torch.Tensor:
    """Reference log-probs of every example of `splits`, computed with the model's current
    (i.e. initial = reference) weights.

    Args:
        model: `MegatronGPTKTOModel` or `MegatronGPTDPOModel` (uses `forward_logprobs`).
        splits: `data.pipeline.Split`s whose datasets are `IndexedExamples` with consecutive
            index offsets starting at 0.
        runtime: the `Runtime`.
        chunk: examples per forward pass (per DP rank).

    Returns:
        [N, 2] float32 table on the CPU, identical on every rank (KTO without KL rows: the
        second column is 0 and never read).
    """
    total = sum(len(s.dataset) for s in splits)
    table = torch.zeros(total, 2, dtype=torch.float64, device=runtime.device)
    for split in splits:
        for rows in _rank_chunks(
            len(split.dataset), chunk, runtime.data_parallel_rank, runtime.data_parallel_size
        ):
            batch = to_device(split.collate([split.dataset[i] for i in rows]), runtime.device)
            logps = model.forward_logprobs(batch, model.chunks, micro_batch_size=len(rows))
            # [R * B] → [B, R]; R = 1 for a KTO loss without KL rows (that column stays 0).
            per_row = logps.view(-1, len(rows)).t().double()
            table[batch["index"], : per_row.shape[1]] = per_row
    data_parallel_all_reduce(table)  # rows are disjoint across DP ranks
    return table.float().cpu()


def load_or_compute(
    model: Any,
    splits: Sequence[Any],
    runtime: Any,
    chunk: int,
    out_dir: Path,
    fingerprint: dict[str, Any],
    resuming: bool,
) -> torch.Tensor:
    """Load the table from `out_dir` if its fingerprint matches, else compute and save it.

    Must run before a checkpoint is loaded into the model (the weights must be the reference's).

    Raises:
        RuntimeError: the run resumes from a checkpoint but its table is missing or stale
            (recomputing would use trained weights as the reference).
    """
    out_dir = Path(out_dir)
    meta_path, table_path = out_dir / FINGERPRINT_FILE, out_dir / TABLE_FILE
    if meta_path.is_file() and table_path.is_file():
        if json.loads(meta_path.read_text()) == fingerprint:
            return torch.from_numpy(np.load(table_path))
        if resuming:
            raise RuntimeError(
                f"{out_dir}: precomputed reference log-probs were made from other data/weights"
            )
    elif resuming:
        raise RuntimeError(
            f"{table_path}: missing; a resumed precomputed-reference run cannot recompute it"
        )
    table = compute_table(model, splits, runtime, chunk)
    if runtime.is_rank0:
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = table_path.with_suffix(".tmp.npy")
        np.save(tmp, table.numpy())
        os.replace(tmp, table_path)
        meta_path.write_text(json.dumps(fingerprint, sort_keys=True))
    torch.distributed.barrier()
    return table
