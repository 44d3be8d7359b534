"""Multi-latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight): megatron-core's own
`MLASelfAttention` with our norms and SDPA core attention.

What megatron-core computes, and why it equals `transformers`' DeepseekV3Attention:

* queries: `linear_q_proj` (HF `q_proj`), or `linear_q_down_proj` -> `q_layernorm` ->
  `linear_q_up_proj` (HF `q_a_proj` -> `q_a_layernorm` -> `q_b_proj`); each head's
  `qk_nope_head_dim` un-rotated dims, then its `qk_rope_head_dim` rotated ones;
* keys/values: `linear_kv_down_proj` (HF `kv_a_proj_with_mqa`) gives the latent and one rotated
  key shared by all heads; the latent goes through `kv_layernorm` (HF `kv_a_layernorm`) and
  `linear_kv_up_proj` (HF `kv_b_proj`: per head the nope key dims, then the value dims);
* decoupled RoPE on interleaved pairs: megatron's MLA RoPE (`multi_latent_attention=True` in
  `rope_utils`) gathers the even then the odd dims and rotates halves — transformers'
  `rope_interleave` computes exactly that (same output order), so the checkpoint's weights are
  used as stored. A config with `rope_interleave: false` is refused (conversion);
* YaRN: the inverse frequencies with the correction range rounded (HF `truncate: true`), the
  cos/sin scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim), and the softmax
  scale (nope + rope)^-0.5 x mscale(factor, mscale_all_dim)^2 — `transformers`' formulas;
* the q_a / kv_a norms have epsilon 1e-6 whatever `rms_norm_eps` says (transformers builds them
  with DeepseekV3RMSNorm's default), hence `LatentNorm`.

Tensor parallelism: megatron-core's local spec splits `linear_kv_down_proj` by output rows
and gathers its output; the gather's backward only splits the gradient, but the rotated key
(`qk_rope_head_dim` columns, one head shared by every query head) is consumed on every TP rank
by that rank's heads, so its gradient must be summed over TP — `LatentSelfAttention` does that.
Everything else is complete per rank: the latent goes through `linear_kv_up_proj` (and the
query latent through `linear_q_up_proj`), whose input copies all-reduce the gradient, and the
q / kv latent norms' weights are marked `sequence_parallel` for the all-reduce under SP.
A LoRA adapter on `linear_kv_down_proj` (`peft.lora.attach`, HF `kv_a_proj_with_mqa`) adds its
term to this rank's output rows before the gathering hook runs (its B split like the base's
rows), so the gathered latent and rotated key include it and the key's gradient is summed
for the adapter as for the base.

Core attention (megatron-core builds it with `k_channels` nope + rope, `v_channels`
`v_head_dim` and the YaRN `softmax_scale`): `SDPAttention` ('sdpa'), or megatron-core's
`TEDotProductAttention` ('te': Transformer Engine's fused attention, which takes those from TE
1.10, padded and packed, see `runtime/te_latent_attention.py` for where it runs). Either way the
linears and norms are the local spec's above, verified against `transformers`, so checkpoints
move between the two (TE's core attention has no parameters here). megatron's
`DotProductAttention` (no separate value head dim) is not used.

Context parallelism needs nothing here: megatron-core's MLA builds the rotary table of whole rows
and keeps this CP rank's chunks r and 2·CP−1−r of it (padded: `get_pos_emb_on_this_cp_rank`;
packed: per segment of `cu_seqlens_q_padded` in its unfused THD RoPE, the one it runs without
`apply_rope_fusion`), YaRN's mscale included — the chunks `models.context_parallel` gives the
rank — and `SDPAttention`'s CP path gathers the per-head keys and values whatever their head dims.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.models.attention import SDPAttention
from megatron_kto.models.norms import LocalNorm

#: transformers' DeepseekV3RMSNorm default epsilon, which its q_a / kv_a norms keep.
LATENT_NORM_EPS = 1e-6


class LatentNorm(LocalNorm):
    """MLA's query / key-value latent RMSNorm: epsilon `LATENT_NORM_EPS`, not the model's."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **kw: Any):
        super().__init__(config, hidden_size, eps=LATENT_NORM_EPS, **kw)


