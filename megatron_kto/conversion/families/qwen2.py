"""Qwen2 / Qwen2.5: the Llama layout with biases on the q, k and v projections."""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.conversion.families import Family, dense_architecture, mismatch
from megatron_kto.conversion.families.llama import layer_mappings


def _architecture(config: dict[str, Any], where: str) -> GPTArchitecture:
    return dataclasses.replace(dense_architecture(config, where), add_qkv_bias=True)


FAMILIES = (
    Family(
        model_type="qwen2",
        hf_architecture="Qwen2ForCausalLM",
        architecture_from_hf=_architecture,
        hf_config=lambda arch, config: config,
        layer_mappings=layer_mappings,
        cannot_express=lambda arch: mismatch(arch, qkv_bias=True, qk_norm=False, moe=False),
        windows="per_layer",
    ),
)
