"""Where an example of a split came from: its data file and line (for error messages).

Batches carry each example's dataset index (`collate`'s `index`); tokenised shards keep no
line numbers (the cache stays as it is). When a message must name rows — a non-finite step —
the index is mapped back here: shard = file, then the file's rows are read again (no
tokenising) and the k-th example's line is taken. That is exact when the file lost no example
to the length policy; otherwise the position among the kept examples is named instead.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_kto.data.formats import PairedExample, iter_dpo_examples, iter_normalized


def _example_lines(path: Path, kind: str) -> list[int]:
    """The source line of every example of `path`, in shard order (a paired row gives KTO two
    examples on one line)."""
    if kind == "dpo":
        return [e.where.line for e in iter_dpo_examples(path)]
    lines: list[int] = []
    for row in iter_normalized(path):
        lines += [row.where.line] * (2 if isinstance(row, PairedExample) else 1)
    return lines


def _base_dataset(dataset: Any) -> Any:
    # `kl_pairs.BatchKLPartners` / `IndexedExamples` wrap the sharded dataset.
    while hasattr(dataset, "dataset") and not hasattr(dataset, "shards"):
        dataset = dataset.dataset
    return dataset


def row_sources(
    dataset: Any, paths: Sequence[Path], kind: str, indices: Sequence[int]
) -> list[str]:
    """`file:line` of each example index (in `indices`' order), or `file (example k of the kept
    ones)` for a file whose length policy dropped rows.

    Args:
        dataset: a split's dataset (`KTODataset`/`DPODataset`, or a view of one).
        paths: the split's files, in the order their shards were built.
        kind: "kto" or "dpo".
        indices: dataset indices (0-based).
    """
    base = _base_dataset(dataset)
    lines: dict[int, list[int]] = {}
    out = []
    for index in indices:
        which = bisect.bisect_right(base._starts, int(index)) - 1
        shard, local = base.shards[which], int(index) - base._starts[which]
        path = Path(paths[which])
        if shard.stats.dropped_total > 0:
            out.append(f"{path} (example {local + 1} of the kept ones)")
            continue
        if which not in lines:
            lines[which] = _example_lines(path, kind)
        out.append(f"{path}:{lines[which][local]}")
    return out
