"""Mixture-of-experts layers in the conversion table: the router and one entry per expert.

Hugging Face publishes one tensor per expert projection (`...experts.{e}.gate_proj.weight`, or
Mixtral's `w1`/`w3`/`w2`); megatron-core keeps them per expert too (fc1: SwiGLU gate rows then up
rows), spelled as local experts or as Transformer Engine's grouped experts
(`addressing.expert_name`). Expert entries are marked `expert`: spread over expert parallelism.
The router is `mlp.router.weight` [experts, hidden], replicated over TP. The pre-MLP norm of an
MoE layer is never fused into a linear layer, so it is `pre_mlp_layernorm.weight` in both specs.

Qwen-MoE configs may make some layers dense (`mlp_only_layers`, `decoder_sparse_step`): those
have the dense SwiGLU MLP of `intermediate_size`; `sparse_layers` / `sparse_layer_fields` turn
the two keys into `GPTArchitecture.moe_layer_freq` and back.

The table names experts by their global index: conversion runs at EP=1 and megatron's
distributed checkpoint maps local to global experts when an EP>1 layout restores it.
"""

from __future__ import annotations

from typing import Any

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.conversion.addressing import COLUMN, ROW, TE_NORMS, Mapping, expert_name
from megatron_kto.conversion.errors import ConversionError

ROUTER = "mlp.router.weight"
MOE_NORM = "pre_mlp_layernorm.weight"


def expert_mappings(
    arch: GPTArchitecture,
    norms: dict[str, str],
    hf_router: str,
    hf_gate: str,
    hf_up: str,
    hf_down: str,
) -> tuple[Mapping, ...]:
    """The MLP part of an MoE layer: norm, router, and each expert's fc1 (gate, up) and fc2.

    Args:
        arch: an MoE architecture (`num_moe_experts` set).
        norms: the built model's norm names (`TE_NORMS` means TE's grouped experts).
        hf_router: Hugging Face router weight under `model.layers.{i}.`.
        hf_gate, hf_up, hf_down: expert projection names with an `{e}` placeholder.
    """
    grouped = norms is TE_NORMS
    entries = [
        Mapping(MOE_NORM, ("post_attention_layernorm.weight",)),
        Mapping(ROUTER, (hf_router,)),
    ]
    for e in range(arch.num_moe_experts or 0):
        entries.append(
            Mapping(
                expert_name(e, "linear_fc1.weight", grouped),
                (hf_gate.format(e=e), hf_up.format(e=e)),
                "gated_mlp",
                COLUMN,
                expert=True,
            )
        )
        entries.append(
            Mapping(
                expert_name(e, "linear_fc2.weight", grouped),
                (hf_down.format(e=e),),
                tp_axis=ROW,
                expert=True,
            )
        )
    return tuple(entries)


def shared_expert_mappings(hf_prefix: str, hf_gate: str | None) -> tuple[Mapping, ...]:
    """A shared expert (megatron's `SharedExpertMLP`): its SwiGLU MLP under `hf_prefix`
    (`gate_proj`/`up_proj`/`down_proj`) and, when gated (`moe_shared_expert_gate`), the
    [1, hidden] gate `hf_gate`: output = sigmoid(x · gate) · mlp(x) on both sides. `hf_gate`
    None: ungated (GLM-4.5, DeepSeek-V3), output = mlp(x)."""
    gate = () if hf_gate is None else (Mapping("mlp.shared_experts.gate_weight", (hf_gate,)),)
    return (
        Mapping(
            "mlp.shared_experts.linear_fc1.weight",
            (f"{hf_prefix}.gate_proj.weight", f"{hf_prefix}.up_proj.weight"),
            "gated_mlp",
            COLUMN,
        ),
        Mapping(
            "mlp.shared_experts.linear_fc2.weight", (f"{hf_prefix}.down_proj.weight",), tp_axis=ROW
        ),
    ) + gate


