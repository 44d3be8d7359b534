"""Gated DeltaNet's two sequence operators through `fla` (flash-linear-attention, Triton) on an
accelerator where it is installed (`pip install .[fla]`; chosen once with the attention backend,
`runtime.attention_backend.deltanet_kernels`, and said at start-up).

The same contract as ours (`models.delta_rule`): [B, T, ...] inputs, and for a packed
micro-batch ([1, T, ...], `seqlens` its rows' host lengths) every row starts from a zero
recurrence state and an empty convolution window — fla's variable-length kernels take the rows'
boundaries as `cu_seqlens` (on the device, plus the host copy `cu_seqlens_cpu` so that fla reads
no lengths back). Calls follow fla 0.5.2's signatures:

    fla.ops.gated_delta_rule.chunk_gated_delta_rule(q, k, v, g, beta, scale=None,
        initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
        cu_seqlens=None, cu_seqlens_cpu=None, cp_context=None, **kwargs) -> (o, final_state)
    fla.modules.conv.causal_conv1d(x, weight=None, bias=None, residual=None,
        initial_state=None, output_final_state=False, activation=None, backend='triton',
        cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, cp_context=None, **kwargs)
        -> (y, final_state)

q, k [B, T, Hk, Dk], v [B, T, Hv, Dv] with value head j reading key head j // (Hv / Hk) (fla's
grouped value attention, as ours), g [B, T, Hv] the log decay, beta [B, T, Hv] after the sigmoid;
the conv's x is [B, T, channels] and its weight [channels, K].
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch


def cu_seqlens(
    seqlens: Sequence[int] | None, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(row boundaries on `device`, the same on the host) as int64 [rows + 1]; (None, None) for
    an unpacked micro-batch."""
    if seqlens is None:
        return None, None
    host = torch.tensor([0, *itertools.accumulate(seqlens)], dtype=torch.long)
    return host.to(device, non_blocking=True), host


def fla_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    seqlens: Sequence[int] | None = None,
    qk_l2norm: bool = True,
) -> torch.Tensor:
    """`delta_rule.chunk_gated_delta_rule` by fla's chunked kernel: [B, T, Hv, Dv]."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    device_cu, host_cu = cu_seqlens(seqlens, query.device)
    out, _ = chunk_gated_delta_rule(
        query,
        key,
        value,
        g,
        beta,
        scale=query.shape[-1] ** -0.5,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=qk_l2norm,
        cu_seqlens=device_cu,
        cu_seqlens_cpu=host_cu,
    )
    return out.to(value.dtype)


def fla_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    seqlens: Sequence[int] | None = None,
) -> torch.Tensor:
    """`delta_rule.causal_depthwise_conv` (with its SiLU) by fla's causal convolution."""
    from fla.modules.conv import causal_conv1d

    device_cu, host_cu = cu_seqlens(seqlens, x.device)
    out, _ = causal_conv1d(
        x,
        weight=weight,
        bias=bias,
        activation="silu",
        cu_seqlens=device_cu,
        cu_seqlens_cpu=host_cu,
    )
    return out.to(x.dtype)
