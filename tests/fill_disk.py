"""Test helpers for full-disk faults: a small tmpfs, and a test-only `sitecustomize` that fills
it in the middle of a run so that the run's next write meets the kernel's real ENOSPC.

`FILL_DISK` = ``save:<rank>:<checkpoint dir name>`` fills the file system on that rank just
before megatron-core writes that checkpoint's tensors (another process taking the space while
the save runs); ``log:<step>`` fills it on rank 0 just before the metrics of that training step
are written. `FILL_DISK_ROOT` is the mount, `FILL_DISK_LEAVE` the bytes left free. The filler is
one file, ``<root>/filler``: deleting it is "freeing space".
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

SITECUSTOMIZE = '''"""Test-only (tests/fill_disk.py): fill the file system during a run."""
import importlib.abc
import importlib.util
import os
import sys

_SPEC = os.environ.get("FILL_DISK", "")


def _fill(path):
    st = os.statvfs(path)
    size = st.f_bavail * st.f_frsize - int(os.environ.get("FILL_DISK_LEAVE", "0"))
    fd = os.open(os.path.join(path, "filler"), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


def _patch_save(module):
    _, rank, name = _SPEC.split(":")
    save = module.save

    def save_filling(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        if os.environ.get("RANK") == rank and os.path.basename(str(checkpoint_dir)) == name:
            _fill(os.environ["FILL_DISK_ROOT"])
        return save(sharded_state_dict, checkpoint_dir, *args, **kwargs)

    module.save = save_filling


def _patch_log(module):
    step = int(_SPEC.split(":")[1])
    log = module.MetricsLogger.log

    def log_filling(self, split, at, *args, **kwargs):
        if self.rank0 and split == "train" and at == step:
            _fill(os.environ["FILL_DISK_ROOT"])
        return log(self, split, at, *args, **kwargs)

    module.MetricsLogger.log = log_filling


_PATCHES = {
    "save": ("megatron.core.dist_checkpointing", _patch_save),
    "log": ("megatron_kto.logging.metrics_logger", _patch_log),
}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Patches a module right after it is first imported (no heavy import here)."""

    def __init__(self, name, patch):
        self.name, self.patch = name, patch

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            self.patch(module)

        spec.loader.exec_module = exec_module
        return spec


if _SPEC and os.environ.get("RANK") is not None:
    sys.meta_path.insert(0, _AfterImport(*_PATCHES[_SPEC.split(":")[0]]))
'''


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (e.g. "3m") mounted at `where` for the block; skips the test where
    mounting is not allowed (not root, no CAP_SYS_ADMIN)."""
    where.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def resize(where: Path, size: str) -> None:
    """Grow (or shrink) a mounted tmpfs: "the user freed space"."""
    subprocess.run(["mount", "-o", f"remount,size={size}", str(where)], check=True)


def fill(where: Path, leave: int = 0) -> Path:
    """Take all but `leave` bytes of `where`'s file system (one file, returned)."""
    st = os.statvfs(where)
    filler = where / "filler"
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize - leave)
    return filler


def inject_env(directory: Path, spec: str, root: Path, leave: int = 0) -> dict[str, str]:
    """Environment for a run whose ranks load the filling `sitecustomize` (written here)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.environ.get("PYTHONPATH", "")
    return {
        "PYTHONPATH": f"{directory}{os.pathsep}{path}" if path else str(directory),
        "FILL_DISK": spec,
        "FILL_DISK_ROOT": str(root),
        "FILL_DISK_LEAVE": str(leave),
    }
