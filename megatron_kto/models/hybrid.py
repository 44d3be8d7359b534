"""Hybrid linear-attention decoders (Qwen3-Next, Qwen3.5): gated DeltaNet layers and gated full
attention layers, read from one per-layer list (`GPTArchitecture.linear_attention_freq`,
megatron-core's `linear_attention_freq`: 1 DeltaNet, 0 full attention).

* DeltaNet layers: `models.gated_delta_net.PortableGatedDeltaNet` (megatron-core's parameters,
  our portable forward) with a separate input norm (the local spec; TE's spec fuses it into
  `in_proj`, whose checkpoint name the local one is mapped to).
* Full attention layers: megatron-core's `SelfAttention` (ours: `PackedRoPESelfAttention`) with
  `attention_output_gate` (per query group [queries | gates | key | value] in `linear_qkv`; the
  output times sigmoid(gate) before `linear_proj`), partial RoPE (`rotary_percent`) and Q/K norms.
* Norms: with `zero_centered_norms` (Qwen's (1 + weight) RMSNorm, megatron's
  `layernorm_zero_centered_gamma`) every layer, final and Q/K norm is `norms.LocalNorm` scaling by
  (1 + weight); the DeltaNet output norm keeps a plain weight.

Context parallelism is refused: nothing splits a DeltaNet recurrence over ranks yet.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.models.gated_delta_net import PortableGatedDeltaNet
from megatron_kto.models.layer_options import extend_local_layer
from megatron_kto.models.layer_specs import local_layer_spec
from megatron_kto.models.norms import LocalNorm

logger = logging.getLogger(__name__)


def uses_hybrid_spec(arch: GPTArchitecture) -> bool:
    """Whether `arch` is built by `hybrid_block_spec` (DeltaNet layers or Qwen's offset norms)."""
    return arch.has_linear_attention() or arch.attention_output_gate


def hybrid_transformer_config(arch: GPTArchitecture, context_parallel_size: int) -> dict[str, Any]:
    """The `TransformerConfig` fields of a hybrid architecture (empty for any other).

    Raises:
        ValueError: context parallelism with DeltaNet layers (one line naming them).
    """
    if not uses_hybrid_spec(arch):
        return {}
    fields: dict[str, Any] = dict(
        attention_output_gate=arch.attention_output_gate,
    )
    if not arch.has_linear_attention():
        return fields
    layers = [i for i in range(arch.num_layers) if arch.is_linear_attention_layer(i)]
    if context_parallel_size != 1:
        raise ValueError(
            f"model.context_parallel_size {context_parallel_size}: gated DeltaNet layers {layers} "
            "cannot be split over context-parallel ranks (set it to 1)"
        )
    return dict(
        fields,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=list(arch.linear_attention_freq),
        linear_conv_kernel_dim=arch.linear_conv_kernel_dim,
        linear_key_head_dim=arch.linear_key_head_dim,
        linear_value_head_dim=arch.linear_value_head_dim,
        linear_num_key_heads=arch.linear_num_key_heads,
        linear_num_value_heads=arch.linear_num_value_heads,
    )


def _deltanet_attention(kernels: str) -> ModuleSpec:
    return ModuleSpec(
        module=PortableGatedDeltaNet,
        params={"kernels": kernels},
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear,
            out_norm=ModuleSpec(module=LocalNorm, params={"zero_centered_gamma": False}),
            out_proj=RowParallelLinear,
        ),
    )


def _with_norms(layer: ModuleSpec, config: TransformerConfig) -> ModuleSpec:
    """`layer` with `LocalNorm` in every norm slot (input, pre-MLP, Q/K)."""
    sub = layer.submodules
    attention = sub.self_attention
    if config.qk_layernorm and attention.module is not PortableGatedDeltaNet:
        attention = dataclasses.replace(
            attention,
            submodules=dataclasses.replace(
                attention.submodules, q_layernorm=LocalNorm, k_layernorm=LocalNorm
            ),
        )
    sub = dataclasses.replace(
        sub,
        input_layernorm=LocalNorm,
        pre_mlp_layernorm=LocalNorm,
        self_attention=attention,
    )
    return dataclasses.replace(layer, submodules=sub)


def hybrid_layer_spec(
    config: TransformerConfig, backend: str, linear: bool, moe: bool, deltanet: str = "torch"
) -> ModuleSpec:
    """One layer: full attention (the backend's local spec) or gated DeltaNet (`deltanet`
    kernels: 'torch' or 'fla', `runtime.attention_backend.deltanet_kernels`), dense or MoE MLP."""
    layer = extend_local_layer(local_layer_spec(config.normalization, backend), config, moe=moe)
    if linear:
        sub = layer.submodules
        # TE's DeltaNet spec fuses the input norm into in_proj: keep that checkpoint name.
        keys = {
            k: v
            for k, v in (sub.sharded_state_dict_keys_map or {}).items()
            if "input_layernorm" not in k
        }
        keys["input_layernorm."] = "self_attention.in_proj.layer_norm_"
        sub = dataclasses.replace(
            sub, self_attention=_deltanet_attention(deltanet), sharded_state_dict_keys_map=keys
        )
        layer = dataclasses.replace(layer, submodules=sub)
    return _with_norms(layer, config)


def hybrid_block_spec(
    config: TransformerConfig, backend: str, vp_stage: int | None, deltanet: str = "torch"
) -> TransformerBlockSubmodules:
    """This (virtual) pipeline stage's layers, each from its global layer number's kinds
    (`deltanet`: the DeltaNet layers' kernels)."""
    if backend == "te":
        # No TE spec is written for these layers yet; the local spec runs everywhere.
        logger.warning("hybrid DeltaNet model: full-attention layers use sdpa, not te")
        backend = "sdpa"
    pattern = config.linear_attention_freq or [0] * config.num_layers
    moe_freq = config.moe_layer_freq if isinstance(config.moe_layer_freq, list) else None
    first = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    layers = []
    for i in range(first, first + count):
        moe = bool(config.num_moe_experts) and (moe_freq is None or bool(moe_freq[i]))
        layers.append(hybrid_layer_spec(config, backend, bool(pattern[i]), moe, deltanet))
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=LocalNorm)


__all__ = [
    "hybrid_block_spec",
    "hybrid_transformer_config",
    "uses_hybrid_spec",
]
