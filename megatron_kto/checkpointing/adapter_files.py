"""Adapters on disk, as far as checkpoints need to know them: the file names of a PEFT adapter
directory, and an adapter-only (LoRA) training checkpoint's format: its adapter entries
(`lora.` keys), the record of its base (`lora_base.json`) and the same-base check.

`peft/` builds on this (the base fingerprint, adapter directories in and out, a LoRA model from
such a checkpoint); the checkpoint manager and the pretrained-checkpoint lookup read only this,
so checkpointing/ does not import peft/. Standard library only: the pretrained-checkpoint lookup
runs before megatron-core is imported. (Loading the adapter entries into a model:
`model_io.load_adapter_state`.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_kto.checkpointing.errors import CheckpointError

#: A PEFT adapter directory: its config and weights files (Hugging Face `peft`'s names).
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: An adapter-only training checkpoint's record of its base (`peft.checkpoint.base_record`:
#: the base's `restore_from_path` and fingerprint).
BASE_FILE = "lora_base.json"
#: Key prefix of the adapter entries in a model's (sharded) state dict.
ADAPTER_PREFIX = "lora."
_RTOL = 1e-9


def is_adapter_dir(path: str | Path) -> bool:
    """Whether `path` is a PEFT adapter directory (holds adapter_config.json)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_sharded_state_dict(model_sd: dict[str, Any]) -> dict[str, Any]:
    """The adapter entries of a `model_io.model_sharded_state_dict` result (same nesting)."""
    return {
        chunk: {k: v for k, v in entries.items() if k.startswith(ADAPTER_PREFIX)}
        for chunk, entries in model_sd.items()
    }


def check_same_base(ckpt_dir: Path, fingerprint: list[float]) -> None:
    """Refuse to resume adapters trained on another base model.

    Raises:
        CheckpointError: one line naming the checkpoint and the base it was trained on.
    """
    path = Path(ckpt_dir) / BASE_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{ckpt_dir}: not a LoRA checkpoint ({BASE_FILE} is missing); resume it with "
            "model.peft.peft_scheme=none"
        )
    saved = json.loads(path.read_text())
    then = saved["fingerprint"]
    same = len(then) == len(fingerprint) and all(
        abs(a - b) <= _RTOL * max(abs(a), abs(b), 1.0) for a, b in zip(then, fingerprint)
    )
    if not same:
        raise CheckpointError(
            f"{ckpt_dir}: its adapters were trained on another base model "
            f"(pretrained_checkpoint.restore_from_path={saved['restore_from_path']}); resume with "
            "that base, or start a new run directory"
        )
