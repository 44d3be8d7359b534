"""Run-config checks of the model's shape: sizes megatron-core's TransformerConfig would otherwise
assert on, sigmoid routing and the router loss, hybrid (gated DeltaNet) layer patterns — each
failure names the config key (`validate.validate` runs them)."""

from __future__ import annotations

from typing import Any

from megatron_kto.config.architecture import IN_PROJ_NAMES
from megatron_kto.config.errors import need, need_one_of

__all__ = ["check_architecture", "check_linear_attention", "check_router_loss"]


def check_architecture(m: Any) -> None:
    """Shape checks megatron-core's TransformerConfig would otherwise make with a bare assert or
    a message naming its own field names."""
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads"):
        value = getattr(m, key)
        need(value is not None and value >= 1, f"model.{key}", f"must be >= 1, got {value}")
    need(m.encoder_seq_length >= 1, "model.encoder_seq_length", "must be >= 1")
    need(m.make_vocab_size_divisible_by >= 1, "model.make_vocab_size_divisible_by", "must be >= 1")
    groups = m.num_query_groups or m.num_attention_heads
    need(
        m.num_attention_heads % groups == 0,
        "model.num_query_groups",
        f"{groups} query groups do not divide the {m.num_attention_heads} attention heads",
    )
    if m.kv_channels is None:
        need(
            m.hidden_size % m.num_attention_heads == 0,
            "model.hidden_size",
            f"{m.hidden_size} is not divisible by num_attention_heads ({m.num_attention_heads}); "
            "set model.kv_channels (the head dimension) explicitly",
        )
    need(0.0 < m.rotary_percent <= 1.0, "model.rotary_percent", "must be in (0, 1]")
    for key in ("hidden_dropout", "attention_dropout"):
        need(0.0 <= getattr(m, key) < 1.0, f"model.{key}", "must be in [0, 1)")
    need_one_of(m.normalization, "model.normalization", ("RMSNorm", "LayerNorm"))
    need_one_of(
        m.activation, "model.activation", ("swiglu", "geglu", "quick_geglu", "gelu", "relu")
    )
    need_one_of(
        m.position_embedding_type,
        "model.position_embedding_type",
        ("rope", "yarn", "learned_absolute"),
    )
    if m.sliding_window is not None:
        need(m.sliding_window >= 1, "model.sliding_window", "must be >= 1 (or null)")
    if m.window_layers is not None:
        pattern = list(m.window_layers)
        need(bool(m.sliding_window), "model.window_layers", "needs model.sliding_window")
        need(
            len(pattern) == m.num_layers and set(pattern) <= {0, 1},
            "model.window_layers",
            f"{pattern}: expected one 1 (sliding window) or 0 (full attention) per layer "
            f"({m.num_layers} layers)",
        )
    if m.moe_layer_freq is not None:
        pattern = list(m.moe_layer_freq)
        need(bool(m.num_moe_experts), "model.moe_layer_freq", "needs model.num_moe_experts")
        need(
            len(pattern) == m.num_layers and set(pattern) <= {0, 1} and 1 in pattern,
            "model.moe_layer_freq",
            f"{pattern}: expected one 1 (MoE) or 0 (dense) per layer ({m.num_layers} layers), "
            "at least one 1",
        )
    _check_router(m)


def _check_router(m: Any) -> None:
    """The sigmoid-routing keys (GLM-4.5, DeepSeek-V3) against each other, before megatron-core's
    asserts."""
    need_one_of(
        m.moe_router_score_function, "model.moe_router_score_function", ("softmax", "sigmoid")
    )
    sigmoid = m.moe_router_score_function == "sigmoid"
    need(
        sigmoid or not m.moe_router_enable_expert_bias,
        "model.moe_router_enable_expert_bias",
        "needs model.moe_router_score_function: sigmoid",
    )
    need(
        m.moe_router_bias_update_rate >= 0.0
        and (m.moe_router_enable_expert_bias or m.moe_router_bias_update_rate == 0.0),
        "model.moe_router_bias_update_rate",
        f"{m.moe_router_bias_update_rate}: must be >= 0, and > 0 only with an expert bias "
        "(model.moe_router_enable_expert_bias)",
    )
    need(
        m.moe_router_bias_update_rate == 0.0 or str(m.peft.peft_scheme) != "lora",
        "model.moe_router_bias_update_rate",
        f"{m.moe_router_bias_update_rate}: moving the expert bias changes the base model that "
        "LoRA's reference (adapters off) shares; train with a frozen bias (0) or without LoRA",
    )
    need(
        not (sigmoid and m.moe_aux_loss_coeff),
        "model.moe_aux_loss_coeff",
        f"{m.moe_aux_loss_coeff}: the load-balancing loss is Hugging Face's softmax-router "
        "formula; a sigmoid router (GLM-4.5) has none in transformers — balance it with "
        "model.moe_router_bias_update_rate, or set 0",
    )
    groups, picked = m.moe_router_num_groups, m.moe_router_group_topk
    if groups is not None or picked is not None:
        experts = m.num_moe_experts or 0
        need(
            bool(groups and picked) and experts % groups == 0 and picked <= groups,
            "model.moe_router_group_topk",
            f"{picked} of model.moe_router_num_groups {groups}: both must be set, the groups "
            f"must divide the {experts} experts and group_topk <= num_groups",
        )


