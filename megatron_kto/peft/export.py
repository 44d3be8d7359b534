"""`tools/convert_checkpoint.py export` of a LoRA run: a PEFT adapter directory, or merged weights.

A LoRA checkpoint holds adapters only; the base is the run's
`pretrained_checkpoint.restore_from_path` (checked against the fingerprint stored with the
adapters). Both exports run in one process at TP=1, as the plain export does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from megatron_kto.models.architecture import GPTArchitecture


def merged_loader(ckpt_dir: Path, chunks: list[torch.nn.Module], arch: GPTArchitecture) -> None:
    """`conversion.convert.export_hf`'s `load` for a LoRA run: base + adapters, merged, then a
    plain model (W += (alpha/r)·B·A per projection)."""
    from megatron_kto.peft.checkpoint import build_lora_model
    from megatron_kto.peft.hf_peft import merge_and_strip

    build_lora_model(ckpt_dir, chunks, arch)
    merge_and_strip(chunks, arch)


def is_lora_run(ckpt: str | Path) -> bool:
    """Whether `ckpt` (a checkpoint, run or checkpoints directory) resolves to a LoRA checkpoint."""
    from megatron_kto.checkpointing.locate import resolve_pretrained_dir
    from megatron_kto.peft.checkpoint import is_lora_checkpoint

    return is_lora_checkpoint(resolve_pretrained_dir(ckpt))


def export_adapter(ckpt: str | Path, out_dir: str | Path) -> Path:
    """Write a LoRA run's adapters as `adapter_config.json` + `adapter_model.safetensors` into a
    new `out_dir`; `peft.PeftModel.from_pretrained(<the base as a HF model>, out_dir)` loads it.

    Returns:
        The checkpoint directory that was exported.

    Raises:
        CheckpointError: not a LoRA checkpoint, or its base cannot be rebuilt.
        ConversionError: `out_dir` exists and is not empty.
    """
    from megatron_kto.checkpointing.locate import resolve_pretrained_dir
    from megatron_kto.checkpointing.model_io import read_architecture
    from megatron_kto.conversion.convert import _finish, _prepare_out, _single_process_model
    from megatron_kto.peft.checkpoint import BASE_FILE, build_lora_model
    from megatron_kto.peft.hf_peft import write_adapter
    from megatron_kto.runtime import teardown

    ckpt_dir = resolve_pretrained_dir(ckpt)
    arch = read_architecture(ckpt_dir)
    out_dir = Path(out_dir)
    tmp = _prepare_out(out_dir)
    try:
        model = _single_process_model(arch)
        settings = build_lora_model(ckpt_dir, [model], arch)
        base = json.loads((ckpt_dir / BASE_FILE).read_text())["restore_from_path"]
        write_adapter(tmp, [model], settings, arch, base_model=str(base))
        _finish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        teardown()
    return ckpt_dir
