"""Qwen3.5 text models (`qwen3_5_text` dense, `qwen3_5_moe_text` MoE): Qwen3-Next's hybrid of
gated DeltaNet and gated full attention (`families/qwen3_next.py`), with the DeltaNet input
projections kept apart — `in_proj_qkv` [q | k | v of all heads], `in_proj_z`, `in_proj_b`,
`in_proj_a` — and either a dense SwiGLU MLP in every layer or, for the MoE model, routed experts
(softmax, top-k, renormalised) plus a gated shared expert in every layer.

Their RoPE is multimodal (`mrope_section`), which on text (the same position on every axis) is
plain RoPE over the `partial_rotary_factor` share of each head. The `qwen3_5` / `qwen3_5_moe`
vision-language checkpoints are read as these text models: `hf_dir.language_config` takes their
`text_config`, `safetensors_io.HFWeights` lists `model.language_model.*` under the text names
and hides the vision tower.
"""

from __future__ import annotations

from typing import Any

from megatron_kto.config.architecture import IN_PROJ_NAMES, GPTArchitecture
from megatron_kto.conversion.addressing import Mapping, dense_mlp_mappings
from megatron_kto.conversion.errors import ConversionError
from megatron_kto.conversion.families import Family, dense_architecture, mismatch
from megatron_kto.conversion.families.qwen3_next import (
    deltanet_mappings,
    gated_attention_mappings,
    hybrid_config,
    hybrid_fields,
    mlp_mappings,
)
from megatron_kto.conversion.moe import routing_fields

#: Qwen3.5 keeps the DeltaNet input projections apart (`GPTArchitecture.linear_in_proj`).
SPLIT = "qkv_z_b_a"


def _attention(arch: GPTArchitecture) -> tuple[Mapping, ...]:
    if arch.has_linear_attention():
        return deltanet_mappings(IN_PROJ_NAMES[SPLIT])
    return gated_attention_mappings()


def _dense_layer(arch: GPTArchitecture, norms: dict[str, str]) -> tuple[Mapping, ...]:
    return _attention(arch) + dense_mlp_mappings()


def _moe_layer(arch: GPTArchitecture, norms: dict[str, str]) -> tuple[Mapping, ...]:
    return _attention(arch) + mlp_mappings(arch, norms)


def _dense_architecture(config: dict[str, Any], where: str) -> GPTArchitecture:
    return dense_architecture(config, where, **hybrid_fields(config, where), linear_in_proj=SPLIT)


def _moe_architecture(config: dict[str, Any], where: str) -> GPTArchitecture:
    shared = config.get("shared_expert_intermediate_size")
    if not isinstance(shared, int) or shared <= 0:
        raise ConversionError(
            f"{where}: shared_expert_intermediate_size: missing or not a positive integer"
        )
    # Qwen3.5-MoE has no dense MLP: intermediate_size is not needed, default it for the shape.
    config = {"intermediate_size": config.get("moe_intermediate_size"), **config}
    return dense_architecture(
        config,
        where,
        **hybrid_fields(config, where),
        linear_in_proj=SPLIT,
        **routing_fields(config, where, "num_experts", True, "moe_intermediate_size"),
        moe_shared_expert_intermediate_size=shared,
        moe_shared_expert_gate=True,
    )


def _moe_config(arch: GPTArchitecture, config: dict[str, Any]) -> dict[str, Any]:
    config = hybrid_config(arch, config)
    config.pop("intermediate_size", None)
    config.update(
        num_experts=arch.num_moe_experts,
        num_experts_per_tok=arch.moe_router_topk,
        moe_intermediate_size=arch.moe_ffn_hidden_size or arch.ffn_hidden_size,
        shared_expert_intermediate_size=arch.moe_shared_expert_intermediate_size,
        router_aux_loss_coef=arch.moe_aux_loss_coeff,
    )
    return config


def _cannot_express(moe: bool):
    def check(arch: GPTArchitecture) -> str | None:
        if moe and arch.moe_router_pre_softmax:
            return "the model's router does not renormalise its top-k weights"
        return mismatch(
            arch,
            qk_norm=True,
            moe=moe,
            shared_expert=moe,
            linear_attention=True,
            output_gate=True,
            offset_norms=True,
            partial_rotary=arch.rotary_percent != 1.0,
        )

    return check


FAMILIES = (
    Family(
        model_type="qwen3_5_text",
        hf_architecture="Qwen3_5ForCausalLM",
        architecture_from_hf=_dense_architecture,
        hf_config=hybrid_config,
        layer_mappings=_dense_layer,
        cannot_express=_cannot_express(moe=False),
    ),
    Family(
        model_type="qwen3_5_moe_text",
        hf_architecture="Qwen3_5MoeForCausalLM",
        architecture_from_hf=_moe_architecture,
        hf_config=_moe_config,
        layer_mappings=_moe_layer,
        cannot_express=_cannot_express(moe=True),
    ),
)