def gated_shared_expert_config(arch: GPTArchitecture) -> dict[str, Any]:
    """config.json fields of routed experts (softmax, top-k) with a gated shared expert and dense
    layers from `sparse_layer_fields` (Qwen2-MoE, Qwen3-Next)."""
    return dict(
        num_experts=arch.num_moe_experts,
        num_experts_per_tok=arch.moe_router_topk,
        moe_intermediate_size=arch.moe_ffn_hidden_size or arch.ffn_hidden_size,
        shared_expert_intermediate_size=arch.moe_shared_expert_intermediate_size,
        norm_topk_prob=not arch.moe_router_pre_softmax,
        router_aux_loss_coef=arch.moe_aux_loss_coeff,
        **sparse_layer_fields(arch),
    )


def routing_fields(
    config: dict[str, Any], where: str, experts_key: str, renormalise: bool, ffn_key: str
) -> dict[str, Any]:
    """`GPTArchitecture` MoE fields of a config.json.

    Args:
        config: the Hugging Face config.
        where: its path, for errors.
        experts_key: the config's name for the routed expert count.
        renormalise: whether the top-k weights are renormalised to sum to 1 (softmax over all
            experts, top-k, renormalise = softmax over the k selected logits).
        ffn_key: the config's name for one expert's inner width.

    Raises:
        ConversionError: a missing count or width, naming `where` and the key.
    """
    experts = config.get(experts_key) or config.get("num_local_experts")
    topk = config.get("num_experts_per_tok")
    width = config.get(ffn_key)
    for key, value in ((experts_key, experts), ("num_experts_per_tok", topk), (ffn_key, width)):
        if not isinstance(value, int) or value <= 0:
            raise ConversionError(f"{where}: {key}: missing or not a positive integer")
    if topk > experts:
        raise ConversionError(
            f"{where}: num_experts_per_tok {topk} exceeds {experts_key} {experts}"
        )
    return {
        "num_moe_experts": experts,
        "moe_router_topk": topk,
        "moe_ffn_hidden_size": width,
        "moe_router_pre_softmax": not renormalise,
        "moe_aux_loss_coeff": float(config.get("router_aux_loss_coef", 0.0) or 0.0),
    }


def sparse_layers(config: dict[str, Any], where: str) -> list[int] | None:
    """`moe_layer_freq` of a Qwen2-MoE / Qwen3-MoE config.json: layer i has experts when it is
    not in `mlp_only_layers` and (i + 1) is a multiple of `decoder_sparse_step` (as
    `transformers` builds it); None when every layer does.

    Raises:
        ConversionError: a malformed key, or no MoE layer at all, naming `where`.
    """
    layers = config.get("num_hidden_layers")
    step = config.get("decoder_sparse_step")
    step = 1 if step is None else step
    dense = config.get("mlp_only_layers") or []
    if not isinstance(step, int) or step < 1:
        raise ConversionError(f"{where}: decoder_sparse_step: {step!r} is not a positive integer")
    if not isinstance(layers, int) or not all(isinstance(i, int) for i in dense):
        raise ConversionError(f"{where}: mlp_only_layers: {dense!r} is not a list of layer indices")
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    if not any(pattern):
        raise ConversionError(
            f"{where}: decoder_sparse_step {step} / mlp_only_layers {dense}: no layer has experts"
        )
    return None if all(pattern) else pattern


def sparse_layer_fields(arch: GPTArchitecture) -> dict[str, Any]:
    """`decoder_sparse_step` and `mlp_only_layers` that make `sparse_layers` give back
    `arch.moe_layer_freq`: a step when the pattern is every step-th layer, else step 1 and the
    dense layers listed."""
    pattern = arch.moe_layer_freq or [1] * arch.num_layers
    for step in range(1, arch.num_layers + 1):
        if pattern == [int((i + 1) % step == 0) for i in range(arch.num_layers)]:
            return {"decoder_sparse_step": step, "mlp_only_layers": []}
    dense = [i for i, moe in enumerate(pattern) if not moe]
    return {"decoder_sparse_step": 1, "mlp_only_layers": dense}
