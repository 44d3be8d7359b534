"""RoPE of packed micro-batches without host copies (`models.packed_rope`) equals megatron-core's
unfused THD RoPE, and a whole packed model run through `PackedRoPESelfAttention` equals the same
model run through megatron's own `SelfAttention`.

The references are megatron-core 0.16.1's `rope_utils._apply_rotary_pos_emb_thd` (what
`SelfAttention` runs without Transformer Engine) and, independently of megatron's code, RoPE
written out from its formula. That `models.packed_rope` reads nothing on the host is checked in
`test_hot_loop_sync.py`.
"""

from __future__ import annotations

import math

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.transformer_config import TransformerConfig
from test_parallel_common import tiny_arch

from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks, unwrap
from megatron_kto.models.packed_rope import (
    PackedRoPE,
    PackedRoPESelfAttention,
    own_packed_rope,
    packed_rotary_freqs,
    segment_positions,
)
from megatron_kto.models.packing import PACKED, pack_micro_batch
from megatron_kto.runtime import init_runtime, teardown

VOCAB = 120


@pytest.fixture(scope="module")
def runtime():
    rt = init_runtime(1, 1, seed=3)
    yield rt
    teardown()


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def test_segment_positions_restart_per_segment():
    """Worked by hand: segments 3, 1, 0 (empty), 4 → 0 1 2 | 0 | | 0 1 2 3."""
    got = segment_positions(_cu([3, 1, 0, 4]), 8)
    assert got.tolist() == [0, 1, 2, 0, 0, 1, 2, 3]


def _config(heads: int, groups: int, head_dim: int, interleaved: bool) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1,
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        rotary_interleaved=interleaved,
        apply_rope_fusion=False,
    )


