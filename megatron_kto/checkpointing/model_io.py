"""Model weights in megatron-core's dist_checkpointing (torch_dist) format, plus the architecture.

Layout of a checkpoint directory (written by training and by the conversion tool alike)::

    <dir>/architecture.json     GPTArchitecture.to_dict() — restore needs no model config
    <dir>/<dist_checkpointing files>   sharded tensors under the "model." namespace
                                       (training checkpoints add "optimizer.")

Tensors are keyed by their global (layout-independent) names, so a checkpoint saved under one
TP/PP/VPP layout loads under any other.
"""

from __future__ import annotations

import json
import queue
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async

from megatron_kto.checkpointing.adapter_files import ADAPTER_PREFIX
from megatron_kto.checkpointing.errors import CheckpointError
from megatron_kto.checkpointing.locate import ARCH_FILE, read_architecture
from megatron_kto.checkpointing.spec_compat import load_module_state, load_sharded
from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.models.builder import unwrap
from megatron_kto.models.training_setup import finish_param_sync

__all__ = [
    "ARCH_FILE",
    "CheckpointError",
    "load_model",
    "model_sharded_state_dict",
    "read_architecture",
    "save_model",
    "save_sharded",
    "write_architecture",
]


def model_sharded_state_dict(chunks: list[torch.nn.Module]) -> dict[str, Any]:
    """Sharded state dict of this rank's model chunks: {"model": ...} or {"model0": ..., ...}.

    Interleaved pipelines have several chunks; each chunk's tensors carry global keys, so the
    nesting only organises the returned dict.
    """
    if len(chunks) == 1:
        return {"model": unwrap(chunks[0]).sharded_state_dict()}
    return {f"model{i}": unwrap(c).sharded_state_dict() for i, c in enumerate(chunks)}


def save_sharded(sharded_state_dict: dict[str, Any], ckpt_dir: str | Path) -> None:
    """`dist_checkpointing.save` (synchronous, torch_dist), collective over all ranks.

    Workaround: megatron-core 0.16.1's torch_dist writer hands its write results back through a
    queue served by a `multiprocessing` Manager started with the *spawn* context
    (`filesystem_async._get_write_results_queue`). Spawning it re-imports the main script, and
    unpickling the results there imports torch: the first save of every process waited ~5 s on
    it (measured on a 2-core CPU box; per rank, so every run paid it once). The queue only has to
    cross a process boundary for asynchronous saves; ours are synchronous — the writer's fork
    workers report through their own queue and the results are collected back in this process
    — so an in-process queue carries them. It is installed only where megatron has not created
    its own yet.
    """
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    dist_checkpointing.save(sharded_state_dict, str(ckpt_dir))


def write_architecture(ckpt_dir: str | Path, arch: GPTArchitecture) -> None:
    """Write `architecture.json` (rank 0 only is enough; idempotent)."""
    path = Path(ckpt_dir) / ARCH_FILE
    path.write_text(json.dumps(arch.to_dict(), indent=2, sort_keys=True))


def save_model(ckpt_dir: str | Path, chunks: list[torch.nn.Module], arch: GPTArchitecture) -> None:
    """Collectively save model weights (every rank calls this) and the architecture.

    Args:
        ckpt_dir: an existing, empty directory visible to all ranks.
        chunks: this rank's model chunks.
        arch: the model's architecture record.
    """
    ckpt_dir = Path(ckpt_dir)
    finish_param_sync(chunks)  # DDP chunks with a deferred all-gather (overlap_param_gather)
    save_sharded(model_sharded_state_dict(chunks), ckpt_dir)
    if torch.distributed.get_rank() == 0:
        write_architecture(ckpt_dir, arch)
    torch.distributed.barrier()


def load_model(ckpt_dir: str | Path, chunks: list[torch.nn.Module]) -> None:
    """Collectively load model weights saved under any layout into this rank's chunks.

    Raises:
        CheckpointError: if the directory is not a complete dist checkpoint or a tensor is
            missing/mis-shaped.
    """
    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / "metadata.json").is_file():
        raise CheckpointError(f"{ckpt_dir}: not a complete dist checkpoint (no metadata.json)")
    sharded = model_sharded_state_dict(chunks)
    try:
        # Tolerates Transformer Engine's extra state on either side (spec_compat).
        loaded = load_sharded(sharded, ckpt_dir)
    except CheckpointError:
        raise
    except Exception as e:  # megatron raises several types; surface one clear line
        raise CheckpointError(
            f"{ckpt_dir}: cannot load model weights: {type(e).__name__}: {e}"
        ) from e
    for i, chunk in enumerate(chunks):
        state = loaded["model"] if len(chunks) == 1 else loaded[f"model{i}"]
        load_module_state(unwrap(chunk), state, str(ckpt_dir))


def load_adapter_state(chunk: torch.nn.Module, state: dict[str, Any], where: str) -> None:
    """Load the adapter entries of a loaded (adapter-only) model state into `chunk`, strictly."""
    container = unwrap(chunk).lora
    inner = {k[len(ADAPTER_PREFIX) :]: v for k, v in state.items() if k.startswith(ADAPTER_PREFIX)}
    result = container.load_state_dict(inner, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise CheckpointError(
            f"{where}: the adapters do not fit this run's model.peft.lora_tuning (missing "
            f"{result.missing_keys[:2]}, unexpected {result.unexpected_keys[:2]})"
        )
