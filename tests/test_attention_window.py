"""Sliding-window attention (`model.sliding_window`, `model.window_layers`) on one process, fp32.

`SDPAttention` against attention written out here in float64 with `transformers`' window rule
(query i sees key j when i - window < j <= i): padded rows longer than the window (with and
without a padding mask), packed rows of lengths below, at and above the window (equal to the
padded path in outputs and gradients), the context-parallel chunk call
(`cp_attention.prefix_causal_attention`) on both of its CPU/CUDA forms, and which layers take the
window. Whole models against `transformers` (Mistral, Qwen2 with `layer_types`) at TP=1, TP=2 and
PP=2 are in `test_conversion_models.py`; the backend decision for windows is at the end.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from test_parallel_common import tiny_arch

from megatron_kto.models.attention import SDPAttention
from megatron_kto.models.builder import ParallelLayout, make_transformer_config
from megatron_kto.models.cp_attention import prefix_causal_attention
from megatron_kto.runtime import init_runtime, teardown
from megatron_kto.runtime.attention_backend import AttentionFeatures, choose_attention_backend
from megatron_kto.runtime.gpu_settings import Accelerator

WINDOW, HEADS, GROUPS, DIM = 5, 4, 2, 16
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def runtime():
    rt = init_runtime(1, 1, seed=5)
    yield rt
    teardown()


def _module(layer: int = 1, window_layers: list[int] | None = None) -> SDPAttention:
    arch = tiny_arch(sliding_window=WINDOW, window_layers=window_layers, kv_channels=DIM)
    return SDPAttention(
        config=make_transformer_config(arch, ParallelLayout()),
        layer_number=layer,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
    )


def _qkv(seq: int, batch: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = ((seq, batch, HEADS, DIM), (seq, batch, GROUPS, DIM), (seq, batch, GROUPS, DIM))
    # Scale 2 makes the softmax peaked, so a wrong band cannot average out.
    return [(2 * torch.randn(s, generator=g)).requires_grad_() for s in shapes]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """One row: q [s, heads, d], k/v [s, groups, d] -> [s, heads·d], float64 softmax."""
    s = q.shape[0]
    k, v = (t.double().repeat_interleave(HEADS // GROUPS, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / DIM**0.5
    i, j = torch.arange(s)[:, None], torch.arange(s)[None]
    scores = scores.masked_fill(~((j <= i) & (j > i - window)), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(s, -1).float()


def test_the_window_layers_follow_the_pattern(runtime):
    """`window_layers` picks the windowed layers by their global (1-based in megatron) number."""
    assert [_module(n, [0, 1, 0, 1]).window for n in (1, 2, 3, 4)] == [None, 5, None, 5]
    assert [_module(n).window for n in (1, 4)] == [WINDOW, WINDOW]


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "padding_mask"])
def test_padded_rows_longer_than_the_window(runtime, masked):
    seq, lengths = 12, [12, 7, 9]
    q, k, v = _qkv(seq, len(lengths))
    mask = None
    if masked:  # megatron's convention: True = masked; causal + keys and queries past the row
        pos = torch.arange(seq)
        pad = torch.stack([pos >= n for n in lengths])
        causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        mask = (causal[None] | pad[:, None, :] | pad[:, :, None])[:, None]
    with torch.no_grad():
        out = _module()(q, k, v, mask)
    for b, n in enumerate(lengths if masked else [seq] * len(lengths)):
        want = _reference(q[:n, b], k[:n, b], v[:n, b], WINDOW)
        assert (out[:n, b] - want).abs().max() <= TOLERANCE


def test_packed_rows_equal_the_reference_and_the_padded_path(runtime):
    """Rows shorter than, as long as and longer than the window, end to end in one packed
    micro-batch: outputs equal the float64 reference, gradients the padded path's."""
    lengths = [12, 4, 5, 9]
    module = _module()
    rows = [_qkv(n, 1, seed=i) for i, n in enumerate(lengths)]
    packed = [torch.cat([r[j][:, 0] for r in rows]).detach().requires_grad_() for j in range(3)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=12, max_seqlen_kv=12
    )
    out = module(*packed, None, packed_seq_params=params)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out * weights).sum().backward()
    start = 0
    for (q, k, v), n in zip(rows, lengths):
        want = _reference(q[:, 0], k[:, 0], v[:, 0], WINDOW)
        assert (out[start : start + n] - want).abs().max() <= TOLERANCE
        padded = module(q, k, v, None)[:, 0]
        (padded * weights[start : start + n]).sum().backward()
        for got, leaf in zip(packed, (q, k, v)):
            assert (got.grad[start : start + n] - leaf.grad[:, 0]).abs().max() <= TOLERANCE
        start += n


