"""What every family shares: the `Family` record each `conversion/families/<type>.py` defines
(`FAMILIES`, collected by `conversion/registry.py`), the Llama-style config.json fields
(`dense_architecture` / `dense_hf_config`, each family adding its own on top) and `mismatch`, the
shared check of what a family's checkpoints can hold.

Reads both the transformers 4.x spelling (`rope_theta`, `rope_scaling`) and the 5.x one
(`rope_parameters`); writes the 4.x spelling, which every transformers version loads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.conversion.addressing import Mapping
from megatron_kto.conversion.errors import ConversionError


@dataclass(frozen=True)
class Family:
    """How one Hugging Face model type converts."""

    model_type: str
    """config.json `model_type`."""
    hf_architecture: str
    """config.json `architectures[0]` written on export."""
    architecture_from_hf: Callable[[dict[str, Any], str], GPTArchitecture]
    """config.json (and where it was read, for errors) -> architecture; raises ConversionError."""
    hf_config: Callable[[GPTArchitecture, dict[str, Any]], dict[str, Any]]
    """Adds the family's own fields to the shared config.json fields of an architecture."""
    layer_mappings: Callable[[GPTArchitecture, dict[str, str]], tuple[Mapping, ...]]
    """The per-layer tensor table of an architecture, given the built model's norm names."""
    cannot_express: Callable[[GPTArchitecture], str | None]
    """Why an architecture does not export as this type (one phrase), or None when it does
    (windows aside: `refuses` adds them)."""
    windows: str = "none"
    """How its config.json states sliding windows (`WINDOW_STYLES`)."""
    weight_prefixes: tuple[tuple[str, str], ...] = ()
    """(stored prefix, table prefix) pairs: its checkpoints store the tables' tensors under other
    names (a multimodal model's language model); tensors under none of them are not read."""

    def refuses(self, arch: GPTArchitecture) -> str | None:
        """Why `arch` does not export as this type (one phrase), or None when it does."""
        return self.cannot_express(arch) or window_mismatch(arch, self.windows)


#: How a family's config.json states sliding windows, as its `transformers` model reads them:
#: "none" — no windows (full causal attention whatever the file says); "uniform" — the
#: `sliding_window` (unless `use_sliding_window` is false) in every layer (Mistral, Mixtral,
#: Qwen3-MoE); "per_layer" — in the layers `layer_types` marks "sliding_attention", or from
#: `max_window_layers` on where `layer_types` is absent (Qwen2, Qwen3, Qwen2-MoE); "own" — the
#: family reads and writes its windows itself (Gemma 3).
WINDOW_STYLES = ("none", "uniform", "per_layer", "own")
_LAYER_KINDS = {"sliding_attention": 1, "full_attention": 0}


def window_mismatch(arch: GPTArchitecture, style: str) -> str | None:
    """Why `arch`'s windows cannot be stated in a config.json of `style` (one phrase), or None."""
    if not arch.sliding_window or style in ("per_layer", "own"):
        return None
    if style == "none":
        return "the model has sliding-window attention"
    if arch.window_layers is not None and not all(arch.window_layers):
        return "the model has full-attention layers between sliding-window layers"
    return None


def hf_windows(config: dict[str, Any], where: str, style: str) -> dict[str, Any]:
    """The `GPTArchitecture` window fields (`sliding_window`, `window_layers`) of a config.json.

    Raises:
        ConversionError: a window that is not a positive integer, or `layer_types` that are not
            one "sliding_attention" / "full_attention" per layer, naming `where` and the key.
    """
    if style == "own":
        return {}
    window = config.get("sliding_window")
    if style == "none" or not window or not config.get("use_sliding_window", True):
        return {"sliding_window": None, "window_layers": None}
    if not isinstance(window, int) or window < 1:
        raise ConversionError(f"{where}: sliding_window {window!r}: expected a positive integer")
    layers = config["num_hidden_layers"]
    pattern = None
    if style == "per_layer":
        kinds = config.get("layer_types")
        if kinds is None and "max_window_layers" in config:
            pattern = [int(i >= config["max_window_layers"]) for i in range(layers)]
        elif kinds is not None:
            if len(kinds) != layers or not set(kinds) <= set(_LAYER_KINDS):
                raise ConversionError(
                    f"{where}: layer_types: expected one of {sorted(_LAYER_KINDS)} per layer "
                    f"({layers} layers), got {kinds}"
                )
            pattern = [_LAYER_KINDS[k] for k in kinds]
    if pattern is not None and not any(pattern):
        return {"sliding_window": None, "window_layers": None}
    if pattern is not None and all(pattern):
        pattern = None
    return {"sliding_window": window, "window_layers": pattern}