# (segment lengths, rotary_percent, interleaved, Llama-3 scaling). The last segment of the first
# cases is a packed micro-batch's padding segment (PP/SP padding), which megatron rotates too.
CASES = {
    "rows+padding": ([5, 1, 9, 3], 1.0, False, False),
    "rotary_percent=0.5": ([4, 7, 2], 0.5, False, False),
    "interleaved": ([6, 2, 8], 1.0, True, False),
    "llama3-scaling": ([3, 11, 1, 5], 1.0, False, True),
    "one-segment (table = tokens)": ([9], 1.0, False, False),
    "all": ([7, 1, 4, 6], 0.5, True, True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_packed_rope_equals_megatron_unfused_thd(runtime, case, dtype):
    """Queries and keys (GQA: different head counts) rotated by `PackedRoPE` equal megatron's
    `_apply_rotary_pos_emb_thd` on the same tensors, bit for bit, values and input gradients
    (fp32, and bf16 as under `trainer.precision=bf16`: fp32 angles, cos/sin cast to bf16).

    The table comes from megatron's `RotaryEmbedding` for the micro-batch's longest segment, as
    `GPTModel` builds it (`get_rotary_seq_len` of packed parameters); for one segment its length
    equals the packed length, megatron's "exact mapping" branch.
    """
    lengths, percent, interleaved, scaling = CASES[case]
    head_dim, heads, groups = 16, 4, 2
    config = _config(heads, groups, head_dim, interleaved)
    table = RotaryEmbedding(
        kv_channels=head_dim,
        rotary_percent=percent,
        rotary_interleaved=interleaved,
        rotary_base=500000 if scaling else 10000,
        rope_scaling=scaling,
        use_cpu_initialization=True,
    )(max(lengths), packed_seq=True)
    cu = _cu(lengths)
    total = sum(lengths)
    cp = parallel_state.get_context_parallel_group()
    g = torch.Generator().manual_seed(len(lengths))
    q = torch.randn(total, heads, head_dim, generator=g).to(dtype).requires_grad_()
    k = torch.randn(total, groups, head_dim, generator=g).to(dtype).requires_grad_()
    grad_q = torch.randn(q.shape, generator=g).to(dtype)
    grad_k = torch.randn(k.shape, generator=g).to(dtype)

    want = [_apply_rotary_pos_emb_thd(t, cu, table, interleaved, cp_group=cp) for t in (q, k)]
    want_grads = torch.autograd.grad(want, (q, k), (grad_q, grad_k))
    rope = PackedRoPE(table, table, cu, cu)
    got = rope.rotate(q.unsqueeze(1), k.unsqueeze(1), config, cp)
    got = [t.squeeze(1) for t in got]
    got_grads = torch.autograd.grad(got, (q, k), (grad_q, grad_k))
    for a, b in zip(got + list(got_grads), want + list(want_grads), strict=True):
        assert torch.equal(a, b), (a - b).abs().max()
    # Not vacuous: every segment's later tokens are rotated.
    assert not torch.equal(got[0], q)


def _rope_by_formula(x: torch.Tensor, positions: list[int], base: float) -> torch.Tensor:
    """RoPE written out: pairs (x_j, x_{j+d/2}) rotated by p · base^(-2j/d) (no megatron code)."""
    d = x.shape[-1]
    out = torch.empty_like(x)
    for t, p in enumerate(positions):
        for j in range(d // 2):
            angle = p * base ** (-2 * j / d)
            c, s = math.cos(angle), math.sin(angle)
            a, b = x[t, :, j].double(), x[t, :, j + d // 2].double()
            out[t, :, j] = (a * c - b * s).float()
            out[t, :, j + d // 2] = (b * c + a * s).float()
    return out


def test_packed_rope_equals_rope_by_formula(runtime):
    """Independent of megatron's rotation code: each token rotated by its position within its
    row, padding segment included (float64 formula vs fp32 kernels)."""
    lengths, head_dim = [4, 1, 6, 3], 8
    config = _config(2, 2, head_dim, False)
    table = RotaryEmbedding(kv_channels=head_dim, rotary_percent=1.0, use_cpu_initialization=True)(
        max(lengths)
    )
    cu = _cu(lengths)
    x = torch.randn(sum(lengths), 2, head_dim, generator=torch.Generator().manual_seed(4))
    got, _ = PackedRoPE(table, table, cu, cu).rotate(x.unsqueeze(1), x.unsqueeze(1), config, None)
    positions = [p for n in lengths for p in range(n)]
    torch.testing.assert_close(got.squeeze(1), _rope_by_formula(x, positions, 10000.0))


def test_megatron_keeps_fused_and_context_parallel_rope():
    """`own_packed_rope` takes over only megatron's unfused THD case with one CP rank: with
    `apply_rope_fusion` (TE present, `runtime.gpu_settings.fusion_settings`) megatron's fused
    kernel runs, and padded (bshd) micro-batches keep megatron's own path."""
    config = _config(2, 2, 8, False)
    table = torch.zeros(4, 1, 1, 8)
    cu = _cu([2, 2])
    thd = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    assert isinstance(own_packed_rope(config, table, thd, cp_size=1), PackedRoPE)
    config.apply_rope_fusion = True
    assert own_packed_rope(config, table, thd, cp_size=1) is None
    config.apply_rope_fusion = False
    assert own_packed_rope(config, table, thd, cp_size=2) is None
    assert own_packed_rope(config, table, None, cp_size=1) is None
    assert own_packed_rope(config, None, thd, cp_size=1) is None
    bshd = PackedSeqParams(qkv_format="sbhd")
    assert own_packed_rope(config, table, bshd, cp_size=1) is None
    # megatron's bounds precedence: the `_padded` variants when set.
    padded = _cu([3, 3])
    thd.cu_seqlens_q_padded = thd.cu_seqlens_kv_padded = padded
    rope = own_packed_rope(config, (table, table), thd, cp_size=1)
    assert rope.cu_seqlens_q is padded and rope.cu_seqlens_kv is padded
    positions = torch.tensor([0, 1, 2, 0, 1, 2])
    assert torch.equal(packed_rotary_freqs(table, padded, 6), table.index_select(0, positions))


def _packed_batch(rows: list[int], length: int) -> dict:
    width = max(rows)
    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(1, VOCAB, (len(rows), width), generator=g)
    labels = tokens.roll(-1, 1)
    for i, n in enumerate(rows):
        labels[i, n:] = -100
    batch = {
        "tokens": tokens,
        "labels": labels,
        "position_ids": torch.arange(width).repeat(len(rows), 1),
    }
    return pack_micro_batch(batch, rows, length=length)


def _run(chunk, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    chunk.zero_grad(set_to_none=True)
    logits = chunk(batch["tokens"], batch["position_ids"], None, packed_seq_params=batch[PACKED])
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(5))
    (logits * weights).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in chunk.named_parameters()}


@pytest.mark.parametrize(
    "arch_options,recompute",
    [
        ({}, None),
        ({"rotary_percent": 0.5, "rope_scaling": True, "rotary_base": 500000}, "full"),
        ({"add_qkv_bias": True}, "selective"),
    ],
    ids=["tiny", "partial+llama3+full-recompute", "qkv-bias+selective-recompute"],
)
def test_packed_model_equals_megatron_self_attention(runtime, arch_options, recompute):
    """A packed micro-batch (with a padding segment) through the `sdpa` spec: logits and every
    weight gradient with `PackedRoPESelfAttention` equal those of the same modules switched back
    to megatron's `SelfAttention` (unfused THD RoPE from `cu_seqlens`) — also when activation
    recompute replays the layers."""
    arch = tiny_arch(vocab_size=VOCAB, **arch_options)
    layout = ParallelLayout(attention_backend="sdpa", activations_checkpoint_granularity=recompute)
    (chunk,) = build_gpt_chunks(arch, layout, runtime.device)
    attentions = [m for m in chunk.modules() if isinstance(m, SelfAttention)]
    assert len(attentions) == arch.num_layers
    assert all(type(m) is PackedRoPESelfAttention for m in attentions)
    assert not unwrap(chunk).config.apply_rope_fusion
    batch = _packed_batch([5, 1, 9, 3], length=20)

    ours, our_grads = _run(chunk, batch)
    for m in attentions:  # the same weights, megatron's own forward
        m.__class__ = SelfAttention
    theirs, their_grads = _run(chunk, batch)
    assert torch.equal(ours, theirs), (ours - theirs).abs().max()
    for name, grad in their_grads.items():
        assert torch.equal(our_grads[name], grad), name
