"""GPT-OSS (20B / 120B): biased q/k/v/o projections, a learned attention sink per head,
sliding-window (`layer_types`) and full layers, YaRN RoPE, and in every layer an MoE MLP — a
biased router (top-k of the logits, softmax over the k), experts with biases and the clamped
gated activation (gate ≤ limit, |up| ≤ limit, out = (up + 1) · gate · sigmoid(1.702 · gate)).

Hugging Face stacks a layer's experts in four tensors (`stacked.py`): `gate_up_proj` [E, h, 2f]
(gate and up interleaved), `gate_up_proj_bias` [E, 2f], `down_proj` [E, f, h], `down_proj_bias`
[E, h]; the table names expert e's slices (`name#e`), so loading reads only a rank's experts —
and dequantises only those from the published MXFP4 `*_blocks` / `*_scales`. Megatron holds them
as its biased expert MLPs (`add_bias_linear`: every linear, the router included, has a bias).
"""

from __future__ import annotations

from typing import Any

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.conversion.addressing import (
    COLUMN,
    TE_NORMS,
    Mapping,
    attention_mappings,
    expert_name,
)
from megatron_kto.conversion.errors import ConversionError
from megatron_kto.conversion.families import Family, dense_architecture, mismatch
from megatron_kto.conversion.moe import MOE_NORM, ROUTER, routing_fields
from megatron_kto.conversion.stacked import expert_slice

#: megatron-core's `quick_gelu` is x · sigmoid(1.702 x): the only `swiglu_alpha` it computes.
ALPHA = 1.702
EXPERTS = "mlp.experts."
_YARN_KEYS = ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings")


def layer_mappings(arch: GPTArchitecture, norms: dict[str, str]) -> tuple[Mapping, ...]:
    """Attention (fused q/k/v with bias, o with bias, sinks), router (weight, bias) and each
    expert's fc1 / fc2 weight and bias, from slices of the stacked Hugging Face tensors."""
    grouped = norms is TE_NORMS
    entries = [
        *attention_mappings(arch),
        Mapping("self_attention.linear_proj.bias", ("self_attn.o_proj.bias",)),
        Mapping(
            "self_attention.core_attention.softmax_offset", ("self_attn.sinks",), tp_axis=COLUMN
        ),
        Mapping(MOE_NORM, ("post_attention_layernorm.weight",)),
        Mapping(ROUTER, ("mlp.router.weight",)),
        Mapping("mlp.router.bias", ("mlp.router.bias",)),
    ]
    stacked = (
        ("linear_fc1.weight", "gate_up_proj", "interleaved_gated_t", COLUMN),
        ("linear_fc1.bias", "gate_up_proj_bias", "interleaved_gated", COLUMN),
        ("linear_fc2.weight", "down_proj", "transposed", 1),
        ("linear_fc2.bias", "down_proj_bias", "direct", None),
    )
    for e in range(arch.num_moe_experts or 0):
        for param, hf, kind, axis in stacked:
            entries.append(
                Mapping(
                    expert_name(e, param, grouped),
                    (expert_slice(EXPERTS + hf, e),),
                    kind,  # type: ignore[arg-type]
                    axis,
                    expert=True,
                )
            )
    return tuple(entries)


def _rope(config: dict[str, Any], where: str) -> tuple[dict[str, Any], float]:
    """YaRN fields of a config.json (either spelling) and its RoPE theta."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(config.get("rope_theta", params.get("rope_theta", 150000.0)))
    kind = params.get("rope_type", params.get("type"))
    if kind != "yarn" or any(k not in params for k in _YARN_KEYS):
        raise ConversionError(
            f"{where}: rope_parameters {params}: GPT-OSS needs rope_type yarn with {_YARN_KEYS}"
        )
    if params.get("truncate", True) or params.get("mscale") or params.get("mscale_all_dim"):
        raise ConversionError(
            f"{where}: rope_parameters {params}: only YaRN with truncate false and no "
            "mscale / mscale_all_dim is supported"
        )
    fields = {
        "position_embedding_type": "yarn",
        "rope_scaling_factor": float(params["factor"]),
        "yarn_beta_fast": float(params["beta_fast"]),
        "yarn_beta_slow": float(params["beta_slow"]),
        "yarn_original_max_position_embeddings": int(params["original_max_position_embeddings"]),
    }
    return fields, theta


def _architecture(config: dict[str, Any], where: str) -> GPTArchitecture:
    if float(config.get("swiglu_alpha", ALPHA)) != ALPHA:
        raise ConversionError(
            f"{where}: swiglu_alpha {config['swiglu_alpha']}: only {ALPHA} is supported"
        )
    if not config.get("attention_bias", True):
        raise ConversionError(f"{where}: attention_bias false: GPT-OSS projections have biases")
    yarn, theta = _rope(config, where)
    plain = {
        k: v
        for k, v in config.items()
        if k not in ("rope_parameters", "rope_scaling", "hidden_act")
    }
    plain["rope_theta"] = theta
    routing = routing_fields(config, where, "num_local_experts", True, "intermediate_size")
    limit = config.get("swiglu_limit", 7.0)
    return dense_architecture(
        plain,
        where,
        **yarn,
        **routing,
        rotary_base=int(theta) if theta.is_integer() else theta,
        add_bias_linear=True,
        add_qkv_bias=True,
        attention_sinks=True,
        activation="quick_geglu",
        glu_linear_offset=1.0,
        activation_clamp=float(limit) if limit is not None else None,
    )


def _config(arch: GPTArchitecture, config: dict[str, Any]) -> dict[str, Any]:
    for key in ("hidden_act", "rope_scaling", "num_experts", "moe_intermediate_size"):
        config.pop(key, None)
    config.update(
        intermediate_size=arch.moe_ffn_hidden_size or arch.ffn_hidden_size,
        num_local_experts=arch.num_moe_experts,
        num_experts_per_tok=arch.moe_router_topk,
        router_aux_loss_coef=arch.moe_aux_loss_coeff,
        attention_bias=True,
        swiglu_alpha=ALPHA,
        swiglu_limit=arch.activation_clamp,
        rope_scaling={
            "rope_type": "yarn",
            "factor": arch.rope_scaling_factor,
            "beta_fast": arch.yarn_beta_fast,
            "beta_slow": arch.yarn_beta_slow,
            "truncate": False,
            "original_max_position_embeddings": arch.yarn_original_max_position_embeddings,
        },
    )
    return config


def _cannot_express(arch: GPTArchitecture) -> str | None:
    if (
        arch.position_embedding_type != "yarn"
        or arch.activation != "quick_geglu"
        or arch.glu_linear_offset != 1.0
        or not arch.add_bias_linear
        or arch.moe_router_pre_softmax
    ):
        return "the model is not GPT-OSS-shaped (YaRN, clamped gated experts with biases)"
    return mismatch(arch, qkv_bias=True, moe=True, sinks=True)


FAMILIES = (
    Family(
        model_type="gpt_oss",
        hf_architecture="GptOssForCausalLM",
        architecture_from_hf=_architecture,
        hf_config=_config,
        layer_mappings=layer_mappings,
        cannot_express=_cannot_express,
        windows="per_layer",
    ),
)
