"""Qwen3-MoE: Qwen3 attention (Q/K norms) and an MoE MLP — softmax over all experts, top-k,
renormalised when `norm_topk_prob`; no shared expert.

Layers listed in `mlp_only_layers` or off the `decoder_sparse_step` grid have a dense SwiGLU MLP
of `intermediate_size` (`GPTArchitecture.moe_layer_freq`: megatron builds them as dense layers).
"""

from __future__ import annotations

from typing import Any

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.conversion.addressing import Mapping, attention_mappings, dense_mlp_mappings
from megatron_kto.conversion.families import Family, dense_architecture, mismatch
from megatron_kto.conversion.families.qwen3 import qwen3_attention, qwen3_config
from megatron_kto.conversion.moe import (
    expert_mappings,
    routing_fields,
    sparse_layer_fields,
    sparse_layers,
)


def layer_mappings(arch: GPTArchitecture, norms: dict[str, str]) -> tuple[Mapping, ...]:
    """Qwen3 attention, then the router (`mlp.gate`) and `mlp.experts.{e}.*_proj` — or, for a
    dense layer (`arch` without experts), the dense MLP `mlp.*_proj`."""
    if not arch.num_moe_experts:
        return attention_mappings(arch) + dense_mlp_mappings()
    return attention_mappings(arch) + routed_expert_mappings(arch, norms)


def routed_expert_mappings(arch: GPTArchitecture, norms: dict[str, str]) -> tuple[Mapping, ...]:
    """The pre-MLP norm, the router `mlp.gate` and `mlp.experts.{e}.{gate,up,down}_proj` (the
    Qwen-MoE names GLM-4.5 and DeepSeek-V3 share)."""
    return expert_mappings(
        arch,
        norms,
        "mlp.gate.weight",
        "mlp.experts.{e}.gate_proj.weight",
        "mlp.experts.{e}.up_proj.weight",
        "mlp.experts.{e}.down_proj.weight",
    )


def _architecture(config: dict[str, Any], where: str) -> GPTArchitecture:
    routing = routing_fields(
        config,
        where,
        "num_experts",
        bool(config.get("norm_topk_prob", False)),
        "moe_intermediate_size",
    )
    return dense_architecture(
        config,
        where,
        **qwen3_attention(config, where),
        **routing,
        moe_layer_freq=sparse_layers(config, where),
    )


def _config(arch: GPTArchitecture, config: dict[str, Any]) -> dict[str, Any]:
    config = qwen3_config(arch, config)
    config.pop("num_local_experts", None)
    config.update(
        num_experts=arch.num_moe_experts,
        num_experts_per_tok=arch.moe_router_topk,
        moe_intermediate_size=arch.moe_ffn_hidden_size or arch.ffn_hidden_size,
        norm_topk_prob=not arch.moe_router_pre_softmax,
        router_aux_loss_coef=arch.moe_aux_loss_coeff,
        **sparse_layer_fields(arch),
    )
    return config


FAMILIES = (
    Family(
        model_type="qwen3_moe",
        hf_architecture="Qwen3MoeForCausalLM",
        architecture_from_hf=_architecture,
        hf_config=_config,
        layer_mappings=layer_mappings,
        cannot_express=lambda arch: mismatch(
            arch, qkv_bias=False, qk_norm=True, moe=True, dense_layers=arch.has_dense_layers()
        ),
        windows="uniform",
    ),
)
