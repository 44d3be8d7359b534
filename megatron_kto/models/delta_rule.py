"""Gated DeltaNet's two sequence operators in plain PyTorch (CPU, and CUDA without `fla` /
`causal_conv1d`): the chunked gated delta rule and the causal depthwise short convolution.

Both take the rows of a packed micro-batch (`seqlens`: host lengths of the segments laid end to
end in one [1, T] row) and restart at every row boundary — the recurrence state and the
convolution window of a row never see the previous row.

The gated delta rule (per value head; state S is [Dk, Dv], token t has q_t, k_t, v_t, a decay
g_t <= 0 in log space and a write strength beta_t):

    S'_t = exp(g_t) S_{t-1}
    S_t  = S'_t + k_t (beta_t (v_t - S'_t^T k_t))^T
    o_t  = S_t^T q_t / sqrt(Dk)

Chunked form (chunk of C tokens entering with state S0, Γ = the in-chunk cumulative sum of g):
the written deltas U (rows u_t = beta_t (v_t - S'_t^T k_t)) solve a unit lower-triangular system

    (I + A) U = beta V - diag(beta exp(Γ)) K S0,   A_tj = beta_t exp(Γ_t - Γ_j) k_t.k_j  (j < t)

so U = W_v - W_k S0 with W_v, W_k from one triangular solve per chunk (independent of S0, all
chunks at once); then O = diag(exp(Γ)) Q S0 + (Q K^T ∘ exp(Γ_t - Γ_j), j <= t) U and the state
leaving the chunk is exp(Γ_C) S0 + (K ∘ exp(Γ_C - Γ))^T U. Only this last pair of products runs
chunk after chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

#: Chunk length of the scan (fla's and transformers' default).
DEFAULT_CHUNK_SIZE = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (the normalisation of fla and HF)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _row_layout(
    seqlens: Sequence[int], multiple: int, device: torch.device
) -> tuple[int, torch.Tensor]:
    """Width of the row-batched layout (longest row rounded up to `multiple`) and the flat index
    of every packed position in the [rows × width] layout (row r's tokens start at r × width)."""
    width = -(-max(seqlens) // multiple) * multiple
    index = [r * width + i for r, n in enumerate(seqlens) for i in range(n)]
    return width, torch.tensor(index, dtype=torch.long).to(device, non_blocking=True)


def _to_rows(x: torch.Tensor, index: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """[1, T, ...] packed -> [rows, width, ...], zeros after each row's end."""
    flat = x.new_zeros((rows * width, *x.shape[2:]))
    flat = flat.index_copy(0, index, x[0])
    return flat.view(rows, width, *x.shape[2:])


def _from_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[rows, width, ...] -> [1, T, ...] (inverse of `_to_rows` on the packed positions)."""
    return x.reshape(-1, *x.shape[2:]).index_select(0, index).unsqueeze(0)


def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    seqlens: Sequence[int] | None = None,
    qk_l2norm: bool = True,
) -> torch.Tensor:
    """The gated delta rule over whole sequences from a zero state, computed in fp32.

    Args:
        query, key: [B, T, Hk, Dk].
        value: [B, T, Hv, Dv]; Hv a multiple of Hk (value head j reads key head j // (Hv/Hk)).
        g: [B, T, Hv] log decay (<= 0).
        beta: [B, T, Hv] write strength.
        chunk_size: tokens per chunk (any positive length; the result does not depend on it
            beyond fp32 round-off).
        seqlens: lengths of the rows packed end to end (B must be 1 and they must sum to T);
            every row starts from a zero state. None: each of the B sequences is one row.
        qk_l2norm: L2-normalise queries and keys per head first (Qwen3-Next / Qwen3.5 do).

    Returns:
        [B, T, Hv, Dv] outputs in the dtype of `query`.
    """
    dtype = query.dtype
    if value.shape[2] % key.shape[2]:
        raise ValueError(
            f"value heads {value.shape[2]} must be a multiple of key heads {key.shape[2]}"
        )
    q, k, v, g, beta = (x.float() for x in (query, key, value, g, beta))
    if qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    group = v.shape[2] // k.shape[2]
    if group > 1:
        q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    q = q * q.shape[-1] ** -0.5
    if seqlens is not None:
        if q.shape[0] != 1 or sum(seqlens) != q.shape[1]:
            raise ValueError(
                f"packed rows need one [1, T] row with T = sum(seqlens) = {sum(seqlens)}; got "
                f"{tuple(q.shape[:2])}"
            )
        width, index = _row_layout(seqlens, chunk_size, q.device)
        q, k, v, g, beta = (_to_rows(x, index, len(seqlens), width) for x in (q, k, v, g, beta))
        out = _chunked_scan(q, k, v, g, beta, chunk_size)
        return _from_rows(out, index).to(dtype)
    return _chunked_scan(q, k, v, g, beta, chunk_size).to(dtype)


def _chunked_scan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, c: int
) -> torch.Tensor:
    """The chunked recurrence on fp32 [B, T, H, D] inputs (q already scaled), zero initial state.

    Trailing padding to a multiple of `c` is zeros: k = v = beta = g = 0 leaves the state alone,
    and causality keeps it out of every real position's output anyway.
    """
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    pad = -t % c
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    n = (t + pad) // c
    # -> [B, H, N, C, ...]
    q, k, v = (x.view(b, n, c, h, -1).permute(0, 3, 1, 2, 4) for x in (q, k, v))
    g, beta = (x.view(b, n, c, h).permute(0, 3, 1, 2) for x in (g, beta))

    cum = g.cumsum(-1)  # Γ
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    # exp(Γ_t - Γ_j) for j <= t; the upper triangle is masked before exp (it could overflow).
    gap = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    strict = (beta.unsqueeze(-1) * (k @ k.transpose(-1, -2)) * gap).tril(-1)
    rhs = torch.cat((beta.unsqueeze(-1) * v, (beta * cum.exp()).unsqueeze(-1) * k), dim=-1)
    w = torch.linalg.solve_triangular(strict, rhs, upper=False, unitriangular=True)
    w_v, w_k = w.split((dv, dk), dim=-1)
    scores = (q @ k.transpose(-1, -2)) * gap  # [B, H, N, C, C], j <= t
    q_in = q * cum.exp().unsqueeze(-1)  # reads the entering state
    k_out = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)  # writes the leaving state
    carry = cum[..., -1].exp()  # [B, H, N]

    state = q.new_zeros(b, h, dk, dv)
    outs = []
    for i in range(n):
        u = w_v[:, :, i] - w_k[:, :, i] @ state
        outs.append(q_in[:, :, i] @ state + scores[:, :, i] @ u)
        state = carry[:, :, i, None, None] * state + k_out[:, :, i].transpose(-1, -2) @ u
    out = torch.stack(outs, dim=2)  # [B, H, N, C, Dv]
    return out.permute(0, 2, 3, 1, 4).reshape(b, n * c, h, dv)[:, :t]


def causal_depthwise_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    seqlens: Sequence[int] | None = None,
    activation: bool = True,
) -> torch.Tensor:
    """Causal depthwise convolution along the sequence, each channel with its own kernel:
    out[t, c] = sum_i weight[c, i] x[t - (K-1) + i, c] (positions before the row start are 0),
    then SiLU when `activation`.

    Args:
        x: [B, T, channels].
        weight: [channels, K] (an `nn.Conv1d(groups=channels)` weight squeezed).
        bias: [channels] or None.
        seqlens: rows packed end to end in a [1, T] x: the window restarts at every row.
        activation: apply SiLU (Qwen3-Next's conv activation).

    Returns:
        [B, T, channels], dtype of x.
    """
    t, width = x.shape[1], weight.shape[-1]
    xw = x.to(weight.dtype)
    if seqlens is not None:
        if x.shape[0] != 1 or sum(seqlens) != t:
            raise ValueError(
                f"packed rows need one [1, T] row with T = sum(seqlens) = {sum(seqlens)}"
            )
        offset = torch.tensor([i for n in seqlens for i in range(n)], dtype=torch.long)
    else:
        offset = torch.arange(t)
    offset = offset.to(x.device, non_blocking=True)
    out = xw * weight[:, -1]
    for back in range(1, min(width, t)):
        # x[t - back] counts only where it is inside the same row (offset in row >= back).
        shifted = F.pad(xw[:, :-back], (0, 0, back, 0))
        keep = (offset >= back).to(xw.dtype).unsqueeze(-1)
        out = out + shifted * keep * weight[:, width - 1 - back]
    if bias is not None:
        out = out + bias
    if activation:
        out = F.silu(out)
    return out.to(x.dtype)
