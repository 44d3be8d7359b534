"""Gemma 3 text models (`gemma3_text`, `Gemma3ForCausalLM`), and the language model inside
multimodal `gemma3` checkpoints (`Gemma3ForConditionalGeneration`).

What sets them apart from the Llama layout, and where each lives in `GPTArchitecture`:

* interleaved sliding-window and full-attention layers from `layer_types` (older configs:
  `sliding_window_pattern`, every n-th layer full) — `sliding_window`, `window_layers`;
* a RoPE base per layer kind: `rope_parameters["sliding_attention"]` / `["full_attention"]`
  (transformers 4.x: `rope_local_base_freq` / `rope_theta`), linear scaling on the full layers
  only — `rotary_base_local`, `rotary_base`, `rotary_interpolation_factor`;
* RMSNorms that scale by (1 + w) in fp32, per-head Q/K norms, a norm after attention and after
  the MLP (`post_attention_layernorm`, `post_feedforward_layernorm`) besides the pre-norms
  (`input_layernorm`, `pre_feedforward_layernorm`) — `zero_centered_norms`, `qk_layernorm`,
  `post_norms` (`models.gemma_layers`);
* GeGLU with tanh-approximated GeLU — `activation='geglu'`; embeddings multiplied by
  sqrt(hidden) in the model's dtype — `embedding_multiplier`; scores scaled by
  `query_pre_attn_scalar`^-1/2 — `softmax_scale`; tied embeddings.

Not supported (one ConversionError line): attention or final logit soft-capping, bidirectional
attention, attention biases, RoPE types other than default / linear.

A multimodal `gemma3` checkpoint is read as its language model: `text_config` gives the
architecture, the tensors under `language_model.model.` / `model.language_model.` (and
`language_model.lm_head.`) are the text model's; the vision tower and the multimodal projector
are not read. Training and hf/ output are text-only: the export is a `gemma3_text` directory
(`Gemma3ForCausalLM`), never a multimodal one.
"""

from __future__ import annotations

import math
from typing import Any

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.conversion.addressing import (
    FC1_WEIGHT,
    FC2_WEIGHT,
    Mapping,
    attention_mappings,
)
from megatron_kto.conversion.errors import ConversionError
from megatron_kto.conversion.families import Family, dense_architecture, hf_windows, mismatch

ACTIVATION = "gelu_pytorch_tanh"
#: transformers' defaults for configs that leave them out (`Gemma3TextConfig`).
DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
DEFAULT_PATTERN = 6
#: `Gemma3TextConfig`'s defaults of the shape fields (multimodal configs on the Hub often state
#: only what differs).
TEXT_DEFAULTS = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "tie_word_embeddings": True,
}
#: Keys of a multimodal config.json that an exported text model does not keep.
MULTIMODAL_KEYS = (
    "text_config",
    "vision_config",
    "mm_tokens_per_image",
    "boi_token_index",
    "eoi_token_index",
    "image_token_index",
    "_sliding_window_pattern",
)


def layer_mappings(arch: GPTArchitecture, norms: dict[str, str]) -> tuple[Mapping, ...]:
    """Pre-norm, QKV, Q/K norms, output projection, post-attention norm; pre-MLP norm, GeGLU
    MLP, post-MLP norm (Hugging Face's Gemma 3 names)."""
    return (
        *attention_mappings(arch),
        Mapping("self_attention.post_norm.weight", ("post_attention_layernorm.weight",)),
        Mapping("{mlp_norm}", ("pre_feedforward_layernorm.weight",)),
        FC1_WEIGHT,
        FC2_WEIGHT,
        Mapping("mlp.post_norm.weight", ("post_feedforward_layernorm.weight",)),
    )


def _rope(config: dict[str, Any], where: str) -> dict[str, Any]:
    """{kind: (theta, rope type, linear factor or None)} for 'full_attention' and
    'sliding_attention', from either spelling."""
    params = config.get("rope_parameters") or {}
    nested = {k: params[k] for k in DEFAULT_THETA if isinstance(params.get(k), dict)}
    out = {}
    for kind, default in DEFAULT_THETA.items():
        if nested:
            p = nested.get(kind, {})
        elif kind == "full_attention":
            p = {**(config.get("rope_scaling") or {}), "rope_theta": config.get("rope_theta")}
        else:
            p = {"rope_theta": config.get("rope_local_base_freq")}
        theta = p.get("rope_theta") or default
        rope_type = p.get("rope_type", p.get("type", "default"))
        if rope_type not in ("default", "linear") or (
            rope_type == "linear" and kind == "sliding_attention"
        ):
            raise ConversionError(
                f"{where}: rope_parameters[{kind!r}]: rope_type {rope_type!r} is not supported "
                "(default, or linear on the full-attention layers)"
            )
        factor = float(p["factor"]) if rope_type == "linear" else None
        out[kind] = (float(theta), factor)
    return out


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


