"""Qwen3-Next: a hybrid of gated DeltaNet layers and gated full attention, MoE MLPs with a gated
shared expert (dense MLPs in `mlp_only_layers` / off the `decoder_sparse_step` grid, or
everywhere when `num_experts` is 0).

* Layer kinds from `layer_types` (or `full_attention_interval`: every n-th layer full attention)
  -> `GPTArchitecture.linear_attention_freq` (1 DeltaNet, 0 full attention).
* DeltaNet (`linear_attn.*`): `in_proj_qkvz` + `in_proj_ba` (grouped per key head) -> megatron's
  `in_proj` ([q | k | v | z | beta | alpha]), `conv1d`, `A_log`, `dt_bias`, `norm` (plain
  weight), `out_proj` (`conversion/deltanet.py`).
* Full attention (`self_attn.*`): `q_proj` holds a query and an output gate per head ->
  megatron's `linear_qkv` with `attention_output_gate`; Q/K norms; partial RoPE
  (`partial_rotary_factor` -> `rotary_percent`).
* Every RMSNorm except DeltaNet's output norm scales by (1 + weight): stored as is, computed by
  `models.norms.LocalNorm` (`zero_centered_norms`).
* MTP (multi-token prediction) layers, `mtp.*` tensors of the released checkpoints, are not
  used by training here: import skips them (with a note) and export writes none.
"""

from __future__ import annotations

import logging
from typing import Any

from megatron_kto.config.architecture import IN_PROJ_NAMES, GPTArchitecture
from megatron_kto.conversion.addressing import COLUMN, PROJ_WEIGHT, ROW, Mapping
from megatron_kto.conversion.errors import ConversionError
from megatron_kto.conversion.families import Family, dense_architecture, mismatch
from megatron_kto.conversion.families.qwen2_moe import layer_mappings as qwen2_moe_mappings
from megatron_kto.conversion.moe import gated_shared_expert_config, routing_fields, sparse_layers

logger = logging.getLogger(__name__)

LAYER_KINDS = {"linear_attention": 1, "full_attention": 0}


def deltanet_mappings(hf_in_proj: tuple[str, ...]) -> tuple[Mapping, ...]:
    """A DeltaNet layer's attention half: input norm and `linear_attn.*` (`hf_in_proj`: the
    input projections' names in the family's order, see `deltanet.hybrid_fuse`)."""
    prefix = "linear_attn."
    return (
        Mapping("{attn_norm}", ("input_layernorm.weight",)),
        Mapping(
            "self_attention.in_proj.weight",
            tuple(f"{prefix}{n}.weight" for n in hf_in_proj),
            "deltanet_in_proj",
            COLUMN,
        ),
        Mapping(
            "self_attention.conv1d.weight", (f"{prefix}conv1d.weight",), "deltanet_conv", COLUMN
        ),
        Mapping("self_attention.A_log", (f"{prefix}A_log",), tp_axis=COLUMN),
        Mapping("self_attention.dt_bias", (f"{prefix}dt_bias",), tp_axis=COLUMN),
        Mapping("self_attention.out_norm.weight", (f"{prefix}norm.weight",)),
        Mapping("self_attention.out_proj.weight", (f"{prefix}out_proj.weight",), tp_axis=ROW),
    )


def gated_attention_mappings() -> tuple[Mapping, ...]:
    """A full-attention layer's attention half: input norm, gated QKV, Q/K norms, output."""
    qkv = tuple(f"self_attn.{p}_proj.weight" for p in "qkv")
    return (
        Mapping("{attn_norm}", ("input_layernorm.weight",)),
        Mapping("self_attention.linear_qkv.weight", qkv, "gated_qkv", COLUMN),
        Mapping("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",)),
        Mapping("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",)),
        PROJ_WEIGHT,
    )


def mlp_mappings(arch: GPTArchitecture, norms: dict[str, str]) -> tuple[Mapping, ...]:
    """The MLP half: Qwen2-MoE's names (router, experts, gated shared expert) or a dense MLP."""
    return tuple(
        e
        for e in qwen2_moe_mappings(arch, norms)
        if not (e.megatron.startswith("self_attention.") or e.megatron == "{attn_norm}")
    )


def layer_mappings(arch: GPTArchitecture, norms: dict[str, str]) -> tuple[Mapping, ...]:
    """One layer (`arch` is the layer's own, `GPTArchitecture.layer_architecture`)."""
    attention = (
        deltanet_mappings(IN_PROJ_NAMES["qkvz_ba"])
        if arch.has_linear_attention()
        else gated_attention_mappings()
    )
    return attention + mlp_mappings(arch, norms)


