"""`pretrained_checkpoint.restore_from_path`: model weights only, from any of our checkpoints.

Accepted paths: see `checkpointing.locate` (which resolves them without torch).

Tensors are keyed by global names, so any of these loads under any TP/PP layout. A Hugging
Face model directory is read directly, each rank reading only its own slices (`hf_source`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_kto.checkpointing.locate import resolve_pretrained_dir
from megatron_kto.checkpointing.model_io import load_model, read_architecture
from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.conversion.hf_dir import looks_like_hf_dir

__all__ = ["resolve_pretrained_dir", "restore_pretrained"]


def restore_pretrained(path: str | Path, model_chunks: list[torch.nn.Module]) -> GPTArchitecture:
    """Collectively load model weights from `path` into this rank's chunks (any layout).

    The caller builds the chunks from `read_architecture(resolve_pretrained_dir(path))` first;
    optimizer state, if present, is ignored.

    Returns:
        The architecture stored with the weights (a Hugging Face directory's, from config.json).

    Raises:
        CheckpointError: no usable checkpoint, or the weights do not fit the model.
    """
    ckpt_dir = resolve_pretrained_dir(path)
    if looks_like_hf_dir(ckpt_dir):
        from megatron_kto.checkpointing.hf_source import load_hf_model

        load_hf_model(ckpt_dir, model_chunks)
    else:
        load_model(ckpt_dir, model_chunks)
    return read_architecture(ckpt_dir)
