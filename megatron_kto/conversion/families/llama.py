"""Llama / Llama-3.x and Mistral: dense SwiGLU decoders, GQA, no biases, optional Llama-3 RoPE
scaling. Mistral's sliding window (`sliding_window`, every layer) is applied; Llama has none."""

from __future__ import annotations

from typing import Any

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.conversion.addressing import Mapping, attention_mappings, dense_mlp_mappings
from megatron_kto.conversion.errors import ConversionError
from megatron_kto.conversion.families import Family, dense_architecture, mismatch


def layer_mappings(arch: GPTArchitecture, norms: dict[str, str]) -> tuple[Mapping, ...]:
    """Attention and dense MLP, Hugging Face's Llama names."""
    return attention_mappings(arch) + dense_mlp_mappings()


def _llama_architecture(config: dict[str, Any], where: str) -> GPTArchitecture:
    if config.get("attention_bias"):
        raise ConversionError(
            f"{where}: attention_bias: Llama output-projection biases are not supported"
        )
    return dense_architecture(config, where)


def _llama_config(arch: GPTArchitecture, config: dict[str, Any]) -> dict[str, Any]:
    config.setdefault("attention_bias", False)
    config.setdefault("mlp_bias", False)
    return config


def _dense(arch: GPTArchitecture) -> str | None:
    return mismatch(arch, qkv_bias=False, qk_norm=False, moe=False)


FAMILIES = (
    Family(
        model_type="llama",
        hf_architecture="LlamaForCausalLM",
        architecture_from_hf=_llama_architecture,
        hf_config=_llama_config,
        layer_mappings=layer_mappings,
        cannot_express=_dense,
    ),
    Family(
        model_type="mistral",
        hf_architecture="MistralForCausalLM",
        architecture_from_hf=dense_architecture,
        hf_config=lambda arch, config: config,
        layer_mappings=layer_mappings,
        cannot_express=_dense,
        windows="uniform",
    ),
)