@pytest.mark.parametrize("window", [3, 5, 20])
@pytest.mark.parametrize("lower_right_mask", [True, False], ids=["cuda_form", "cpu_form"])
def test_a_context_parallel_chunk_sees_its_window(runtime, window, lower_right_mask):
    """The last c queries of a row over the whole row's keys (a CP chunk's call) equal those rows
    of the whole row's windowed attention, the window cutting inside and beyond the chunk."""
    seq, c = 16, 4
    q, k, v = (t.detach() for t in _qkv(seq, 1))
    module = _module()
    # [s, 1, n, d] -> [1, n, s, d], as cp_attention calls it
    qh, kh, vh = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    out = prefix_causal_attention(
        module, qh[:, :, seq - c :], kh, vh, 0.0, True, lower_right_mask, window=window
    )
    got = out[0].permute(1, 0, 2).reshape(c, -1)
    want = _reference(q[:, 0], k[:, 0], v[:, 0], window)[seq - c :]
    assert (got - want).abs().max() <= TOLERANCE


def test_the_backend_decision_for_windows():
    te = Accelerator(cuda=True, transformer_engine="2.11.0")
    window = AttentionFeatures(head_dim=64, sliding_window=True)
    common = dict(precision="bf16", packed=False, features=window)
    assert choose_attention_backend("auto", accelerator=te, **common).backend == "te"
    cp2 = choose_attention_backend("auto", accelerator=te, context_parallel_size=2, **common)
    assert cp2.backend == "sdpa" and "sliding windows" in cp2.reason
    with pytest.raises(ValueError, match=r"^model\.attention_backend: 'te' cannot run .*sliding"):
        choose_attention_backend("te", accelerator=te, context_parallel_size=2, **common)
    with pytest.raises(ValueError, match=r"^model\.attention_backend: 'local' .*sliding-window"):
        choose_attention_backend("local", accelerator=Accelerator(cuda=False), **common)


def test_te_fused_window_needs_no_attention_dropout():
    """TE 2.9–2.12 fuse a (left, 0) window in cuDNN only without attention dropout, in
    flash-attn 2.3+ either way: with dropout and no flash-attn `auto` keeps SDPA and says why;
    an explicit te still runs (unfused, unpacked) — packed on 2.9 nothing does."""
    te = Accelerator(cuda=True, transformer_engine="2.9.0")
    features = AttentionFeatures(head_dim=64, sliding_window=True, attention_dropout=0.1)
    common = dict(precision="bf16", features=features)
    auto = choose_attention_backend("auto", accelerator=te, packed=True, **common)
    assert auto.backend == "sdpa" and "without attention dropout" in auto.reason
    assert choose_attention_backend("te", accelerator=te, packed=False, **common).backend == "te"
    with pytest.raises(ValueError, match=r"^model\.attention_backend: 'te' cannot run"):
        choose_attention_backend("te", accelerator=te, packed=True, **common)
    flash = Accelerator(cuda=True, transformer_engine="2.9.0", flash_attn=True)
    assert (
        choose_attention_backend("auto", accelerator=flash, packed=True, **common).backend == "te"
    )
    no_window = {**common, "features": AttentionFeatures(head_dim=64, attention_dropout=0.1)}
    assert (
        choose_attention_backend("auto", accelerator=te, packed=True, **no_window).backend == "te"
    )
