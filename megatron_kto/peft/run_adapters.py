"""LoRA on a run's model: adapters applied (and a starting adapter loaded) from the config, the
reference's words for the start-up log, and the base record its adapter-only checkpoints keep."""

from __future__ import annotations

from typing import Any

import torch

from megatron_kto.config.errors import ConfigError
from megatron_kto.data.pipeline import resolve_path
from megatron_kto.peft import hf_peft
from megatron_kto.peft.checkpoint import base_fingerprint, base_record
from megatron_kto.peft.settings import lora_settings, reference_includes_starting_adapter, uses_lora
from megatron_kto.peft.wiring import apply_lora, freeze_starting_adapter_copy


def add_adapters(
    cfg: Any, arch: Any, chunks: list[torch.nn.Module], rank0: bool, has_reference: bool
) -> None:
    """LoRA adapters on the chunks (base frozen), starting from `model.peft.restore_from_path`
    (a Hugging Face PEFT adapter directory) when given; `has_reference`: False for a
    reference-free objective (no frozen copy of the starting adapter is kept)."""
    settings = lora_settings(cfg.model)
    try:
        apply_lora(chunks, arch, settings)
    except ValueError as e:
        raise ConfigError(f"model.peft.lora_tuning: {e}") from e
    path = cfg.model.peft.restore_from_path
    if path:
        where = f"model.peft.restore_from_path={path}"
        try:
            config, tensors = hf_peft.read_adapter(resolve_path(path))
            hf_peft.check_matches(config, settings, arch, where)
            hf_peft.load_adapter(chunks, tensors, hf_peft.expected_keys(settings, arch), where)
        except (ValueError, OSError) as e:
            raise ConfigError(str(e) if where in str(e) else f"{where}: {e}") from e
        if rank0:
            print(f"LoRA: starting adapter loaded from {path}", flush=True)
    if has_reference and reference_includes_starting_adapter(cfg.model):
        # KTO/DPO's reference is the starting policy: keep the starting adapter, frozen.
        freeze_starting_adapter_copy(chunks)


def reference_words(model_cfg: Any, has_reference: bool = True) -> str:
    """What a LoRA run's reference policy is, for the start-up log."""
    if not has_reference:
        return "none (reference-free loss type)"
    if reference_includes_starting_adapter(model_cfg):
        return "the base model + a frozen copy of the starting adapter"
    return "the base model (adapters off)"


def base_record_of_run(cfg: Any, chunks: list[torch.nn.Module]) -> dict[str, Any] | None:
    """A LoRA run's base record for its (adapter-only) checkpoints; None without LoRA."""
    if not uses_lora(cfg.model):
        return None
    return base_record(cfg.pretrained_checkpoint.restore_from_path, base_fingerprint(chunks))
