"""Mixtral: the Mistral layout with an MoE MLP in every layer (`block_sparse_moe`: router `gate`,
experts `w1` gate, `w3` up, `w2` down) — softmax over all experts, top-k, renormalised."""

from __future__ import annotations

from typing import Any

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.conversion.addressing import Mapping, attention_mappings
from megatron_kto.conversion.errors import ConversionError
from megatron_kto.conversion.families import Family, dense_architecture, mismatch
from megatron_kto.conversion.moe import expert_mappings, routing_fields


def layer_mappings(arch: GPTArchitecture, norms: dict[str, str]) -> tuple[Mapping, ...]:
    """Mistral attention, then `block_sparse_moe.gate` and `block_sparse_moe.experts.{e}.w1/w3/w2`."""
    prefix = "block_sparse_moe.experts.{e}"
    return attention_mappings(arch) + expert_mappings(
        arch,
        norms,
        "block_sparse_moe.gate.weight",
        f"{prefix}.w1.weight",
        f"{prefix}.w3.weight",
        f"{prefix}.w2.weight",
    )


def _architecture(config: dict[str, Any], where: str) -> GPTArchitecture:
    if config.get("router_jitter_noise"):
        raise ConversionError(
            f"{where}: router_jitter_noise {config['router_jitter_noise']}: router noise is not "
            "supported (set it to 0.0)"
        )
    routing = routing_fields(config, where, "num_local_experts", True, "intermediate_size")
    return dense_architecture(config, where, **routing)


def _config(arch: GPTArchitecture, config: dict[str, Any]) -> dict[str, Any]:
    config.update(
        num_local_experts=arch.num_moe_experts,
        num_experts_per_tok=arch.moe_router_topk,
        intermediate_size=arch.moe_ffn_hidden_size or arch.ffn_hidden_size,
        router_aux_loss_coef=arch.moe_aux_loss_coeff,
        router_jitter_noise=0.0,
    )
    return config


def _cannot_express(arch: GPTArchitecture) -> str | None:
    if arch.moe_router_pre_softmax:
        return "the router does not renormalise its top-k weights (Mixtral does)"
    return mismatch(arch, qkv_bias=False, qk_norm=False, moe=True)


FAMILIES = (
    Family(
        model_type="mixtral",
        hf_architecture="MixtralForCausalLM",
        architecture_from_hf=_architecture,
        hf_config=_config,
        layer_mappings=layer_mappings,
        cannot_express=_cannot_express,
        windows="uniform",
    ),
)
