"""A full disk, wherever it shows: how much is free, whether an error means "no space" — pure
file-system code (standard library only), for every room that writes files.

A full disk surfaces in many shapes: `OSError(ENOSPC)` from a plain write, a quota's `EDQUOT`,
and, from torch's zip writer, `[enforce fail at inline_container.cc] unexpected pos ...` with the
real `ENOSPC` only in a sibling worker's failure that `torch.distributed.checkpoint` gathers into
a `CheckpointException`. `no_space_cause` looks through all of them.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

#: errno values that mean "the file system will not take more bytes".
_NO_SPACE = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}
#: The cause a save names when it stops before writing because the estimate does not fit.
NO_SPACE = _NO_SPACE[errno.ENOSPC]
#: Every cause `no_space_cause` returns.
NO_SPACE_CAUSES = tuple(_NO_SPACE.values())
_NO_SPACE_TEXT = {os.strerror(code): text for code, text in _NO_SPACE.items()}


def _existing(path: str | os.PathLike[str]) -> Path:
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes an unprivileged writer may still use on the file system holding `path` (or its
    nearest existing parent)."""
    st = os.statvfs(_existing(path))
    return st.f_bavail * st.f_frsize


def filesystem_id(path: str | os.PathLike[str]) -> int:
    """The device number of the file system holding `path` (or its nearest existing parent):
    equal for two paths of one host on the same file system."""
    return os.stat(_existing(path)).st_dev


def size(n: float) -> str:
    """`n` bytes for a person: `512 B`, `1.7 MiB`, `3.2 GiB`."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _related(error: BaseException) -> list[BaseException]:
    """`error`, its causes and contexts, and the per-rank failures a torch
    `CheckpointException` carries (its `failures`: rank -> (exception, traceback))."""
    seen: list[BaseException] = []
    todo = [error]
    while todo:
        e = todo.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for value in failures.values():
                todo.append(value[0] if isinstance(value, tuple) else value)
    return [e for e in seen if isinstance(e, BaseException)]


def no_space_cause(
    error: BaseException, where: str | os.PathLike[str] | None = None, needed: int = 1
) -> str | None:
    """ "no space left on device" / "disk quota exceeded" when `error` (or anything it wraps)
    says the file system is full — or, for an error that names no cause (numpy's short write:
    "18383 requested and 992 written"), when `where`'s file system has less than `needed`
    bytes free; None otherwise."""
    for e in _related(error):
        if isinstance(e, OSError) and e.errno in _NO_SPACE:
            return _NO_SPACE[e.errno]
        for text, said in _NO_SPACE_TEXT.items():
            if text in str(e):
                return said
    if where is not None and not any(
        isinstance(e, OSError) and e.errno is not None for e in _related(error)
    ):
        if free_bytes(where) < needed:
            return NO_SPACE
    return None
