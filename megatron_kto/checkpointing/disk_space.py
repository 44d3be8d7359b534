"""The one line a write that failed for want of disk space ends the run with, naming the
checkpoint still good — pure file-system code, no torch.distributed (`runtime.disk` finds the
cause and the free space)."""

from __future__ import annotations

import os
from pathlib import Path

from megatron_kto.checkpointing.files import read_latest
from megatron_kto.runtime.disk import (
    NO_SPACE,
    NO_SPACE_CAUSES,
    filesystem_id,
    free_bytes,
    no_space_cause,
    size,
)

__all__ = [
    "NO_SPACE",
    "directory_bytes",
    "filesystem_id",
    "free_bytes",
    "kept_line",
    "no_space_cause",
    "size",
    "write_failure_line",
]


def directory_bytes(path: str | os.PathLike[str]) -> int:
    """Total size of the files under `path` (0 when it does not exist)."""
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def kept_line(checkpoint_root: Path) -> str:
    """What a failed write left for a rerun: the checkpoint `latest` names, or none."""
    name, _ = read_latest(checkpoint_root)
    if name:
        return f"the last good checkpoint, {checkpoint_root / name}, is untouched and a rerun resumes from it"
    return "no checkpoint was saved before it"


def write_failure_line(
    path: Path,
    what: str,
    cause: str,
    checkpoint_root: Path,
    needed: int | None = None,
    free: int | None = None,
) -> str:
    """The one line a failed write ends the run with.

    Args:
        path: what was being written (a `.tmp` directory, a file).
        what: e.g. "the checkpoint of step 6", "metrics".
        cause: `no_space_cause(error)` or a one-line summary of the error.
        checkpoint_root: `<log dir>/checkpoints`, to name the checkpoint still good.
        needed: estimated bytes the write needed, when known.
        free: bytes free on `path`'s file system, when known.
    """
    if cause in NO_SPACE_CAUSES:
        space = ", ".join(
            part
            for part in (
                f"needs ~{size(needed)}" if needed is not None else "",
                f"{size(free)} free" if free is not None else "",
            )
            if part
        )
        return (
            f"{path}: {cause} writing {what}"
            + (f" ({space})" if space else "")
            + f"; {kept_line(checkpoint_root)}; free space and rerun the same command"
        )
    return f"{path}: writing {what} failed: {cause}; {kept_line(checkpoint_root)}"
