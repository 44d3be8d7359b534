"""Qwen2-MoE (Qwen1.5-MoE): Qwen2 attention (q/k/v biases) and in every layer routed experts plus
a shared expert scaled by a sigmoid gate — megatron-core's `SharedExpertMLP` with
`moe_shared_expert_gate`. Routing as Qwen3-MoE: softmax over all experts, top-k, renormalised
when `norm_topk_prob`. Dense layers (`mlp_only_layers`, `decoder_sparse_step`) have a plain SwiGLU
MLP of `intermediate_size` and no shared expert, in `transformers` and in megatron alike."""

from __future__ import annotations

from typing import Any

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.conversion.addressing import Mapping
from megatron_kto.conversion.errors import ConversionError
from megatron_kto.conversion.families import Family, dense_architecture, mismatch
from megatron_kto.conversion.families.qwen3_moe import layer_mappings as routed_mappings
from megatron_kto.conversion.moe import (
    gated_shared_expert_config,
    routing_fields,
    shared_expert_mappings,
    sparse_layers,
)


def layer_mappings(arch: GPTArchitecture, norms: dict[str, str]) -> tuple[Mapping, ...]:
    """Qwen3-MoE's table (same names) plus `mlp.shared_expert.*` and `mlp.shared_expert_gate`;
    a dense layer (`arch` without experts) has the dense MLP only."""
    if not arch.num_moe_experts:
        return routed_mappings(arch, norms)
    return routed_mappings(arch, norms) + shared_expert_mappings(
        "mlp.shared_expert", "mlp.shared_expert_gate.weight"
    )


def _architecture(config: dict[str, Any], where: str) -> GPTArchitecture:
    shared = config.get("shared_expert_intermediate_size")
    if not isinstance(shared, int) or shared <= 0:
        raise ConversionError(
            f"{where}: shared_expert_intermediate_size: missing or not a positive integer"
        )
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
        add_qkv_bias=bool(config.get("qkv_bias", True)),
        moe_shared_expert_intermediate_size=shared,
        moe_shared_expert_gate=True,
        **routing,
        moe_layer_freq=sparse_layers(config, where),
    )


def _config(arch: GPTArchitecture, config: dict[str, Any]) -> dict[str, Any]:
    config.pop("num_local_experts", None)
    config.update(qkv_bias=arch.add_qkv_bias, **gated_shared_expert_config(arch))
    return config


FAMILIES = (
    Family(
        model_type="qwen2_moe",
        hf_architecture="Qwen2MoeForCausalLM",
        architecture_from_hf=_architecture,
        hf_config=_config,
        layer_mappings=layer_mappings,
        cannot_express=lambda arch: mismatch(
            arch,
            qkv_bias=arch.add_qkv_bias,
            moe=True,
            shared_expert=True,
            dense_layers=arch.has_dense_layers(),
        ),
        windows="per_layer",
    ),
)
