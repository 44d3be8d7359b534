"""GLM-4.5 / 4.6 / Air (`glm4_moe`): GQA attention with q/k/v biases (`attention_bias`; the output
projection has none), optional per-head Q/K RMSNorm (`use_qk_norm`) and partial rotary embeddings
(`partial_rotary_factor`, megatron's `rotary_percent`); the first `first_k_dense_replace` layers
have a dense SwiGLU MLP of `intermediate_size`, the others sigmoid-routed experts plus an ungated
shared expert (`mlp.shared_experts.*`, width `moe_intermediate_size` x `n_shared_experts`).

Routing, as `transformers`' Glm4MoeTopkRouter computes it (fp32): scores s = sigmoid(x · W);
experts are chosen on s + b (b = `e_score_correction_bias`, megatron's `expert_bias` buffer),
limited to the `topk_group` best of `n_group` groups ranked by the sum of each group's top-2;
the weights are the un-biased s of the chosen experts, renormalised when `norm_topk_prob`, times
`routed_scaling_factor`. megatron-core's `topk_routing_with_score_function` renormalises exactly
when top-k > 1 and ranks groups by their top-(topk // group_topk) sum, so configs where the two
would differ are refused in one line naming the key. Multi-token-prediction layers of a
published checkpoint are skipped (`hf_dir.skipped_hf_tensors`).
"""

from __future__ import annotations

from typing import Any

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.conversion.addressing import Mapping
from megatron_kto.conversion.errors import ConversionError
from megatron_kto.conversion.families import Family, dense_architecture, mismatch
from megatron_kto.conversion.families.qwen3_moe import layer_mappings as routed_mappings
from megatron_kto.conversion.moe import routing_fields, shared_expert_mappings

#: transformers' Glm4MoeConfig default (`__post_init__`), for configs that do not state it.
DEFAULT_PARTIAL_ROTARY = 0.5
#: Hugging Face ranks expert groups by the sum of each group's top-2 scores.
HF_GROUP_TOP = 2


def layer_mappings(arch: GPTArchitecture, norms: dict[str, str]) -> tuple[Mapping, ...]:
    """Attention (biases, Q/K norms as the architecture has them), then the router, its expert
    bias, the routed experts and the ungated shared expert — or, for a dense layer (`arch`
    without experts), the dense MLP."""
    if not arch.num_moe_experts:  # Qwen3-MoE's names, as for its routed part
        return routed_mappings(arch, norms)
    bias = (Mapping("mlp.router.expert_bias", ("mlp.gate.e_score_correction_bias",)),)
    shared = shared_expert_mappings("mlp.shared_experts", None)
    return routed_mappings(arch, norms) + bias + shared


def _positive_int(config: dict[str, Any], key: str, where: str, default: int) -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or value < 1:
        raise ConversionError(f"{where}: {key}: {value!r} is not a positive integer")
    return value


def _partial_rotary(config: dict[str, Any], where: str, head_dim: int) -> float:
    params = config.get("rope_parameters") or {}
    factor = config.get("partial_rotary_factor", params.get("partial_rotary_factor"))
    factor = DEFAULT_PARTIAL_ROTARY if factor is None else float(factor)
    rotated = head_dim * factor
    if not 0.0 < factor <= 1.0 or rotated != int(rotated) or int(rotated) % 2:
        raise ConversionError(
            f"{where}: partial_rotary_factor {factor}: must rotate an even number of the "
            f"{head_dim} head dims"
        )
    return factor


