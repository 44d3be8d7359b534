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

Core attention is `SDPAttention` (key head dim nope + rope, value head dim `v_head_dim`). The
TE spec and megatron's `DotProductAttention` (no separate value head dim) are not used.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
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
    """megatron-core's local MLA transformer layer with our norms and `SDPAttention`.

    Raises:
        ValueError: a backend other than 'sdpa' (one line naming the key).
    """
    if backend != "sdpa":
        raise ValueError(
            f"model.attention_backend: {backend!r} cannot run multi-latent attention (DeepSeek-V3: "
            "a value head dim of its own); set model.attention_backend=sdpa (or auto)"
        )
    _no_te_linear_when_absent()
    spec = get_gpt_layer_local_spec(normalization=normalization, multi_latent_attention=True)
    layer = spec.submodules
    attention = layer.self_attention
    submodules = dataclasses.replace(
        attention.submodules,
        core_attention=SDPAttention,
        q_layernorm=LatentNorm,
        kv_layernorm=LatentNorm,
    )
    layer = dataclasses.replace(
        layer,
        input_layernorm=LocalNorm,
        pre_mlp_layernorm=LocalNorm,
        self_attention=dataclasses.replace(attention, submodules=submodules),
    )
    return dataclasses.replace(spec, submodules=layer)
