"""DeepSeek-V3 / R1, Kimi-K2, Moonlight (`deepseek_v3`): multi-latent attention (`models/mla.py`)
and GLM-4.5's MoE — sigmoid routing with the expert-score correction bias, group-limited
routing, routed scaling, an ungated shared expert, the first `first_k_dense_replace` layers
dense (`glm4_moe.sigmoid_moe_fields`, with its refusals of configs megatron-core would route
differently).

Attention tensors, each megatron-core's MLA linear as stored (per head: the nope dims, then the
rope dims of a query/key, then for `kv_b_proj` the value dims; column-parallel, so a TP rank
holds whole heads — or, for the down projections, a slice of the rows megatron gathers):
`q_proj` (no `q_lora_rank`) or `q_a_proj` / `q_a_layernorm` / `q_b_proj`, `kv_a_proj_with_mqa`,
`kv_a_layernorm`, `kv_b_proj`, `o_proj` (row-parallel).

Refused in one line naming the key: `rope_interleave: false` (the rotated dims stored in halves:
megatron's MLA RoPE reads them interleaved), `attention_bias` (biased MLA projections),
`num_key_value_heads` other than the heads, YaRN with `truncate: false`, an explicit
`attention_factor`, or `mscale_all_dim` without `mscale`. Multi-token-prediction layers
(`num_nextn_predict_layers`) are skipped on load (`hf_dir.skipped_hf_tensors`) and not written.
"""

from __future__ import annotations

from typing import Any

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.conversion.addressing import (
    COLUMN,
    PROJ_WEIGHT,
    Mapping,
    dense_mlp_mappings,
)
from megatron_kto.conversion.errors import ConversionError
from megatron_kto.conversion.families import Family, dense_architecture, mismatch
from megatron_kto.conversion.families.glm4_moe import (
    sigmoid_moe_config,
    sigmoid_moe_fields,
    sigmoid_moe_mismatch,
)
from megatron_kto.conversion.families.qwen3_moe import routed_expert_mappings
from megatron_kto.conversion.moe import shared_expert_mappings

_ATTN = "self_attention."
_YARN_KEYS = ("factor", "original_max_position_embeddings")


def _linear(megatron: str, hf: str) -> Mapping:
    return Mapping(f"{_ATTN}{megatron}.weight", (f"self_attn.{hf}.weight",), tp_axis=COLUMN)


def mla_mappings(arch: GPTArchitecture) -> tuple[Mapping, ...]:
    """Pre-attention norm, the MLA projections and latent norms, and the output projection."""
    return mla_attention_mappings(q_lora=arch.q_lora_rank is not None)


def mla_attention_mappings(q_lora: bool) -> tuple[Mapping, ...]:
    """`mla_mappings` of a model with (`q_lora`) or without a query bottleneck."""
    if not q_lora:
        query = (_linear("linear_q_proj", "q_proj"),)
    else:
        query = (
            _linear("linear_q_down_proj", "q_a_proj"),
            Mapping(f"{_ATTN}q_layernorm.weight", ("self_attn.q_a_layernorm.weight",)),
            _linear("linear_q_up_proj", "q_b_proj"),
        )
    return (
        Mapping("{attn_norm}", ("input_layernorm.weight",)),
        *query,
        _linear("linear_kv_down_proj", "kv_a_proj_with_mqa"),
        Mapping(f"{_ATTN}kv_layernorm.weight", ("self_attn.kv_a_layernorm.weight",)),
        _linear("linear_kv_up_proj", "kv_b_proj"),
        PROJ_WEIGHT,
    )


def layer_mappings(arch: GPTArchitecture, norms: dict[str, str]) -> tuple[Mapping, ...]:
    """MLA, then a dense MLP (`arch` without experts) or the router, its expert bias, the routed
    experts and the ungated shared expert."""
    if not arch.num_moe_experts:
        return mla_mappings(arch) + dense_mlp_mappings()
    experts = routed_expert_mappings(arch, norms)
    bias = Mapping("mlp.router.expert_bias", ("mlp.gate.e_score_correction_bias",))
    return (
        mla_mappings(arch) + experts + (bias,) + shared_expert_mappings("mlp.shared_experts", None)
    )


