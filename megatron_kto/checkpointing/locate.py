"""Find the checkpoint a path refers to and read its architecture — file-system reads only.

No torch, no megatron-core: the entry points call this while validating the config, before
any process group or model exists, so that a layout the checkpoint cannot take (TP vs its heads,
PP vs its layers, ...) is reported within a second or two of launch.

Accepted paths (`pretrained_checkpoint.restore_from_path`, the tools' `--policy` / `--ckpt`):
- a conversion-tool checkpoint (dist checkpoint + architecture.json);
- a training checkpoint directory `step_<N>`;
- a training checkpoint root (holding the `latest` marker and `step_<N>` dirs), its `latest`
  marker itself, or a log directory whose `checkpoints/` is a root — the newest usable
  checkpoint is taken, as on resume;
- a Hugging Face model directory (config.json + safetensors, as the Hub publishes it): its
  architecture is read from config.json (`conversion.hf_dir`; the family registry, and with it
  torch, is imported only then) and `restore_pretrained` reads its weights directly.

A PEFT adapter directory (adapter_config.json, no model weights) is refused with a line
saying where it goes (`model.peft.restore_from_path`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

from megatron_kto.checkpointing import files
from megatron_kto.checkpointing.adapter_files import ADAPTER_CONFIG, is_adapter_dir
from megatron_kto.checkpointing.errors import CheckpointError
from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.conversion.hf_config import ConversionError
from megatron_kto.conversion.hf_dir import CONFIG as HF_CONFIG
from megatron_kto.conversion.hf_dir import (
    INDEX,
    SINGLE,
    check_hf_dir,
    looks_like_hf_dir,
    read_hf_architecture,
)

logger = logging.getLogger(__name__)

ARCH_FILE = "architecture.json"
_DIST_METADATA = "metadata.json"


def _warn_on_rank0(message: str) -> None:
    # RANK is set by torchrun before the process group exists; every rank resolves the same
    # path, so one copy of the warning is enough.
    if os.environ.get("RANK", "0") == "0":
        logger.warning("%s", message)


def resolve_pretrained_dir(path: str | Path, warn: Callable[[str], None] = _warn_on_rank0) -> Path:
    """The directory holding the weights `path` refers to (see the module docstring).

    Pure file-system reads: every rank may call it and gets the same answer on a shared
    file system.

    Args:
        path: what the user gave.
        warn: receives one line per skipped (damaged) checkpoint.

    Raises:
        CheckpointError: nothing usable at `path`, in one line.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: not found (pretrained_checkpoint.restore_from_path)")
    weights = (SINGLE, INDEX, _DIST_METADATA)
    if is_adapter_dir(path) and not any((path / name).is_file() for name in weights):
        # A LoRA adapter holds no base weights (a copied config.json does not make it a model).
        raise CheckpointError(
            f"{path}: a PEFT adapter directory ({ADAPTER_CONFIG}), not a model: pass it as "
            "model.peft.restore_from_path (with model.peft.peft_scheme=lora) and its base model "
            "as pretrained_checkpoint.restore_from_path"
        )
    if looks_like_hf_dir(path):
        try:
            check_hf_dir(path)
        except ConversionError as e:
            raise CheckpointError(str(e)) from None
        return path
    if (path / _DIST_METADATA).is_file():
        if (path / files.MANIFEST).exists() or (path / files.CHECKPOINT_META).exists():
            problem = files.check_complete(path)
            if problem:
                raise CheckpointError(f"{path}: incomplete training checkpoint: {problem}")
        return path
    root = path
    if path.is_file() and path.name == files.LATEST:
        # `checkpoints/latest` is the marker file naming the newest step: read it as its root,
        # so a damaged newest step falls back as on resume.
        root = path.parent
    elif not (root / files.LATEST).exists() and not files.list_step_dirs(root):
        if (root / "checkpoints").is_dir():
            root = root / "checkpoints"
    candidates, notes = files.candidates(root)
    for note in notes:
        warn(note)
    problems = []
    for ckpt in candidates:
        problem = files.check_complete(ckpt)
        if problem is None:
            return ckpt
        problems.append(f"{ckpt.name}: {problem}")
        warn(f"skipping checkpoint {ckpt}: {problem} — trying the previous one")
    detail = "; ".join(problems) if problems else "no model checkpoint or step_<N> directories"
    raise CheckpointError(f"{path}: no usable checkpoint ({detail})")


def architecture_file(ckpt_dir: str | Path) -> Path:
    """The file `read_architecture` reads: architecture.json, or a Hugging Face config.json."""
    ckpt_dir = Path(ckpt_dir)
    return ckpt_dir / (HF_CONFIG if looks_like_hf_dir(ckpt_dir) else ARCH_FILE)


def read_architecture(ckpt_dir: str | Path) -> GPTArchitecture:
    """Read the architecture stored with a checkpoint, or a Hugging Face directory's.

    Raises:
        CheckpointError: if the file is absent or unreadable, or the Hugging Face model is not
            of a supported family (the message names the supported ones).
    """
    if looks_like_hf_dir(ckpt_dir):
        try:
            return read_hf_architecture(ckpt_dir, _warn_on_rank0)[1]
        except ConversionError as e:
            raise CheckpointError(str(e)) from None
    path = Path(ckpt_dir) / ARCH_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: not found — is {ckpt_dir} a megatron_kto checkpoint?")
    try:
        return GPTArchitecture.from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: invalid architecture record: {e}") from e
