"""Hugging Face `config.json` <-> `GPTArchitecture`: the fields every supported family shares.

Reads both the transformers 4.x spelling (`rope_theta`, `rope_scaling`) and the 5.x one
(`rope_parameters`); writes the 4.x spelling, which every transformers version loads. Each family
(`conversion/families/`) adds its own fields on top of `dense_architecture` / `dense_hf_config`;
`architecture_from_hf` and `hf_config_from_architecture` dispatch on `model_type` through the
registry (`conversion/registry.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_kto.models.architecture import GPTArchitecture

#: The Llama-3 RoPE scaling megatron-core 0.16 implements (`RotaryEmbedding._apply_scaling`).
LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


class ConversionError(ValueError):
    """A model or checkpoint that cannot be converted; one line naming the file and field."""


def _rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = config.get("rope_parameters") or {}
    theta = config.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = config.get("rope_scaling") or (params if params.get("rope_type") else None)
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return float(theta), scaling


def architecture_from_hf(config: dict[str, Any], where: str = "config.json") -> GPTArchitecture:
    """The megatron architecture of a Hugging Face config of any registered family.

    Raises:
        ConversionError: unsupported model type or option, naming `where` and the field.
    """
    from megatron_kto.conversion.registry import family_of_config

    return family_of_config(config, where).architecture_from_hf(config, where)


def hf_config_from_architecture(
    arch: GPTArchitecture,
    model_type: str,
    base: dict[str, Any] | None = None,
    dtype: str = "float32",
) -> dict[str, Any]:
    """A config.json for `arch` as `model_type`, keeping the non-shape fields of `base` (token
    ids, windows...).

    Raises:
        ConversionError: `model_type` unsupported or `arch` not expressible in it.
    """
    from megatron_kto.conversion.registry import expressing_types, get_family

    family = get_family(model_type, what="model type")
    reason = family.cannot_express(arch)
    if reason:
        options = " or ".join(expressing_types(arch)) or "no supported type"
        raise ConversionError(f"{reason}: it exports as {options}, not {model_type}")
    config = dense_hf_config(arch, model_type, family.hf_architecture, base, dtype)
    return family.hf_config(arch, config)


def dense_architecture(config: dict[str, Any], where: str, **fields: Any) -> GPTArchitecture:
    """The fields a Llama-style decoder config shares (RMSNorm, SwiGLU, RoPE, GQA, head_dim),
    with `fields` (a family's own) on top.

    Raises:
        ConversionError: a missing size or an option no family supports, naming `where`.
    """
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "vocab_size",
    ):
        if not isinstance(config.get(key), int):
            raise ConversionError(f"{where}: {key}: missing or not an integer")
    if config.get("hidden_act", "silu") != "silu":
        raise ConversionError(
            f"{where}: hidden_act {config['hidden_act']!r}: only silu (SwiGLU) is supported"
        )
    if config.get("mlp_bias"):
        raise ConversionError(f"{where}: mlp_bias: MLP biases are not supported")
    heads = config["num_attention_heads"]
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // heads
    theta, scaling = _rope(config)
    rope_scaling, factor = False, 8.0
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        extra = {k: float(scaling.get(k, -1)) for k in LLAMA3_ROPE}
        if kind != "llama3" or extra != LLAMA3_ROPE:
            raise ConversionError(
                f"{where}: rope_scaling {scaling}: only rope_type llama3 with {LLAMA3_ROPE} is supported"
            )
        rope_scaling, factor = True, float(scaling["factor"])
    max_positions = int(config.get("max_position_embeddings", 4096))
    arch = GPTArchitecture(
        num_layers=config["num_hidden_layers"],
        hidden_size=hidden,
        ffn_hidden_size=config["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=config.get("num_key_value_heads") or heads,
        kv_channels=head_dim,
        encoder_seq_length=max_positions,
        vocab_size=config["vocab_size"],
        normalization="RMSNorm",
        layernorm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
        activation="swiglu",
        position_embedding_type="rope",
        rotary_base=int(theta) if float(theta).is_integer() else theta,
        rope_scaling=rope_scaling,
        rope_scaling_factor=factor,
        add_bias_linear=False,
        add_qkv_bias=bool(config.get("attention_bias")),
        share_embeddings_and_output_weights=bool(config.get("tie_word_embeddings", False)),
        init_method_std=float(config.get("initializer_range", 0.02)),
    )
    return dataclasses.replace(arch, **fields)


def dense_hf_config(
    arch: GPTArchitecture,
    model_type: str,
    hf_architecture: str,
    base: dict[str, Any] | None,
    dtype: str,
) -> dict[str, Any]:
    """The shared fields of a Llama-style config.json for `arch`, over the non-shape fields of
    `base`.

    Raises:
        ConversionError: `arch` is not RMSNorm + SwiGLU without linear biases.
    """
    if arch.normalization != "RMSNorm" or arch.activation != "swiglu" or arch.add_bias_linear:
        raise ConversionError(
            "only RMSNorm + SwiGLU models without linear biases export to Hugging Face"
        )
    config = {k: v for k, v in (base or {}).items() if k not in ("rope_parameters", "rope_scaling")}
    heads = arch.num_attention_heads
    config.update(
        model_type=model_type,
        architectures=[hf_architecture],
        hidden_size=arch.hidden_size,
        intermediate_size=arch.ffn_hidden_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=arch.num_query_groups or heads,
        head_dim=arch.kv_channels or arch.hidden_size // heads,
        max_position_embeddings=arch.encoder_seq_length,
        vocab_size=arch.vocab_size,
        rms_norm_eps=arch.layernorm_epsilon,
        hidden_act="silu",
        rope_theta=float(arch.rotary_base),
        tie_word_embeddings=arch.share_embeddings_and_output_weights,
        initializer_range=arch.init_method_std,
        torch_dtype=dtype,
    )
    config.pop("dtype", None)
    if arch.rope_scaling:
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": arch.rope_scaling_factor,
            **LLAMA3_ROPE,
        }
    return config