def check_linear_attention(m: Any) -> None:
    """Hybrid (gated DeltaNet) models: the layer pattern, the DeltaNet heads against TP, and the
    combination not built yet (context parallelism) — before megatron-core's asserts."""
    pattern = None if m.linear_attention_freq is None else list(m.linear_attention_freq)
    if pattern is not None:
        need(
            len(pattern) == m.num_layers and set(pattern) <= {0, 1},
            "model.linear_attention_freq",
            f"{pattern}: expected one 1 (gated DeltaNet) or 0 (full attention) per layer "
            f"({m.num_layers} layers)",
        )
    deltanet = [i for i, kind in enumerate(pattern or []) if kind]
    need(
        m.linear_in_proj is None or m.linear_in_proj in IN_PROJ_NAMES,
        "model.linear_in_proj",
        f"{m.linear_in_proj!r} is not one of {sorted(IN_PROJ_NAMES)}",
    )
    if deltanet:
        tp = m.tensor_model_parallel_size
        keys, values = m.linear_num_key_heads, m.linear_num_value_heads
        need(
            values % keys == 0,
            "model.linear_num_value_heads",
            f"{values} is not a multiple of linear_num_key_heads ({keys})",
        )
        need(
            keys % tp == 0 and values % tp == 0,
            "model.tensor_model_parallel_size",
            f"{tp} must divide the gated DeltaNet heads ({keys} key, {values} value heads)",
        )
        need(
            m.context_parallel_size == 1,
            "model.context_parallel_size",
            f"{m.context_parallel_size}: gated DeltaNet layers {deltanet} cannot be split over "
            "context-parallel ranks (set it to 1)",
        )
        need(m.activation == "swiglu", "model.activation", "gated DeltaNet models need swiglu")
        need(
            m.normalization == "RMSNorm",
            "model.normalization",
            "gated DeltaNet models need RMSNorm",
        )


def check_router_loss(m: Any) -> None:
    """`model.moe_aux_loss_coeff` (the router load-balancing loss) against the layouts and
    recompute settings it cannot run under."""
    cp, vpp = m.context_parallel_size, m.virtual_pipeline_model_parallel_size
    need(
        cp == 1 or not (m.num_moe_experts and m.moe_aux_loss_coeff),
        "model.moe_aux_loss_coeff",
        f"{m.moe_aux_loss_coeff}: the router load-balancing loss is not supported with "
        f"model.context_parallel_size={cp} (each rank routes part of every row); set "
        "model.moe_aux_loss_coeff=0 or model.context_parallel_size=1",
    )
    if not (m.num_moe_experts and m.moe_aux_loss_coeff):
        return
    need(m.moe_aux_loss_coeff > 0, "model.moe_aux_loss_coeff", "must be >= 0")
    # The balance statistics of a micro-batch span every layer's router: each rank's model
    # chunk must run a micro-batch's layers in one forward (`models.router_stats`).
    need(
        vpp is None or vpp == 1,
        "model.moe_aux_loss_coeff",
        f"{m.moe_aux_loss_coeff}: the router load-balancing loss is not supported with "
        "virtual_pipeline_model_parallel_size > 1 (a rank's layers run its micro-batches "
        "interleaved); set model.moe_aux_loss_coeff=0 to train without it",
    )
    need(
        m.activations_checkpoint_granularity != "full",
        "model.moe_aux_loss_coeff",
        f"{m.moe_aux_loss_coeff}: the router load-balancing loss is not supported with "
        "activations_checkpoint_granularity=full (the routers re-run in the backward "
        "pass); use selective or no recompute, or set model.moe_aux_loss_coeff=0",
    )