def _gather_with_shared_key_gradient(module: torch.nn.Module, args: Any, result: tuple) -> tuple:
    """Forward hook of `linear_kv_down_proj` (HF `kv_a_proj_with_mqa`, column-parallel): its
    output gathered over TP, with the rotated key's gradient summed over TP.

    megatron-core 0.16.1 gathers a split output itself and then only splits the gradient, so
    the shared rotated key kept this rank's heads' part alone. A full-width output makes it take
    its unsplit path: without sequence parallelism the key goes on as it is (the copy here sums
    its gradient); with it, the output is scattered back over the sequence and megatron-core
    gathers the key again, whose backward reduce-scatter sums the gradient.
    """
    output, bias = result
    group = module.tp_group
    if group.size() == 1:
        return result
    output = gather_from_tensor_model_parallel_region(output, group=group)
    if module.sequence_parallel:
        return scatter_to_sequence_parallel_region(output, group=group), bias
    rope = module.config.qk_pos_emb_head_dim
    key = copy_to_tensor_model_parallel_region(output[..., -rope:], group=group)
    return torch.cat([output[..., :-rope], key], dim=-1), bias


class LatentSelfAttention(MLASelfAttention):
    """megatron-core's `MLASelfAttention` whose rotated key's gradient is summed over TP
    (`_gather_with_shared_key_gradient`); the same modules, parameters and names."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.linear_kv_down_proj.register_forward_hook(_gather_with_shared_key_gradient)


def mla_transformer_config(arch: GPTArchitecture) -> dict[str, Any]:
    """`MLATransformerConfig` fields of an MLA architecture (empty for any other)."""
    if not arch.multi_latent_attention:
        return {}
    yarn = arch.position_embedding_type == "yarn"
    return dict(
        multi_latent_attention=True,
        q_lora_rank=arch.q_lora_rank,
        kv_lora_rank=arch.kv_lora_rank,
        qk_head_dim=arch.qk_nope_head_dim,
        qk_pos_emb_head_dim=arch.qk_rope_head_dim,
        v_head_dim=arch.v_head_dim,
        rope_type="yarn" if yarn else "rope",
        rotary_base=arch.rotary_base,
        rotary_scaling_factor=arch.rope_scaling_factor if yarn else 1.0,
        original_max_position_embeddings=arch.yarn_original_max_position_embeddings
        or arch.encoder_seq_length,
        beta_fast=arch.yarn_beta_fast,
        beta_slow=arch.yarn_beta_slow,
        # megatron's defaults (1, 0) give the attention factor mscale(factor) and no softmax
        # correction: transformers' result when the config states neither.
        mscale=1.0 if arch.yarn_mscale is None else arch.yarn_mscale,
        mscale_all_dim=arch.yarn_mscale_all_dim or 0.0,
    )


def _no_te_linear_when_absent() -> None:
    """megatron-core 0.16.1 bug (not CPU-specific): without Transformer Engine its
    `multi_latent_attention` module still sets `HAVE_TE` (the TE extension imports, with mock
    stand-ins for TE's classes), and `MultiLatentAttention.__init__` then calls
    `isinstance(self.linear_proj, TELinear)` on a mock: TypeError for every MLA layer. Say that
    TE is absent there: the check is only for TE's fp8 linear layers."""
    from megatron.core.transformer import multi_latent_attention

    if not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.HAVE_TE = False


def mla_layer_spec(normalization: str, backend: str) -> ModuleSpec:
    """megatron-core's local MLA transformer layer with our norms; core attention `SDPAttention`
    ('sdpa') or TE's `TEDotProductAttention` ('te').

    Raises:
        ValueError: another backend (one line naming the key).
    """
    if backend not in ("sdpa", "te"):
        raise ValueError(
            f"model.attention_backend: {backend!r} cannot run multi-latent attention (DeepSeek-V3: "
            "a value head dim of its own); set model.attention_backend=sdpa (or auto, te)"
        )
    _no_te_linear_when_absent()
    if backend == "te":
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        core_attention = TEDotProductAttention
    else:
        core_attention = SDPAttention
    spec = get_gpt_layer_local_spec(normalization=normalization, multi_latent_attention=True)
    layer = spec.submodules
    attention = layer.self_attention
    submodules = dataclasses.replace(
        attention.submodules,
        core_attention=core_attention,
        q_layernorm=LatentNorm,
        kv_layernorm=LatentNorm,
    )
    layer = dataclasses.replace(
        layer,
        input_layernorm=LocalNorm,
        pre_mlp_layernorm=LocalNorm,
        self_attention=dataclasses.replace(
            attention, module=LatentSelfAttention, submodules=submodules
        ),
    )
    return dataclasses.replace(spec, submodules=layer)
