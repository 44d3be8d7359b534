"""Which megatron-core layer spec a model is built with (`model.attention_backend`).

| backend | layer modules                                   | attention                        |
|---------|-------------------------------------------------|----------------------------------|
| `te`    | Transformer Engine spec (fused norm + linear)   | TE's fused attention             |
| `sdpa`  | megatron-core local spec, `LocalNorm` norms     | `SDPAttention` (torch SDPA)      |
| `local` | megatron-core local spec, `LocalNorm` norms     | megatron's `DotProductAttention` |

`auto` is decided by `runtime.attention_backend.choose_attention_backend` (precision, packing,
Transformer Engine version, context parallelism, head dim).
`sdpa` and `local` have the same parameters and state-dict keys (core attention has none), so
checkpoints move freely between them.

For the non-TE specs the norms (per layer and the final one) are ours (`models/norms.py`): the
same kernels as megatron's `WrappedTorchNorm`, plus sequence-parallel support; so is the
self-attention module (`models/packed_rope.py`): megatron's `SelfAttention`, except that a packed
micro-batch's RoPE on the unfused path (no `apply_rope_fusion`) reads no `cu_seqlens` on the host.
"""

from __future__ import annotations

import dataclasses

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_kto.models.attention import SDPAttention
from megatron_kto.models.gemma_layers import GemmaSelfAttention, LayerExtras, PostNormMLP
from megatron_kto.models.layer_options import extend_local_layer
from megatron_kto.models.mla import mla_layer_spec
from megatron_kto.models.norms import LocalNorm
from megatron_kto.models.packed_rope import PackedRoPESelfAttention


def local_layer_spec(
    normalization: str, attention: str, extras: LayerExtras = LayerExtras()
) -> ModuleSpec:
    """megatron-core's local transformer-layer spec with our norms and the chosen core attention.

    Args:
        normalization: 'RMSNorm' or 'LayerNorm'.
        attention: 'sdpa' (`SDPAttention`) or 'local' (megatron's `DotProductAttention`).
        extras: post-norms and a local RoPE base (`models.gemma_layers`), when the model has them.
    """
    spec = get_gpt_layer_local_spec(normalization=normalization)
    layer = spec.submodules
    self_attention = layer.self_attention
    attn_submodules = self_attention.submodules
    if attention == "sdpa":
        attn_submodules = dataclasses.replace(attn_submodules, core_attention=SDPAttention)
    # dataclasses.replace keeps everything else, including the sharded_state_dict_keys_map that
    # names the norms as TE's fused layer-norm weights in checkpoints.
    self_attention = dataclasses.replace(
        self_attention, module=PackedRoPESelfAttention, submodules=attn_submodules
    )
    mlp = layer.mlp
    if extras:
        params = {"post_norm": extras.post_norms, "local_rotary": extras.local_rotary}
        self_attention = dataclasses.replace(
            self_attention, module=GemmaSelfAttention, params={**self_attention.params, **params}
        )
        if extras.post_norms:
            mlp = dataclasses.replace(mlp, module=PostNormMLP)
    layer = dataclasses.replace(
        layer,
        input_layernorm=LocalNorm,
        pre_mlp_layernorm=LocalNorm,
        self_attention=self_attention,
        mlp=mlp,
    )
    return dataclasses.replace(spec, submodules=layer)


def decoder_block_spec(
    config: TransformerConfig,
    normalization: str,
    backend: str,
    vp_stage: int | None,
    extras: LayerExtras = LayerExtras(),
) -> ModuleSpec | TransformerBlockSubmodules:
    """The decoder spec `GPTModel` is built with, for this pipeline (and virtual) stage.

    Args:
        config: the model's transformer config.
        normalization: 'RMSNorm' or 'LayerNorm'.
        backend: a resolved backend ('te', 'sdpa' or 'local').
        vp_stage: virtual pipeline stage of the chunk, None without interleaving.
        extras: post-norms / local RoPE base (local specs only: `attention_backend` keeps such
            models off TE).

    Returns:
        TE: megatron's TE layer spec (its block adds TE's final norm); for an MoE model with
        dense layers (`config.moe_layer_freq` a list with a 0), the block's submodules: this
        stage's TE MoE and dense layers and `TENorm`. Otherwise the block's submodules with this
        stage's layers (MoE or dense by their global layer number) and a `LocalNorm` final norm —
        given as a layer spec, megatron would pick the final norm itself (`TENorm` whenever TE is
        merely importable).
    """
    pattern = config.moe_layer_freq if isinstance(config.moe_layer_freq, list) else None
    mixed = bool(config.num_moe_experts) and pattern is not None and 0 in pattern
    if backend == "te":
        if extras:
            raise ValueError(
                "model.attention_backend: 'te' has no post-norms or per-layer RoPE base "
                "(Gemma 3); set model.attention_backend=sdpa (or auto)"
            )
        experts = config.num_moe_experts
        layer = get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=bool(experts), qk_layernorm=config.qk_layernorm
        )
        if not mixed:
            return layer
        from megatron.core.extensions.transformer_engine import TENorm

        dense = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
        layers = _stage_layers(config, vp_stage, layer, dense, pattern)
        return TransformerBlockSubmodules(layer_specs=layers, layer_norm=TENorm)
    if getattr(config, "multi_latent_attention", False):
        local = mla_layer_spec(normalization, backend)
    else:
        local = local_layer_spec(normalization, backend, extras)
    layer = extend_local_layer(local, config)
    if not mixed:  # every layer has one spec: only the count per stage matters
        count = get_num_layers_to_build(config, vp_stage=vp_stage)
        return TransformerBlockSubmodules(layer_specs=[layer] * count, layer_norm=LocalNorm)
    dense = extend_local_layer(local, config, moe=False)
    layers = _stage_layers(config, vp_stage, layer, dense, pattern)
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=LocalNorm)


def _stage_layers(
    config: TransformerConfig,
    vp_stage: int | None,
    moe: ModuleSpec,
    dense: ModuleSpec,
    pattern: list[int],
) -> list[ModuleSpec]:
    """This stage's layer specs when some layers are dense: `pattern` (`moe_layer_freq`, one 0/1
    per layer of the whole model) read at the stage's global layer numbers, as megatron's
    `get_gpt_decoder_block_spec` does."""
    first = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    return [moe if pattern[first + i] else dense for i in range(count)]