def _routing(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The sigmoid-routing fields, refusing what megatron-core would compute differently."""
    fields = routing_fields(config, where, "n_routed_experts", True, "moe_intermediate_size")
    experts, topk = fields["num_moe_experts"], fields["moe_router_topk"]
    renormalise = bool(config.get("norm_topk_prob", True))
    if renormalise != (topk > 1):
        raise ConversionError(
            f"{where}: norm_topk_prob {renormalise} with num_experts_per_tok {topk}: "
            "megatron-core renormalises sigmoid top-k weights exactly when top-k > 1"
        )
    groups = _positive_int(config, "n_group", where, 1)
    picked = _positive_int(config, "topk_group", where, 1)
    if experts % groups or experts // groups < HF_GROUP_TOP or picked > groups:
        raise ConversionError(
            f"{where}: n_group {groups} / topk_group {picked}: the groups must divide the "
            f"{experts} experts into groups of >= {HF_GROUP_TOP}, topk_group <= n_group"
        )
    limited = groups > 1 and picked < groups  # otherwise every group is eligible: no limit
    if limited and topk // picked != HF_GROUP_TOP:
        raise ConversionError(
            f"{where}: topk_group {picked}: megatron-core ranks groups by their top-"
            f"(num_experts_per_tok // topk_group) = {topk // picked} scores, Hugging Face by "
            f"their top-{HF_GROUP_TOP}; supported when num_experts_per_tok = 2 x topk_group"
        )
    scale = float(config.get("routed_scaling_factor", 1.0) or 1.0)
    return dict(
        fields,
        moe_router_pre_softmax=False,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=groups if limited else None,
        moe_router_group_topk=picked if limited else None,
        moe_router_topk_scaling_factor=None if scale == 1.0 else scale,
        moe_aux_loss_coeff=0.0,  # transformers' Glm4Moe has no load-balancing loss
    )


def sigmoid_moe_fields(config: dict[str, Any], where: str, dense_default: int) -> dict[str, Any]:
    """The `GPTArchitecture` MoE fields GLM-4.5 and DeepSeek-V3 share: sigmoid routing
    (`_routing`), the ungated shared expert and the first `first_k_dense_replace` layers dense
    (`dense_default` when the config does not say)."""
    routing = _routing(config, where)
    layers = config.get("num_hidden_layers")
    dense = config.get("first_k_dense_replace", dense_default)
    if not isinstance(dense, int) or not isinstance(layers, int) or not 0 <= dense < layers:
        raise ConversionError(
            f"{where}: first_k_dense_replace {dense!r}: must leave at least one of the "
            f"{layers} layers MoE"
        )
    shared = _positive_int(config, "n_shared_experts", where, 1)
    return dict(
        moe_shared_expert_intermediate_size=shared * routing["moe_ffn_hidden_size"],
        moe_shared_expert_gate=False,
        moe_layer_freq=[0] * dense + [1] * (layers - dense) if dense else None,
        **routing,
    )


def _architecture(config: dict[str, Any], where: str) -> GPTArchitecture:
    heads = config.get("num_attention_heads") or 1
    head_dim = config.get("head_dim") or (config.get("hidden_size") or 0) // heads
    return dense_architecture(
        config,
        where,
        add_qkv_bias=bool(config.get("attention_bias", False)),
        qk_layernorm=bool(config.get("use_qk_norm", False)),
        rotary_percent=_partial_rotary(config, where, head_dim),
        **sigmoid_moe_fields(config, where, dense_default=1),
    )


def _dense_prefix(arch: GPTArchitecture) -> int | None:
    """The number of leading dense layers when the dense layers are exactly a prefix."""
    pattern = arch.moe_layer_freq or [1] * arch.num_layers
    k = pattern.index(1) if 1 in pattern else arch.num_layers
    return k if all(pattern[k:]) else None


def sigmoid_moe_config(arch: GPTArchitecture) -> dict[str, Any]:
    """config.json fields of `sigmoid_moe_fields` (GLM-4.5, DeepSeek-V3)."""
    width = arch.moe_ffn_hidden_size or arch.ffn_hidden_size
    return dict(
        n_routed_experts=arch.num_moe_experts,
        num_experts_per_tok=arch.moe_router_topk,
        moe_intermediate_size=width,
        n_shared_experts=(arch.moe_shared_expert_intermediate_size or 0) // width,
        norm_topk_prob=arch.moe_router_topk > 1,
        routed_scaling_factor=arch.moe_router_topk_scaling_factor or 1.0,
        n_group=arch.moe_router_num_groups or 1,
        topk_group=arch.moe_router_group_topk or 1,
        first_k_dense_replace=_dense_prefix(arch),
        # The multi-token-prediction layers of a source checkpoint are not carried.
        num_nextn_predict_layers=0,
    )


def _config(arch: GPTArchitecture, config: dict[str, Any]) -> dict[str, Any]:
    for key in ("num_local_experts", "num_experts", "partial_rotary_factor", "num_mtp_layers"):
        config.pop(key, None)
    config.update(
        attention_bias=arch.add_qkv_bias,
        use_qk_norm=arch.qk_layernorm,
        partial_rotary_factor=arch.rotary_percent,
        **sigmoid_moe_config(arch),
    )
    return config


def sigmoid_moe_mismatch(arch: GPTArchitecture) -> str | None:
    """Why `arch`'s experts are not `sigmoid_moe_fields`' (one phrase), or None."""
    width = arch.moe_ffn_hidden_size or arch.ffn_hidden_size
    if (arch.moe_shared_expert_intermediate_size or 0) % width:
        return "the shared expert's width is not a multiple of an expert's"
    if not arch.moe_router_enable_expert_bias:
        return "the model's router has no expert bias"
    if _dense_prefix(arch) is None:
        return "the model's dense layers are not its first layers"
    return None


def _cannot_express(arch: GPTArchitecture) -> str | None:
    why = mismatch(
        arch,
        qkv_bias=arch.add_qkv_bias,
        qk_norm=arch.qk_layernorm,
        moe=True,
        ungated_shared_expert=True,
        dense_layers=arch.has_dense_layers(),
        sigmoid_router=True,
        partial_rotary=arch.rotary_percent != 1.0,
    )
    return why or sigmoid_moe_mismatch(arch)


FAMILIES = (
    Family(
        model_type="glm4_moe",
        hf_architecture="Glm4MoeForCausalLM",
        architecture_from_hf=_architecture,
        hf_config=_config,
        layer_mappings=layer_mappings,
        cannot_express=_cannot_express,
    ),
)
