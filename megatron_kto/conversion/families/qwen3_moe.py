"""Qwen3-MoE: Qwen3 attention (Q/K norms) and an MoE MLP in every layer — softmax over all
experts, top-k, renormalised when `norm_topk_prob`; no shared expert.

Dense layers between MoE layers (`decoder_sparse_step` > 1 or `mlp_only_layers`) are refused:
the decoder is built from one layer spec.
"""

from __future__ import annotations

from typing import Any

from megatron_kto.conversion.families import mismatch
from megatron_kto.conversion.families.qwen3 import qwen3_attention, qwen3_config
from megatron_kto.conversion.hf_config import ConversionError, dense_architecture
from megatron_kto.conversion.mappings import Mapping, attention_mappings
from megatron_kto.conversion.moe import expert_mappings, routing_fields
from megatron_kto.conversion.registry import Family
from megatron_kto.models.architecture import GPTArchitecture


def layer_mappings(arch: GPTArchitecture, norms: dict[str, str]) -> tuple[Mapping, ...]:
    """Qwen3 attention, then the router (`mlp.gate`) and `mlp.experts.{e}.*_proj`."""
    return attention_mappings(arch) + expert_mappings(
        arch,
        norms,
        "mlp.gate.weight",
        "mlp.experts.{e}.gate_proj.weight",
        "mlp.experts.{e}.up_proj.weight",
        "mlp.experts.{e}.down_proj.weight",
    )


def _architecture(config: dict[str, Any], where: str) -> GPTArchitecture:
    step = config.get("decoder_sparse_step", 1)
    if step != 1 or config.get("mlp_only_layers"):
        raise ConversionError(
            f"{where}: decoder_sparse_step {step} / mlp_only_layers "
            f"{config.get('mlp_only_layers')}: only an MoE MLP in every layer is supported"
        )
    routing = routing_fields(
        config,
        where,
        "num_experts",
        bool(config.get("norm_topk_prob", False)),
        "moe_intermediate_size",
    )
    return dense_architecture(config, where, **qwen3_attention(config, where), **routing)


def _config(arch: GPTArchitecture, config: dict[str, Any]) -> dict[str, Any]:
    config = qwen3_config(arch, config)
    config.pop("num_local_experts", None)
    config.update(
        num_experts=arch.num_moe_experts,
        num_experts_per_tok=arch.moe_router_topk,
        moe_intermediate_size=arch.moe_ffn_hidden_size or arch.ffn_hidden_size,
        norm_topk_prob=not arch.moe_router_pre_softmax,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=arch.moe_aux_loss_coeff,
    )
    return config


FAMILIES = (
    Family(
        model_type="qwen3_moe",
        hf_architecture="Qwen3MoeForCausalLM",
        architecture_from_hf=_architecture,
        hf_config=_config,
        layer_mappings=layer_mappings,
        cannot_express=lambda arch: mismatch(arch, qkv_bias=False, qk_norm=True, moe=True),
    ),
)
