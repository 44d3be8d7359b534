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

Gemma 3 on TE (`te_gemma_layer`): megatron's TE layer with our Gemma modules where TE has no
slot — `GemmaSelfAttention` (post-norm, local RoPE base; megatron's `SelfAttention` otherwise, so
TE's `TEDotProductAttention` gets the window per layer and `query_pre_attn_scalar` as its
`softmax_scale` from the config) and `PostNormMLP`. TE keeps its fusions where the math is
Gemma's: `TELayerNormColumnParallelLinear`'s RMSNorm with `zero_centered_gamma` (from
`layernorm_zero_centered_gamma`) scales by (1 + γ) in fp32 (TE's `rmsnorm_fwd_kernels.cuh`:
`g += 1` then `g · rs · x` in the compute type), which is Gemma's `(1 + w)` norm and our
`LocalNorm`'s; so is TE's final `TENorm`. The Q/K and post-norms are our `LocalNorm`
(`PostNorm`), as on the local spec. Checkpoint keys are those of the local spec: the fused
pre-norms are `linear_qkv.layer_norm_weight` / `linear_fc1.layer_norm_weight` in both (the local
spec's key map), the other norms are the same modules; so a run resumes across backends.
"""

from __future__ import annotations

import dataclasses

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.mlp import MLP
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


def te_gemma_layer(layer: ModuleSpec, extras: LayerExtras, qk_layernorm: bool) -> ModuleSpec:
    """megatron's TE layer spec with Gemma 3's post-norms and local RoPE base (module docstring).

    Args:
        layer: megatron-core's TE layer spec (dense: its MLP is megatron's `MLP`).
        extras: the model's `LayerExtras`.
        qk_layernorm: the model has Q/K norms (`LocalNorm`, as on the local spec).
    """
    sub = layer.submodules
    attn = sub.self_attention
    attn_sub = attn.submodules
    if qk_layernorm:
        attn_sub = dataclasses.replace(attn_sub, q_layernorm=LocalNorm, k_layernorm=LocalNorm)
    params = {"post_norm": extras.post_norms, "local_rotary": extras.local_rotary}
    attn = dataclasses.replace(
        attn, module=GemmaSelfAttention, submodules=attn_sub, params={**attn.params, **params}
    )
    mlp = sub.mlp
    if extras.post_norms:
        if mlp.module is not MLP:
            raise ValueError(
                "model.post_norms: Transformer Engine's layer has no post-norm for this MLP "
                f"({getattr(mlp.module, '__name__', mlp.module)}); set "
                "model.attention_backend=sdpa"
            )
        mlp = dataclasses.replace(mlp, module=PostNormMLP)
    return dataclasses.replace(
        layer, submodules=dataclasses.replace(sub, self_attention=attn, mlp=mlp)
    )


def te_layer_with_local_experts(
    layer: ModuleSpec, config: TransformerConfig, normalization: str
) -> ModuleSpec:
    """megatron's TE MoE layer spec with the local spec's MoE MLP and pre-MLP norm: biased experts
    (GPT-OSS). megatron-core 0.16.1's `TEGroupedMLP` asserts that biases come without
    `bias_dropout_fusion`, which every CUDA run sets; the local experts (`SequentialMLP`, with
    `layer_options.ExpertRowParallelLinear`) are the ones verified against `transformers`, and
    they keep the local spec's checkpoint keys. Attention stays TE's."""
    local = extend_local_layer(local_layer_spec(normalization, "sdpa"), config).submodules
    sub = layer.submodules
    keys = {k: v for k, v in (sub.sharded_state_dict_keys_map or {}).items() if "pre_mlp" not in k}
    sub = dataclasses.replace(
        sub,
        pre_mlp_layernorm=local.pre_mlp_layernorm,
        mlp=local.mlp,
        sharded_state_dict_keys_map=keys,
    )
    return dataclasses.replace(layer, submodules=sub)


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
        extras: post-norms / local RoPE base (`te_gemma_layer` on TE; dense models only).

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
    latent = getattr(config, "multi_latent_attention", False)
    if backend == "te" and not latent:  # MLA on TE: the local MLA layer, TE's attention (mla.py)
        experts = config.num_moe_experts
        layer = get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=bool(experts), qk_layernorm=config.qk_layernorm
        )
        if extras:
            if experts:
                raise ValueError(
                    "model.post_norms: post-norms or a per-layer RoPE base with experts have no "
                    "Transformer Engine layer here; set model.attention_backend=sdpa"
                )
            return te_gemma_layer(layer, extras, config.qk_layernorm)
        if experts and config.add_bias_linear:
            layer = te_layer_with_local_experts(layer, config, normalization)
        if not mixed:
            return layer
        from megatron.core.extensions.transformer_engine import TENorm

        dense = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
        layers = _stage_layers(config, vp_stage, layer, dense, pattern)
        return TransformerBlockSubmodules(layer_specs=layers, layer_norm=TENorm)
    if latent:
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
