"""A layer's attention half as (parameter name, elements on this TP rank) pairs — full attention
(MLA's through `mla.py`) or a gated DeltaNet — for `model_state`'s parameter lists."""

from __future__ import annotations

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.planning.mla import mla_param_shapes

__all__ = ["attention_shapes", "deltanet_shapes"]


def attention_shapes(arch: GPTArchitecture, tp: int, prefix: str) -> list[tuple[str, int]]:
    """Full attention: output and QKV projections (with `attention_output_gate` a gate per
    query head beside its query: (2n + 2g)·d rows), biases, sinks, Q/K norms, post-norm."""
    heads = arch.num_attention_heads
    groups = arch.num_query_groups or heads
    d = arch.kv_channels or arch.hidden_size // heads
    h, bias = arch.hidden_size, arch.add_bias_linear
    rows = ((2 if arch.attention_output_gate else 1) * heads + 2 * groups) * d // tp
    if arch.multi_latent_attention:  # MLA's down / up projections, latent norms and output
        out = list(mla_param_shapes(arch, tp, prefix))
    else:
        out = [(f"{prefix}self_attention.linear_proj.weight", h * heads * d // tp)]
    if bias:
        out.append((f"{prefix}self_attention.linear_proj.bias", h))
    if not arch.multi_latent_attention:
        out.append((f"{prefix}self_attention.linear_qkv.weight", rows * h))
    if bias or arch.add_qkv_bias:
        out.append((f"{prefix}self_attention.linear_qkv.bias", rows))
    if arch.attention_sinks:  # one logit per query head, split over TP (GPT-OSS)
        out.append((f"{prefix}self_attention.core_attention.softmax_offset", heads // tp))
    if arch.qk_layernorm:  # one [d] norm shared by the heads (Qwen3)
        out.append((f"{prefix}self_attention.q_layernorm.weight", d))
        out.append((f"{prefix}self_attention.k_layernorm.weight", d))
    if arch.post_norms:  # models.gemma_layers: the attention's and the MLP's output norms
        out.append((f"{prefix}self_attention.post_norm.weight", h))
    return out


def deltanet_shapes(arch: GPTArchitecture, tp: int, prefix: str) -> list[tuple[str, int]]:
    """A gated DeltaNet layer (`models.gated_delta_net`), this TP rank's heads: dt_bias and A_log
    [Hv/TP], in_proj [(2·Hk·dk + 2·Hv·dv + 2·Hv)/TP, h], conv1d [(2·Hk·dk + Hv·dv)/TP, 1, K],
    out_norm [dv] (replicated), out_proj [h, Hv·dv/TP]."""
    qk = arch.linear_num_key_heads * arch.linear_key_head_dim
    hv = arch.linear_num_value_heads
    v, h = hv * arch.linear_value_head_dim, arch.hidden_size
    p = f"{prefix}self_attention."
    return [
        (f"{p}dt_bias", hv // tp),
        (f"{p}A_log", hv // tp),
        (f"{p}in_proj.weight", (2 * qk + 2 * v + 2 * hv) // tp * h),
        (f"{p}conv1d.weight", (2 * qk + v) // tp * arch.linear_conv_kernel_dim),
        (f"{p}out_norm.weight", arch.linear_value_head_dim),
        (f"{p}out_proj.weight", h * v // tp),
    ]