def hf_window_config(arch: GPTArchitecture, config: dict[str, Any], style: str) -> dict[str, Any]:
    """Writes `arch`'s windows into a config.json of `style` (`sliding_window`, and for
    "per_layer" `use_sliding_window` and `layer_types`)."""
    if style in ("none", "own"):
        return config
    config["sliding_window"] = arch.sliding_window
    if style == "per_layer":
        config["use_sliding_window"] = bool(arch.sliding_window)
        if arch.sliding_window or "layer_types" in config:
            config["layer_types"] = [
                "sliding_attention" if arch.layer_window(i) else "full_attention"
                for i in range(arch.num_layers)
            ]
    else:
        config.pop("layer_types", None)
    return config


#: The Llama-3 RoPE scaling megatron-core 0.16 implements (`RotaryEmbedding._apply_scaling`).
LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


_FEATURES = {
    "qkv_bias": ("qkv biases", lambda a: a.add_qkv_bias),
    "qk_norm": ("per-head Q/K norms", lambda a: a.qk_layernorm),
    "moe": ("mixture-of-experts layers", lambda a: bool(a.num_moe_experts)),
    "shared_expert": (
        "a gated shared expert",
        lambda a: bool(a.moe_shared_expert_intermediate_size) and a.moe_shared_expert_gate,
    ),
    "ungated_shared_expert": (
        "an ungated shared expert",
        lambda a: bool(a.moe_shared_expert_intermediate_size) and not a.moe_shared_expert_gate,
    ),
    "dense_layers": ("dense layers between MoE layers", lambda a: a.has_dense_layers()),
    "gemma": (
        "Gemma's layers (post-norms, GeGLU, scaled embeddings or scores, a local RoPE base)",
        lambda a: (
            a.post_norms
            or a.activation == "geglu"
            or a.embedding_multiplier is not None
            or a.softmax_scale is not None
            or a.rotary_base_local is not None
            or a.rotary_interpolation_factor is not None
        ),
    ),
    "linear_attention": ("gated DeltaNet layers", lambda a: a.has_linear_attention()),
    "output_gate": ("gated attention outputs", lambda a: a.attention_output_gate),
    "offset_norms": ("(1 + weight) RMSNorms", lambda a: a.zero_centered_norms),
    "sinks": ("attention sinks", lambda a: a.attention_sinks),
    "sigmoid_router": (
        "sigmoid routing",
        lambda a: bool(a.num_moe_experts) and a.moe_router_score_function == "sigmoid",
    ),
    "partial_rotary": ("partial rotary embeddings", lambda a: a.rotary_percent != 1.0),
    "mla": ("multi-latent attention", lambda a: a.multi_latent_attention),
}


def mismatch(arch: GPTArchitecture, **has: bool) -> str | None:
    """Why `arch` differs from a family that has exactly the features `has` (qkv_bias, qk_norm,
    moe, shared_expert, ungated_shared_expert, dense_layers, gemma, linear_attention, output_gate,
    offset_norms, sinks, sigmoid_router, partial_rotary, mla — absent means False): one phrase, or None
    when it matches."""
    for key in _FEATURES:
        wanted = has.get(key, False)
        label, test = _FEATURES[key]
        if bool(test(arch)) != wanted:
            return f"the model {'has' if test(arch) else 'lacks'} {label}"
    return None


def _rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = config.get("rope_parameters") or {}
    theta = config.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = config.get("rope_scaling") or (params if params.get("rope_type") else None)
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return float(theta), scaling


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


#: config.json fields counting multi-token-prediction layers (`hf_dir.mtp_layers`).
MTP_KEYS = ("num_nextn_predict_layers", "num_mtp_layers")


def dense_hf_config(
    arch: GPTArchitecture,
    model_type: str,
    hf_architecture: str,
    base: dict[str, Any] | None,
    dtype: str,
) -> dict[str, Any]:
    """The shared fields of a Llama-style config.json for `arch`, over the non-shape fields of
    `base` (a family with another activation, Gemma's GeGLU, rewrites `hidden_act`).

    Raises:
        ConversionError: `arch` is not RMSNorm + a gated MLP without linear biases.
    """
    gated = arch.gated_mlp and not arch.add_bias_linear
    gated = gated or (arch.activation, arch.add_bias_linear) == ("quick_geglu", True)
    if arch.normalization != "RMSNorm" or not gated:
        raise ConversionError(
            "only RMSNorm + SwiGLU/GeGLU models without linear biases export to Hugging Face"
        )
    # The weights written are dequantised (`hf_writer.convert.export_notes`): no
    # quantization_config; and multi-token-prediction layers are not written.
    dropped = ("rope_parameters", "rope_scaling", "quantization_config")
    config = {k: v for k, v in (base or {}).items() if k not in dropped}
    config.update({k: 0 for k in MTP_KEYS if config.get(k)})
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