def layer_pattern(config: dict[str, Any], where: str) -> list[int]:
    """`linear_attention_freq` of a config.json (`layer_types`, else `full_attention_interval`)."""
    layers = config["num_hidden_layers"]
    types = config.get("layer_types")
    if types is None:
        every = config.get("full_attention_interval", 4)
        types = [
            "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)
        ]
    if len(types) != layers or any(t not in LAYER_KINDS for t in types):
        raise ConversionError(
            f"{where}: layer_types: {types!r} is not {layers} of {sorted(LAYER_KINDS)}"
        )
    return [LAYER_KINDS[t] for t in types]


def hybrid_fields(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The `GPTArchitecture` fields of Qwen3-Next / Qwen3.5 attention (both layer kinds)."""
    if config.get("attention_bias"):
        raise ConversionError(f"{where}: attention_bias: gated attention biases are not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise ConversionError(
            f"{where}: hidden_act {config['hidden_act']!r}: only silu is supported"
        )
    fields: dict[str, Any] = {}
    for key, default in (
        ("linear_conv_kernel_dim", 4),
        ("linear_key_head_dim", 128),
        ("linear_value_head_dim", 128),
        ("linear_num_key_heads", 16),
        ("linear_num_value_heads", 32),
    ):
        value = config.get(key, default)
        if not isinstance(value, int) or value <= 0:
            raise ConversionError(f"{where}: {key}: {value!r} is not a positive integer")
        fields[key] = value
    if fields["linear_num_value_heads"] % fields["linear_num_key_heads"]:
        raise ConversionError(
            f"{where}: linear_num_value_heads {fields['linear_num_value_heads']} is not a "
            f"multiple of linear_num_key_heads {fields['linear_num_key_heads']}"
        )
    rope = config.get("rope_parameters") or {}
    partial = config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))
    if config.get("mtp_num_hidden_layers") or config.get("num_nextn_predict_layers"):
        logger.warning("%s: multi-token-prediction (mtp.*) layers are skipped", where)
    return dict(
        fields,
        linear_attention_freq=layer_pattern(config, where),
        qk_layernorm=True,
        attention_output_gate=True,
        zero_centered_norms=True,
        rotary_percent=float(partial),
        kv_channels=config.get("head_dim") or 256,
    )


def hybrid_config(arch: GPTArchitecture, config: dict[str, Any]) -> dict[str, Any]:
    """config.json fields of Qwen3-Next / Qwen3.5 attention."""
    config.pop("full_attention_interval", None)
    config.update(
        layer_types=[
            "linear_attention" if k else "full_attention" for k in arch.linear_attention_freq or []
        ],
        linear_conv_kernel_dim=arch.linear_conv_kernel_dim,
        linear_key_head_dim=arch.linear_key_head_dim,
        linear_value_head_dim=arch.linear_value_head_dim,
        linear_num_key_heads=arch.linear_num_key_heads,
        linear_num_value_heads=arch.linear_num_value_heads,
        partial_rotary_factor=arch.rotary_percent,
        attention_bias=False,
    )
    return config


def _architecture(config: dict[str, Any], where: str) -> GPTArchitecture:
    moe: dict[str, Any] = {}
    if config.get("num_experts", 512):
        shared = config.get("shared_expert_intermediate_size")
        if not isinstance(shared, int) or shared <= 0:
            raise ConversionError(
                f"{where}: shared_expert_intermediate_size: missing or not a positive integer"
            )
        moe = dict(
            routing_fields(
                config,
                where,
                "num_experts",
                bool(config.get("norm_topk_prob", True)),
                "moe_intermediate_size",
            ),
            moe_shared_expert_intermediate_size=shared,
            moe_shared_expert_gate=True,
            moe_layer_freq=sparse_layers(config, where),
        )
    return dense_architecture(config, where, **hybrid_fields(config, where), **moe)


def _config(arch: GPTArchitecture, config: dict[str, Any]) -> dict[str, Any]:
    config = hybrid_config(arch, config)
    if not arch.num_moe_experts:
        config.update(num_experts=0, mlp_only_layers=[], decoder_sparse_step=1)
        return config
    config.update(gated_shared_expert_config(arch))
    return config


def _cannot_express(arch: GPTArchitecture) -> str | None:
    moe = bool(arch.num_moe_experts)
    return mismatch(
        arch,
        qk_norm=True,
        moe=moe,
        shared_expert=moe,
        dense_layers=arch.has_dense_layers(),
        linear_attention=True,
        output_gate=True,
        offset_norms=True,
        partial_rotary=arch.rotary_percent != 1.0,
    )


FAMILIES = (
    Family(
        model_type="qwen3_next",
        hf_architecture="Qwen3NextForCausalLM",
        architecture_from_hf=_architecture,
        hf_config=_config,
        layer_mappings=layer_mappings,
        cannot_express=_cannot_express,
    ),
)