def _size(config: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or value < 1:
        raise ConversionError(f"{where}: {key}: {value!r} is not a positive integer")
    return value


def _rope(config: dict[str, Any], where: str) -> dict[str, Any]:
    """RoPE / YaRN fields of a config.json (either spelling)."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(config.get("rope_theta", params.get("rope_theta", 10000.0)))
    fields: dict[str, Any] = {
        "rotary_base": int(theta) if theta.is_integer() else theta,
        "position_embedding_type": "rope",
    }
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return fields
    if kind != "yarn" or "original_max_position_embeddings" not in params:
        raise ConversionError(
            f"{where}: rope_parameters {params}: only default RoPE or rope_type yarn with "
            "original_max_position_embeddings is supported"
        )
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    unsupported = {
        "truncate false (megatron-core rounds the correction range)": not params.get(
            "truncate", True
        ),
        "an explicit attention_factor": params.get("attention_factor") is not None,
        "mscale_all_dim without mscale": bool(all_dim) and not mscale,
    }
    bad = [what for what, on in unsupported.items() if on]
    if bad:
        raise ConversionError(f"{where}: rope_parameters: YaRN with {', '.join(bad)}")
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor") or config.get("max_position_embeddings", original) / original
    return dict(
        fields,
        position_embedding_type="yarn",
        rope_scaling_factor=float(factor),
        yarn_original_max_position_embeddings=original,
        yarn_beta_fast=float(params.get("beta_fast") or 32.0),
        yarn_beta_slow=float(params.get("beta_slow") or 1.0),
        # Without mscale_all_dim transformers' attention factor is mscale(factor): megatron's
        # with mscale 1 (its default) and mscale_all_dim 0.
        yarn_mscale=float(mscale) if mscale and all_dim else None,
        yarn_mscale_all_dim=float(all_dim) if all_dim else None,
    )


def _architecture(config: dict[str, Any], where: str) -> GPTArchitecture:
    if config.get("rope_interleave", True) is False:
        raise ConversionError(
            f"{where}: rope_interleave false: only interleaved rotary dims (DeepSeek's "
            "checkpoints) are supported"
        )
    if config.get("attention_bias"):
        raise ConversionError(f"{where}: attention_bias: biased MLA projections are not supported")
    heads = _size(config, "num_attention_heads", where)
    kv_heads = config.get("num_key_value_heads") or heads
    if kv_heads != heads:
        raise ConversionError(
            f"{where}: num_key_value_heads {kv_heads}: multi-latent attention has one key/value "
            f"head per query head ({heads})"
        )
    q_lora = config.get("q_lora_rank")
    nope = _size(config, "qk_nope_head_dim", where, 128)
    rope = _size(config, "qk_rope_head_dim", where, 64)
    if rope % 2:
        raise ConversionError(f"{where}: qk_rope_head_dim {rope}: must be even")
    plain = {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling")}
    return dense_architecture(
        plain,
        where,
        **_rope(config, where),
        multi_latent_attention=True,
        q_lora_rank=None if q_lora is None else _size(config, "q_lora_rank", where),
        kv_lora_rank=_size(config, "kv_lora_rank", where, 512),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=_size(config, "v_head_dim", where, 128),
        kv_channels=nope + rope,
        num_query_groups=heads,
        **sigmoid_moe_fields(config, where, dense_default=3),
    )


def _config(arch: GPTArchitecture, config: dict[str, Any]) -> dict[str, Any]:
    for key in ("num_local_experts", "num_experts", "num_mtp_layers", "rope_parameters"):
        config.pop(key, None)
    config.update(
        attention_bias=False,
        rope_interleave=True,
        q_lora_rank=arch.q_lora_rank,
        kv_lora_rank=arch.kv_lora_rank,
        qk_nope_head_dim=arch.qk_nope_head_dim,
        qk_rope_head_dim=arch.qk_rope_head_dim,
        v_head_dim=arch.v_head_dim,
        head_dim=arch.qk_rope_head_dim,  # transformers' DeepseekV3Config sets it so
        **sigmoid_moe_config(arch),
    )
    if arch.position_embedding_type == "yarn":
        config["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": arch.rope_scaling_factor,
            "original_max_position_embeddings": arch.yarn_original_max_position_embeddings,
            "beta_fast": arch.yarn_beta_fast,
            "beta_slow": arch.yarn_beta_slow,
            **({"mscale": arch.yarn_mscale} if arch.yarn_mscale is not None else {}),
            **(
                {"mscale_all_dim": arch.yarn_mscale_all_dim}
                if arch.yarn_mscale_all_dim is not None
                else {}
            ),
        }
    return config


def _cannot_express(arch: GPTArchitecture) -> str | None:
    why = mismatch(
        arch,
        moe=True,
        ungated_shared_expert=True,
        dense_layers=arch.has_dense_layers(),
        sigmoid_router=True,
        mla=True,
    )
    if why:
        return why
    if arch.position_embedding_type not in ("rope", "yarn") or arch.rope_scaling:
        return "the model's RoPE is neither plain nor YaRN"
    return sigmoid_moe_mismatch(arch)


FAMILIES = (
    Family(
        model_type="deepseek_v3",
        hf_architecture="DeepseekV3ForCausalLM",
        architecture_from_hf=_architecture,
        hf_config=_config,
        layer_mappings=layer_mappings,
        cannot_express=_cannot_express,
    ),
)
