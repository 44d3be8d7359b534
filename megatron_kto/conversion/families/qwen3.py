"""Qwen3 dense: the Llama layout plus a per-head RMSNorm of queries and keys (megatron-core's
`qk_layernorm`) and a head dim that need not be hidden / heads; no biases."""

from __future__ import annotations

from typing import Any

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.conversion.errors import ConversionError
from megatron_kto.conversion.families import Family, dense_architecture, mismatch
from megatron_kto.conversion.families.llama import layer_mappings


def qwen3_attention(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The attention fields Qwen3 and Qwen3-MoE share: Q/K norms, no biases."""
    if config.get("attention_bias"):
        raise ConversionError(
            f"{where}: attention_bias: Qwen3 attention biases (q/k/v/o) are not supported"
        )
    return {"qk_layernorm": True}


def qwen3_config(arch: GPTArchitecture, config: dict[str, Any]) -> dict[str, Any]:
    """config.json fields of Qwen3 attention."""
    config.setdefault("attention_bias", False)
    config.setdefault("use_sliding_window", False)
    return config


FAMILIES = (
    Family(
        model_type="qwen3",
        hf_architecture="Qwen3ForCausalLM",
        architecture_from_hf=lambda config, where: dense_architecture(
            config, where, **qwen3_attention(config, where)
        ),
        hf_config=qwen3_config,
        layer_mappings=layer_mappings,
        cannot_express=lambda arch: mismatch(arch, qkv_bias=False, qk_norm=True, moe=False),
        windows="per_layer",
    ),
)
