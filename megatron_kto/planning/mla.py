"""Multi-latent attention (DeepSeek-V3, `models/mla.py`) in the memory plan: its parameters and
the activations its layers keep for the backward.

Parameters per TP rank, in `MLASelfAttention.named_parameters()` order (n heads, h hidden,
qh = nope + rope query/key head dim, v value head dim, T = TP): `linear_proj` [h, n·v/T];
`linear_q_proj` [n·qh/T, h], or `linear_q_down_proj` [q_lora/T, h] (column-parallel: megatron
gathers its output) and `linear_q_up_proj` [n·qh/T, q_lora]; `linear_kv_down_proj`
[(kv_lora + rope)/T, h]; `linear_kv_up_proj` [n·(nope + v)/T, kv_lora]; the latent norms
[q_lora] and [kv_lora] (replicated).

Activations per token and TP rank, in the compute dtype: the gathered latents and their normed
copies (q_lora, kv_lora + rope and kv_lora, whole on every rank), the up projections' outputs
(n·qh/T queries, n·(nope + v)/T keys and values), the contiguous query, key and value handed to
SDPA (n·qh, n·qh, n·v over T) and its output (n·v/T, the output projection's input).
"""

from __future__ import annotations

from megatron_kto.config.architecture import GPTArchitecture


def mla_param_shapes(arch: GPTArchitecture, tp: int, prefix: str) -> list[tuple[str, int]]:
    """(name, elements on one TP rank) of a layer's MLA parameters, in module order."""
    h, n = arch.hidden_size, arch.num_attention_heads
    qh = arch.qk_nope_head_dim + arch.qk_rope_head_dim
    attn = f"{prefix}self_attention."
    out = [(f"{attn}linear_proj.weight", h * n * arch.v_head_dim // tp)]
    if arch.q_lora_rank is None:
        out.append((f"{attn}linear_q_proj.weight", n * qh // tp * h))
    else:
        out.append((f"{attn}linear_q_down_proj.weight", arch.q_lora_rank // tp * h))
        out.append((f"{attn}linear_q_up_proj.weight", n * qh // tp * arch.q_lora_rank))
    kv_rows = arch.kv_lora_rank + arch.qk_rope_head_dim
    out.append((f"{attn}linear_kv_down_proj.weight", kv_rows // tp * h))
    kv_up = n * (arch.qk_nope_head_dim + arch.v_head_dim) // tp * arch.kv_lora_rank
    out.append((f"{attn}linear_kv_up_proj.weight", kv_up))
    if arch.q_lora_rank is not None:
        out.append((f"{attn}q_layernorm.weight", arch.q_lora_rank))
    out.append((f"{attn}kv_layernorm.weight", arch.kv_lora_rank))
    return out


def mla_largest_weight(arch: GPTArchitecture, tp: int) -> int:
    """Elements of a layer's largest MLA weight on one TP rank (its gradient's transient)."""
    return max(numel for _, numel in mla_param_shapes(arch, tp, ""))


def mla_saved_bytes(arch: GPTArchitecture, tp: int, tokens: int, element: int) -> int:
    """Bytes one MLA layer keeps for the backward for `tokens` tokens (module docstring)."""
    n, v = arch.num_attention_heads, arch.v_head_dim
    qh = arch.qk_nope_head_dim + arch.qk_rope_head_dim
    latents = 2 * (arch.q_lora_rank or 0) + 2 * arch.kv_lora_rank + arch.qk_rope_head_dim
    up = n * qh + n * (arch.qk_nope_head_dim + v)
    sdpa = 2 * n * qh + n * v + n * v
    return tokens * (latents + (up + sdpa) // tp) * element
