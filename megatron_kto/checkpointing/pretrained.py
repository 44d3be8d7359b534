"""`pretrained_checkpoint.restore_from_path`: model weights only, from any of our checkpoints.

Accepted paths:
- a conversion-tool checkpoint (model_io format: dist checkpoint + architecture.json);
- a training checkpoint directory `step_<N>`;
- a training checkpoint root (holding `latest` / `step_<N>` dirs), or a log directory whose
  `checkpoints/` is one — the newest usable checkpoint is taken, as on resume.

Tensors are keyed by global names, so any of these loads under any TP/PP layout.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_kto.checkpointing import files
from megatron_kto.checkpointing.errors import CheckpointError
from megatron_kto.checkpointing.model_io import load_model, read_architecture
from megatron_kto.models.architecture import GPTArchitecture

logger = logging.getLogger(__name__)

_DIST_METADATA = "metadata.json"


def _warn(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.warning("%s", message)


def resolve_pretrained_dir(path: str | Path) -> Path:
    """The directory holding the weights `path` refers to (see the module docstring).

    Pure file-system reads: every rank may call it and gets the same answer on a shared
    file system.

    Raises:
        CheckpointError: nothing usable at `path`, in one line.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: not found (pretrained_checkpoint.restore_from_path)")
    if (path / _DIST_METADATA).is_file():
        if (path / files.MANIFEST).exists() or (path / files.CHECKPOINT_META).exists():
            problem = files.check_complete(path)
            if problem:
                raise CheckpointError(f"{path}: incomplete training checkpoint: {problem}")
        return path
    root = path
    if not (root / files.LATEST).exists() and not files.list_step_dirs(root):
        if (root / "checkpoints").is_dir():
            root = root / "checkpoints"
    candidates, notes = files.candidates(root)
    for note in notes:
        _warn(note)
    problems = []
    for ckpt in candidates:
        problem = files.check_complete(ckpt)
        if problem is None:
            return ckpt
        problems.append(f"{ckpt.name}: {problem}")
        _warn(f"skipping checkpoint {ckpt}: {problem} — trying the previous one")
    detail = "; ".join(problems) if problems else "no model checkpoint or step_<N> directories"
    raise CheckpointError(f"{path}: no usable checkpoint ({detail})")


def restore_pretrained(path: str | Path, model_chunks: list[torch.nn.Module]) -> GPTArchitecture:
    """Collectively load model weights from `path` into this rank's chunks (any layout).

    The caller builds the chunks from `read_architecture(resolve_pretrained_dir(path))` first;
    optimizer state, if present, is ignored.

    Returns:
        The architecture stored with the weights.

    Raises:
        CheckpointError: no usable checkpoint, or the weights do not fit the model.
    """
    ckpt_dir = resolve_pretrained_dir(path)
    load_model(ckpt_dir, model_chunks)
    return read_architecture(ckpt_dir)
