"""Per-rank random-number-generator state: capture, restore, and a pickle-free file format.

A resumed run must draw the same dropout masks (and any Python/NumPy randomness) as an
uninterrupted one. Each rank stores its own state: Python `random`, NumPy's global generator,
torch's CPU generator, every CUDA device generator, and megatron's model-parallel RNG tracker
(the named streams behind tensor-parallel dropout). Everything is converted to tensors and plain
numbers so the file loads with `torch.load(weights_only=True)` — no pickled code runs on resume.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from megatron.core import tensor_parallel


def capture() -> dict[str, Any]:
    """This process's RNG states as a dict of tensors and numbers."""
    py_version, py_internal, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python_version": int(py_version),
        "python_internal": torch.tensor(py_internal, dtype=torch.int64),
        "python_gauss": py_gauss,
        "numpy_name": str(np_name),
        "numpy_keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
        "numpy_pos": int(np_pos),
        "numpy_has_gauss": int(np_has_gauss),
        "numpy_gauss": float(np_gauss),
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": [],
        "tracker": {
            name: s.clone()
            for name, s in tensor_parallel.get_cuda_rng_tracker().get_states().items()
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = [
            torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())
        ]
    return state


def restore(state: dict[str, Any]) -> None:
    """Set every generator `capture()` recorded back to the recorded state."""
    random.setstate(
        (
            state["python_version"],
            tuple(int(x) for x in state["python_internal"].tolist()),
            state["python_gauss"],
        )
    )
    np.random.set_state(
        (
            state["numpy_name"],
            state["numpy_keys"].numpy().astype(np.uint32),
            state["numpy_pos"],
            state["numpy_has_gauss"],
            state["numpy_gauss"],
        )
    )
    torch.set_rng_state(state["torch_cpu"])
    for i, s in enumerate(state["torch_cuda"]):
        if torch.cuda.is_available() and i < torch.cuda.device_count():
            torch.cuda.set_rng_state(s, i)
    tensor_parallel.get_cuda_rng_tracker().set_states(dict(state["tracker"]))


def rank_file(ckpt_dir: Path, rank: int) -> Path:
    """Where global rank `rank` keeps its RNG state inside a checkpoint directory."""
    return Path(ckpt_dir) / "rng" / f"rank_{rank:05d}.pt"


def save(ckpt_dir: Path, rank: int) -> None:
    """Write this process's RNG state for global rank `rank`."""
    path = rank_file(ckpt_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(capture(), path)


def load(ckpt_dir: Path, rank: int) -> dict[str, Any]:
    """Read a state written by `save` (tensors and plain values only)."""
    return torch.load(rank_file(ckpt_dir, rank), map_location="cpu", weights_only=True)
