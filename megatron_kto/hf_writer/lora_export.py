"""`tools/convert_checkpoint.py export` of a LoRA run: a PEFT adapter directory, or merged weights.

A LoRA checkpoint holds adapters only; the base is the run's
`pretrained_checkpoint.restore_from_path` (checked against the fingerprint stored with the
adapters when it is rebuilt). Both exports run in one process. The adapter export reads only the
checkpoint's adapter tensors — no model is built and the base is not read, so it takes the
adapters' few MB whatever the base's size; `--merge-lora` builds the whole base at TP=1, as the
plain export does, in float32 — or in bfloat16 when both the run and the export are bf16 — so
the base checks against the fingerprint the run took of it (`checkpoint.build_lora_model`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from megatron_kto.config.architecture import GPTArchitecture


def export_merged(ckpt: str | Path, out_dir: str | Path, **export: Any) -> Path:
    """`hf_writer.convert.export_hf` of a LoRA run with its adapters merged into the weights.

    Args:
        ckpt, out_dir: as `export_hf` takes them.
        export: `export_hf`'s other keyword arguments (model_type, dtype, max_shard_bytes).

    Returns:
        The checkpoint directory that was exported.
    """
    from megatron_kto.checkpointing.locate import resolve_pretrained_dir
    from megatron_kto.hf_writer.convert import export_hf
    from megatron_kto.peft.checkpoint import run_config, run_param_dtype

    cfg = run_config(resolve_pretrained_dir(ckpt))
    # A bf16 model holds a float32 run's base rounded, which its fingerprint cannot match; a
    # bf16 run's base is bf16 already, so a bf16 export of it keeps the half-size model.
    bf16_run = cfg is not None and run_param_dtype(cfg) == torch.bfloat16
    return export_hf(ckpt, out_dir, load=merged_loader, half_model=bf16_run, **export)


def merged_loader(ckpt_dir: Path, chunks: list[torch.nn.Module], arch: GPTArchitecture) -> None:
    """`hf_writer.convert.export_hf`'s `load` for a LoRA run: base + adapters, merged, then a
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

    Only the checkpoint's trained adapter tensors are read (`checkpoint.read_trained_adapters`):
    no model is built and the base weights are neither read nor needed, so memory is the
    adapters' size whatever the base's. The tensors are written as fp32, the values the run holds.

    Returns:
        The checkpoint directory that was exported.

    Raises:
        CheckpointError: not a LoRA checkpoint, or its adapters do not match its run config.
        ConversionError: `out_dir` exists and is not empty.
    """
    from megatron_kto.checkpointing.errors import CheckpointError
    from megatron_kto.checkpointing.locate import resolve_pretrained_dir
    from megatron_kto.checkpointing.model_io import read_architecture
    from megatron_kto.hf_writer.convert import staged_output
    from megatron_kto.peft.checkpoint import (
        BASE_FILE,
        read_trained_adapters,
        run_config,
        trained_adapter_key,
    )
    from megatron_kto.peft.hf_peft import expected_keys, hf_key, write_adapter_files
    from megatron_kto.peft.settings import lora_settings
    from megatron_kto.runtime.distributed import init_runtime

    ckpt_dir = resolve_pretrained_dir(ckpt)
    cfg = run_config(ckpt_dir)
    if cfg is None or not is_lora_run(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir}: not a LoRA training checkpoint")
    arch = read_architecture(ckpt_dir)
    settings = lora_settings(cfg.model)
    base = json.loads((ckpt_dir / BASE_FILE).read_text())["restore_from_path"]
    out_dir = Path(out_dir)
    with staged_output(out_dir) as tmp:
        init_runtime(1, 1, seed=0)  # megatron-core's checkpoint reader needs a process group
        tensors = {
            hf_key(*trained_adapter_key(key)): tensor.float().contiguous()  # type: ignore[misc]
            for key, tensor in read_trained_adapters(ckpt_dir).items()
        }
        expected = expected_keys(settings, arch)
        if tensors.keys() != expected:
            missing, extra = sorted(expected - tensors.keys()), sorted(tensors.keys() - expected)
            raise CheckpointError(
                f"{ckpt_dir}: its adapters do not match its run's model.peft.lora_tuning "
                f"(missing {missing[:2]}, unexpected {extra[:2]})"
            )
        write_adapter_files(tmp, tensors, settings, arch, base_model=str(base) if base else None)
    return ckpt_dir