def gemma3_architecture(config: dict[str, Any], where: str) -> GPTArchitecture:
    """The architecture of a `gemma3_text` config.json.

    Raises:
        ConversionError: an unsupported option, naming `where` and the key.
    """
    config = {**TEXT_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    activation = config.get("hidden_activation") or config.get("hidden_act") or ACTIVATION
    if activation != ACTIVATION:
        raise ConversionError(f"{where}: hidden_activation {activation!r}: only {ACTIVATION}")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if config.get(key) is not None:
            raise ConversionError(f"{where}: {key}: logit soft-capping is not supported")
    if config.get("use_bidirectional_attention"):
        raise ConversionError(f"{where}: use_bidirectional_attention: only causal attention")
    if config.get("attention_bias"):
        raise ConversionError(
            f"{where}: attention_bias: Gemma 3 attention biases are not supported"
        )
    layers = config.get("num_hidden_layers")
    kinds = config.get("layer_types")
    if kinds is None and isinstance(layers, int):
        pattern = config.get("sliding_window_pattern") or DEFAULT_PATTERN
        kinds = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ]
    rope = _rope(config, where)
    shared = {
        k: v
        for k, v in config.items()
        if k not in ("hidden_act", "hidden_activation", "rope_parameters", "rope_scaling")
    }
    shared["rope_theta"] = rope["full_attention"][0]
    windows = hf_windows({**config, "layer_types": kinds}, where, "per_layer")
    hidden = config.get("hidden_size")
    scalar = config.get("query_pre_attn_scalar", 256)
    return dense_architecture(
        shared,
        where,
        activation="geglu",
        qk_layernorm=True,
        zero_centered_norms=True,
        post_norms=True,
        embedding_multiplier=math.sqrt(hidden) if isinstance(hidden, int) else None,
        softmax_scale=float(scalar) ** -0.5,
        rotary_base_local=_number(rope["sliding_attention"][0]),
        rotary_interpolation_factor=rope["full_attention"][1],
        share_embeddings_and_output_weights=bool(config.get("tie_word_embeddings", True)),
        **windows,
    )


def gemma3_config(arch: GPTArchitecture, config: dict[str, Any]) -> dict[str, Any]:
    """config.json fields of Gemma 3 (the 4.x RoPE spelling, which 5.x reads too)."""
    for key in ("hidden_act", "sliding_window_pattern", "use_sliding_window", "max_window_layers"):
        config.pop(key, None)
    scalar = arch.softmax_scale**-2
    config.update(
        hidden_activation=ACTIVATION,
        query_pre_attn_scalar=round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
        rope_local_base_freq=float(arch.rotary_base_local or arch.rotary_base),
        sliding_window=arch.sliding_window,
        layer_types=[
            "sliding_attention" if arch.layer_window(i) else "full_attention"
            for i in range(arch.num_layers)
        ],
        attention_bias=False,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        use_bidirectional_attention=False,
    )
    if arch.rotary_interpolation_factor is not None:
        config["rope_scaling"] = {"rope_type": "linear", "factor": arch.rotary_interpolation_factor}
    return config


def _cannot_express(arch: GPTArchitecture) -> str | None:
    reason = mismatch(arch, qkv_bias=False, qk_norm=True, moe=False, gemma=True, offset_norms=True)
    if reason:
        return reason
    exact = {
        "GeGLU": arch.activation == "geglu",
        "(1 + w) norms": arch.zero_centered_norms,
        "post-norms": arch.post_norms,
        "embeddings scaled by sqrt(hidden)": arch.embedding_multiplier is not None
        and math.isclose(arch.embedding_multiplier, math.sqrt(arch.hidden_size)),
        "a softmax scale": arch.softmax_scale is not None,
        "no Llama-3 RoPE scaling": not arch.rope_scaling,
    }
    missing = [name for name, ok in exact.items() if not ok]
    return f"the model lacks Gemma 3's {', '.join(missing)}" if missing else None


def multimodal_architecture(config: dict[str, Any], where: str) -> GPTArchitecture:
    """The language model's architecture of a multimodal `gemma3` config.json."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ConversionError(f"{where}: text_config: missing (a gemma3 config holds one)")
    return gemma3_architecture(text, f"{where}: text_config")


def multimodal_export_config(arch: GPTArchitecture, config: dict[str, Any]) -> dict[str, Any]:
    """A multimodal source exports as its text model: a `gemma3_text` config.json."""
    text = config.get("text_config") or {}
    for key in MULTIMODAL_KEYS:
        config.pop(key, None)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in text:
            config[key] = text[key]
    config.update(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"])
    return gemma3_config(arch, config)


FAMILIES = (
    Family(
        model_type="gemma3_text",
        hf_architecture="Gemma3ForCausalLM",
        architecture_from_hf=gemma3_architecture,
        hf_config=gemma3_config,
        layer_mappings=layer_mappings,
        cannot_express=_cannot_express,
        windows="own",
    ),
    Family(
        model_type="gemma3",
        hf_architecture="Gemma3ForCausalLM",
        architecture_from_hf=multimodal_architecture,
        hf_config=multimodal_export_config,
        layer_mappings=layer_mappings,
        # A text-only model never exports as the multimodal type by default (`default_model_type`
        # takes gemma3_text, registered first); as the source's type it exports as gemma3_text.
        cannot_express=_cannot_express,
        windows="own",
        weight_prefixes=(
            ("language_model.model.", "model."),
            ("model.language_model.", "model."),
            ("language_model.lm_head.", "lm_head."),
            ("lm_head.", "lm_head."),
        ),
    ),
)
