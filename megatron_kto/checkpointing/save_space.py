"""Disk space around a checkpoint save, collectively: how much a save writes on each file system,
the check that stops a save before it writes when it cannot fit, and the one line every rank
raises when a save fails part-way (README.md, "A full disk"). `disk_space.py` holds the pure
file-system part."""

from __future__ import annotations

import logging
import shutil
import socket
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedBase, is_main_replica

from megatron_kto.checkpointing import files
from megatron_kto.checkpointing.disk_space import (
    NO_SPACE,
    directory_bytes,
    filesystem_id,
    free_bytes,
    no_space_cause,
    size,
    write_failure_line,
)
from megatron_kto.checkpointing.errors import CheckpointError
from megatron_kto.console import error_summary

__all__ = ["SaveSpace", "check_space", "save_failure"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveSpace:
    """A save's size estimate and the least free space a rank has for it (bytes)."""

    needed: int
    free: int


def tensor_bytes(sharded: dict[str, Any]) -> int:
    """Bytes of the tensors this rank writes in a dist_checkpointing save of `sharded`: the main
    replicas of its `ShardedTensor`s (replicas on other ranks are written once, by their main
    replica's rank)."""
    total = 0
    for value in nested_values(sharded):
        data = getattr(value, "data", None)
        if isinstance(value, ShardedBase) and torch.is_tensor(data):
            if is_main_replica(getattr(value, "replica_id", 0)):
                total += data.numel() * data.element_size()
    return total


def innermost(error: BaseException) -> BaseException:
    """The first per-rank failure a torch `CheckpointException` carries, else `error`."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        return first[0] if isinstance(first, tuple) else first
    return error


def check_space(
    root: Path, group: Any, rank: int, step: int, tmp: Path, sharded: dict[str, Any]
) -> SaveSpace:
    """How many bytes this save writes and how much space is free for it; stops the save
    before it writes anything when it cannot fit, and warns when the save after it will not.

    Each rank's writers write the tensor bytes of its main replicas. Ranks of one host on one
    file system (same device number) certainly share it: they need the sum of their bytes
    there, and when the whole job is on one file system, at least the size of the newest
    checkpoint (small files and shard headers included). Tensor bytes are a lower bound on
    the save, so a file system with less free space than that would fail the save for
    certain: stopping before it costs nothing and leaves no partial files. Ranks on other
    hosts may share a network file system or not; for them the total is only a warning.

    Raises:
        CheckpointError: on every rank, when some file system cannot hold its part.
    """
    host = zlib.crc32(socket.gethostname().encode())
    info = torch.tensor(
        [tensor_bytes(sharded), free_bytes(root), host, filesystem_id(root)],
        dtype=torch.int64,
    )
    every = [torch.zeros_like(info) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, info, group=group)
    groups: dict[tuple[int, int], list[int]] = {}
    for written, free, *where in (t.tolist() for t in every):
        group = groups.setdefault(tuple(where), [0, free])
        group[0] += written
        group[1] = min(group[1], free)
    total = sum(int(t[0]) for t in every)
    if len(groups) == 1:
        name, _ = files.read_latest(root)
        if name is not None:
            total = max(total, directory_bytes(root / name))
        groups = {key: [total, free] for key, (_, free) in groups.items()}
    needed, free = max(groups.values(), key=lambda g: g[0] - g[1])
    space = SaveSpace(needed, free)
    if free < needed:
        raise CheckpointError(
            write_failure_line(tmp, f"the checkpoint of step {step}", NO_SPACE, root, needed, free)
        )
    least = min(free for _, free in groups.values())
    if least - total < total and rank == 0:
        # Old checkpoints are pruned only after the new one is complete.
        logger.warning(
            "low disk space: %s free on %s after the checkpoint of step %d; the next one "
            "needs ~%s more — free space before then or the run will stop at that save",
            size(max(0, least - total)),
            root,
            step,
            size(total),
        )
    return space


def save_failure(
    root: Path, rank: int, where: Path, step: int, error: BaseException | None, space: SaveSpace
) -> CheckpointError:
    """The error every rank raises for a failed save (the line is rank 0's to print); the
    partial `.tmp` is removed — every rank has left the save, so nothing writes into it."""
    if rank != 0:
        return CheckpointError(f"{where}: the save failed (rank 0 says why)")
    if error is None:
        cause = "failed on another rank"
    else:
        # What is left to write, for an error that names no cause: the tensors minus the
        # bytes already in the partial directory.
        left = space.needed - directory_bytes(where)
        cause = no_space_cause(error, root, left) or error_summary(innermost(error))
    if where.name.endswith(files.TMP_SUFFIX):
        shutil.rmtree(where, ignore_errors=True)
    free = free_bytes(root)
    return CheckpointError(
        write_failure_line(where, f"the checkpoint of step {step}", cause, root, space.needed, free)
    )
