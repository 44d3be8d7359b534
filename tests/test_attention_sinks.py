"""Attention sinks (`model.attention_sinks`, GPT-OSS) in `SDPAttention`, one process, fp32.

A sink is a learned logit sₕ per query head in the softmax denominator with a zero value:
p_j = exp(z_j) / (exp(sₕ) + Σ_k exp(z_k)). Written out here in float64 (scores, the sink as an
extra column, softmax, drop the column), the reference must equal the module's output and its
gradients — the sink logits' included — on padded rows (causal, and with a padding mask), on
packed rows (one call per row: equal to the padded path), and with a sliding window shorter than
the rows. Whole GPT-OSS models against `transformers` are in `test_gpt_oss.py`.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from test_parallel_common import tiny_arch

from megatron_kto.models.attention import SDPAttention
from megatron_kto.models.builder import ParallelLayout, make_transformer_config
from megatron_kto.runtime import init_runtime, teardown

HEADS, GROUPS, DIM = 4, 2, 16
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def runtime():
    rt = init_runtime(1, 1, seed=5)
    yield rt
    teardown()


def _module(window: int | None = None) -> SDPAttention:
    arch = tiny_arch(attention_sinks=True, sliding_window=window, kv_channels=DIM)
    module = SDPAttention(
        config=make_transformer_config(arch, ParallelLayout()),
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
    )
    with torch.no_grad():  # large sinks: they take a visible share of every row's mass
        module.softmax_offset.copy_(torch.tensor([1.5, -2.0, 0.5, 3.0]))
    return module


def _qkv(seq: int, batch: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = ((seq, batch, HEADS, DIM), (seq, batch, GROUPS, DIM), (seq, batch, GROUPS, DIM))
    return [(2 * torch.randn(s, generator=g)).requires_grad_() for s in shapes]


def _reference(q, k, v, sinks, window: int | None = None) -> torch.Tensor:
    """One row: q [s, heads, d], k/v [s, groups, d], sinks [heads] -> [s, heads·d] (float64)."""
    s = q.shape[0]
    k, v = (t.double().repeat_interleave(HEADS // GROUPS, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / DIM**0.5
    i, j = torch.arange(s)[:, None], torch.arange(s)[None]
    seen = (j <= i) & (j > i - window) if window else j <= i
    scores = scores.masked_fill(~seen, float("-inf"))
    column = sinks.double().view(HEADS, 1, 1).expand(HEADS, s, 1)
    probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v).reshape(s, -1).float()


def _grads(*tensors) -> list[torch.Tensor]:
    out = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return out


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "padding_mask"])
@pytest.mark.parametrize("window", [None, 5], ids=["full", "window5"])
def test_padded_rows_equal_the_reference_with_gradients(runtime, masked, window):
    seq, lengths = 12, [12, 7, 9]
    module = _module(window)
    q, k, v = _qkv(seq, len(lengths))
    mask = None
    if masked:  # megatron's convention: True = masked
        pos = torch.arange(seq)
        pad = torch.stack([pos >= n for n in lengths])
        causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        mask = (causal[None] | pad[:, None, :] | pad[:, :, None])[:, None]
    out = module(q, k, v, mask)
    rows = lengths if masked else [seq] * len(lengths)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    sum((out[:n, b] * weights[:n, b]).sum() for b, n in enumerate(rows)).backward()
    got = _grads(q, k, v, module.softmax_offset)
    sinks = module.softmax_offset.detach().clone().requires_grad_()
    total = 0.0
    for b, n in enumerate(rows):
        want = _reference(q[:n, b], k[:n, b], v[:n, b], sinks, window)
        assert (out[:n, b] - want).abs().max() <= TOLERANCE
        total = total + (want * weights[:n, b]).sum()
    total.backward()
    for g, w in zip(got, (q.grad, k.grad, v.grad, sinks.grad)):
        assert (g - w).abs().max() <= TOLERANCE * max(1.0, w.abs().max().item())
    assert got[3].abs().min() > 1e-3  # every sink receives a gradient


@pytest.mark.parametrize("window", [None, 5], ids=["full", "window5"])
def test_packed_rows_equal_the_padded_path(runtime, window):
    """Rows of lengths 12, 1, 4, 9 packed into one micro-batch: every row's output and the
    gradients (inputs and sinks) equal the padded path's, row by row."""
    lengths = [12, 1, 4, 9]
    module = _module(window)
    rows = [_qkv(n, 1, seed=i) for i, n in enumerate(lengths)]
    packed = [torch.cat([r[j][:, 0] for r in rows]).detach().requires_grad_() for j in range(3)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=12, max_seqlen_kv=12
    )
    out = module(*packed, None, packed_seq_params=params)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out * weights).sum().backward()
    (packed_sinks,) = _grads(module.softmax_offset)
    start = 0
    for (q, k, v), n in zip(rows, lengths):
        padded = module(q, k, v, None)[:, 0]
        assert (out[start : start + n] - padded).abs().max() <= TOLERANCE
        (padded * weights[start : start + n]).sum().backward()
        for got, leaf in zip(packed, (q, k, v)):
            assert (got.grad[start : start + n] - leaf.grad[:, 0]).abs().max() <= TOLERANCE
        start += n
    (padded_sinks,) = _grads(module.softmax_offset)
    assert (packed_sinks - padded_sinks).abs().max() <= TOLERANCE


