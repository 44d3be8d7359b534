"""Our gated delta rule and causal depthwise convolution (`models/delta_rule.py`) against
`transformers`' torch references (Qwen3-Next), values and gradients in fp32, and packed rows
against the same rows run one by one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_kto.models.delta_rule import causal_depthwise_conv, chunk_gated_delta_rule

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


def _inputs(t: int, b: int = 2, hk: int = 2, hv: int = 4, dk: int = 8, dv: int = 6, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, hk, dk, generator=gen)
    k = torch.randn(b, t, hk, dk, generator=gen)
    v = torch.randn(b, t, hv, dv, generator=gen)
    # Decays as the model makes them: -exp(A_log) * softplus(a + dt_bias), some strong.
    g = (
        -torch.rand(b, t, hv, generator=gen)
        * 2.0
        * F.softplus(torch.randn(b, t, hv, generator=gen))
    )
    beta = torch.rand(b, t, hv, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def _grads(out: torch.Tensor, inputs: list[torch.Tensor], seed: int = 1) -> list[torch.Tensor]:
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad((out * weight).sum(), inputs)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("t,chunk", [(37, 16), (64, 64), (50, 8), (5, 64), (70, 32), (33, 1)])
def test_delta_rule_equals_transformers_values_and_gradients(t: int, chunk: int) -> None:
    """Outputs and input gradients equal HF's chunked torch reference at the same chunk size
    (rows not multiples of the chunk, grouped value heads) and its token-by-token recurrence."""
    inputs = _inputs(t)
    ours = chunk_gated_delta_rule(*inputs, chunk_size=chunk)
    ref, _ = qwen3_next.torch_chunk_gated_delta_rule(
        *inputs, chunk_size=chunk, use_qk_l2norm_in_kernel=True
    )
    assert _rel(ours, ref) < 1e-5
    for a, b in zip(_grads(ours, inputs), _grads(ref, inputs)):
        assert _rel(a, b) < 1e-5
    token, _ = qwen3_next.torch_recurrent_gated_delta_rule(*inputs, use_qk_l2norm_in_kernel=True)
    assert _rel(ours, token) < 1e-5


def test_delta_rule_chunk_size_does_not_change_the_result() -> None:
    inputs = _inputs(45)
    outs = [chunk_gated_delta_rule(*inputs, chunk_size=c) for c in (1, 4, 16, 64)]
    for out in outs[1:]:
        assert _rel(out, outs[0]) < 1e-5


def test_packed_rows_equal_rows_one_by_one() -> None:
    """A packed [1, T] micro-batch equals each row run alone; the same packed input run as ONE
    sequence differs (the check fails if the state leaked across row boundaries)."""
    seqlens = [13, 1, 40, 7]
    inputs = _inputs(sum(seqlens), b=1, seed=3)
    packed = chunk_gated_delta_rule(*inputs, chunk_size=16, seqlens=seqlens)
    alone, start = [], 0
    for n in seqlens:
        alone.append(
            chunk_gated_delta_rule(*(x[:, start : start + n] for x in inputs), chunk_size=16)
        )
        start += n
    alone = torch.cat(alone, dim=1)
    assert _rel(packed, alone) < 1e-6
    for a, b in zip(_grads(packed, inputs), _grads(alone, inputs)):
        assert _rel(a, b) < 1e-6
    leaked = chunk_gated_delta_rule(*inputs, chunk_size=16)
    assert _rel(leaked[:, 13:], alone[:, 13:]) > 1e-2


def test_conv_equals_transformers_and_restarts_per_row() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 23, 12, generator=gen, requires_grad=True)
    w = torch.randn(12, 4, generator=gen, requires_grad=True)
    ours = causal_depthwise_conv(x, w)
    ref = qwen3_next.causal_conv1d_fn(x.transpose(1, 2), w, None, activation="silu").transpose(1, 2)
    assert _rel(ours, ref) < 1e-6
    for a, b in zip(_grads(ours, [x, w]), _grads(ref, [x, w])):
        assert _rel(a, b) < 1e-6

    seqlens = [5, 2, 9, 1, 6]
    flat = x[:1]
    packed = causal_depthwise_conv(flat, w, seqlens=seqlens)
    alone = torch.cat([causal_depthwise_conv(r, w) for r in flat.split(seqlens, dim=1)], dim=1)
    assert _rel(packed, alone) < 1e-7
    leaked = causal_depthwise_conv(flat, w)
    assert _rel(leaked, alone) > 1e-2