def test_sinks_under_context_parallelism_are_refused():
    """Context parallelism has no sink path: one line naming the key."""
    arch = tiny_arch(attention_sinks=True)
    config = make_transformer_config(arch, ParallelLayout())
    config.context_parallel_size = 2
    with pytest.raises(ValueError, match="model.context_parallel_size > 1 does not support"):
        SDPAttention(
            config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
        )


def test_the_backend_decision_for_sinks():
    """TE's learnable softmax as its sources state it (attention_backend's sink table): `auto`
    takes TE only where cuDNN's fused kernel surely takes sinks (cuDNN 9.13.1; packed: TE 2.12 +
    cuDNN 9.18), else sdpa with the reason; an explicit te runs wherever the unfused path can
    (padded from 2.8, packed from 2.12) and is one line naming the key elsewhere; local and
    context parallelism are refused."""
    from megatron_kto.runtime.attention_backend import AttentionFeatures, choose_attention_backend
    from megatron_kto.runtime.gpu_settings import Accelerator

    def machine(te: str, cudnn: int | None = 91500, **kw) -> Accelerator:
        return Accelerator(cuda=True, transformer_engine=te, cudnn=cudnn, **kw)

    def choose(request: str, accelerator: Accelerator, packed: bool, **kw):
        return choose_attention_backend(
            request,
            precision=kw.pop("precision", "bf16"),
            packed=packed,
            accelerator=accelerator,
            features=AttentionFeatures(head_dim=64, attention_sinks=True),
            **kw,
        )

    te29 = machine("2.9.0", flash_attn=True)
    assert choose("auto", te29, packed=False).backend == "te"
    assert choose("te", te29, packed=False).backend == "te"
    # Packed: no TE backend before 2.12 (flash-attn never takes sinks).
    packed = choose("auto", te29, packed=True)
    assert packed.backend == "sdpa" and "2.12.0 with attention sinks" in packed.reason
    with pytest.raises(ValueError, match=r"^model.attention_backend: 'te' cannot run .*2\.12"):
        choose("te", te29, packed=True)
    # cuDNN before 9.13.1 (or unknown): only the unfused path, which auto does not take.
    old = choose("auto", machine("2.9.0", cudnn=91200), packed=False)
    assert old.backend == "sdpa" and "cuDNN >= 9.13.1" in old.reason
    assert choose("te", machine("2.9.0", cudnn=None), packed=False).backend == "te"
    # fp32: the unfused path only; explicit te runs it padded.
    assert choose("auto", te29, packed=False, precision="32").backend == "sdpa"
    assert choose("te", te29, packed=False, precision="32").backend == "te"
    # 2.12: packed runs fused with cuDNN 9.18, else unfused (explicit only).
    assert choose("auto", machine("2.12.0", cudnn=91800), packed=True).backend == "te"
    assert choose("auto", machine("2.12.0"), packed=True).backend == "sdpa"
    assert choose("te", machine("2.12.0"), packed=True).backend == "te"
    # Before 2.8 TE has no learnable softmax.
    with pytest.raises(ValueError, match=r"^model.attention_backend: 'te' .*>= 2\.8\.0"):
        choose("te", machine("2.7.0"), packed=False)
    assert choose("auto", machine("2.7.0"), packed=False).backend == "sdpa"
    with pytest.raises(ValueError, match=r"^model.attention_backend: 'local' .* attention sinks"):
        choose("local", te29, packed=False)
    with pytest.raises(ValueError, match=r"^model.context_parallel_size: attention sinks"):
        choose("auto", te29, packed=True, context_parallel_size=2)
