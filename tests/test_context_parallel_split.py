"""How rows are padded and split for context parallelism, what Transformer Engine would be
handed, and the layout checks — on one process, against values written out by hand."""

from __future__ import annotations

import pytest
import torch

from megatron_kto.config.validate import ConfigError
from megatron_kto.entry import compose_run_config
from megatron_kto.models.context_parallel import (
    local_chunks,
    local_scored,
    row_multiple,
    split_index,
    split_micro_batch,
)
from megatron_kto.models.logprobs import IGNORE_INDEX
from megatron_kto.models.packing import PACKED, pack_micro_batch, packed_length, segment_sums
from megatron_kto.models.schedule import NUM_SCORED, SCORED_SPANS, label_spans

CPU = torch.device("cpu")


def test_row_multiple():
    assert row_multiple(1, 4, True) == 1
    assert row_multiple(2, 4, False) == 4
    assert row_multiple(2, 4, True) == 16


def test_each_rank_keeps_an_early_and_a_late_chunk_of_every_segment():
    """Segments of 8 and 4 tokens at CP=2 are cut in 4 chunks of 2 and 1: rank 0 keeps chunks
    0 and 3, rank 1 chunks 1 and 2 (positions written out)."""
    assert local_chunks([8, 4], 2, 0) == [(0, 2), (6, 2), (8, 1), (11, 1)]
    assert local_chunks([8, 4], 2, 1) == [(2, 2), (4, 2), (9, 1), (10, 1)]
    cu = _bounds([8, 4])
    assert split_index(12, 2, 0, CPU, cu).local.tolist() == [0, 1, 6, 7, 8, 11]
    assert split_index(12, 2, 1, CPU, cu).local.tolist() == [2, 3, 4, 5, 9, 10]
    assert split_index(12, 2, 1, CPU, cu).positions.tolist() == [*range(8), *range(4)]
    with pytest.raises(ValueError, match="cannot be split into 4 chunks"):
        local_chunks([6], 2, 0)


def _bounds(seqlens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *seqlens], dtype=torch.int32).cumsum(0, dtype=torch.int32)


@pytest.mark.parametrize(
    ("seqlens", "cp"), [([12, 4, 8], 2), ([16], 4), ([8, 0, 24, 16], 4), ([4, 4], 2)]
)
def test_split_index_is_the_chunks_and_its_order_undoes_the_split(seqlens, cp):
    """Each rank keeps exactly `local_chunks` (written out by hand above); gathering the ranks'
    local sequences rank after rank and applying `order` gives the whole sequence back — with
    empty segments too, and for one segment without bounds (a padded row)."""
    total = sum(seqlens)
    whole = torch.arange(total)
    cu = _bounds(seqlens)
    parts = [split_index(total, cp, r, CPU, cu) for r in range(cp)]
    for r, part in enumerate(parts):
        want = [p for s, c in local_chunks(seqlens, cp, r) for p in range(s, s + c)]
        assert part.local.tolist() == want
        assert torch.equal(part.order, parts[0].order)
    gathered = torch.cat([whole[p.local] for p in parts])
    assert torch.equal(gathered[parts[0].order], whole)
    if len(seqlens) == 1:
        for r in range(cp):
            alone = split_index(total, cp, r, CPU)
            assert torch.equal(alone.local, parts[r].local)
            assert torch.equal(alone.order, parts[r].order)


def test_each_ranks_scored_count_is_known_from_host_spans():
    """`local_scored` from (start, end) runs equals counting the labels each rank keeps, for
    rows with holes, rows scored up to their end, and unscored rows."""
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 50, (5, 16), generator=g)
    labels[torch.rand(5, 16, generator=g) < 0.4] = IGNORE_INDEX
    labels[2] = IGNORE_INDEX
    labels[3, :] = 7
    spans = label_spans(labels)
    assert spans[2] == () and spans[3] == ((0, 16),)
    for cp in (2, 4):
        for r in range(cp):
            kept = labels.index_select(1, split_index(16, cp, r, CPU).local)
            want = int((kept != IGNORE_INDEX).sum())
            assert local_scored(spans, [16] * 5, cp, r) == want


def _micro_batch():
    """Two rows of 5 and 3 kept tokens (last label at 4 and 2) in a [2, 6] micro-batch."""
    tokens = torch.tensor([[11, 12, 13, 14, 15, 16], [21, 22, 23, 0, 0, 0]])
    labels = torch.full_like(tokens, IGNORE_INDEX)
    labels[0, 2:5] = torch.tensor([13, 14, 15])
    labels[1, 1:3] = torch.tensor([22, 23])
    positions = torch.arange(6).expand(2, 6).clone()
    return {"tokens": tokens, "labels": labels, "position_ids": positions}


def test_packed_rows_are_padded_to_the_multiple_and_split():
    """CP=2: rows of 5 and 3 kept tokens become segments of 8 and 4; the padding continues each
    row (its right padding, then fill values) and carries no label."""
    batch = _micro_batch()
    assert packed_length([5, 3], 1, row_multiple=4) == 12
    packed = pack_micro_batch(batch, [5, 3], 12, row_multiple=4)
    p = packed[PACKED]
    assert p.seqlens == (8, 4)
    assert p.cu_seqlens_q.tolist() == [0, 8, 12]
    assert packed["tokens"][0].tolist() == [11, 12, 13, 14, 15, 16, 0, 0, 21, 22, 23, 0]
    assert packed["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 5, 0, 0, 0, 1, 2, 3]
    want_labels = [-100, -100, 13, 14, 15, -100, -100, -100, -100, 22, 23, -100]
    assert packed["labels"][0].tolist() == want_labels

    rank1 = split_micro_batch(dict(packed, num_scored=5), 2, 1)
    assert NUM_SCORED not in rank1  # no host spans: the local count is not known
    rank1 = split_micro_batch(dict(packed, num_scored=5, scored_spans=[((2, 5),), ((1, 3),)]), 2, 1)
    assert rank1[NUM_SCORED] == 5  # every scored position is in rank 1's chunks
    rank0 = split_micro_batch(dict(packed, num_scored=5, scored_spans=[((2, 5),), ((1, 3),)]), 2, 0)
    assert rank0[NUM_SCORED] == 0
    q = rank1[PACKED]
    # Rank 1 keeps chunks 1 and 2 of each segment: positions 2-5 of row 0, 1-2 of row 1.
    assert rank1["tokens"][0].tolist() == [13, 14, 15, 16, 22, 23]
    assert rank1["labels"][0].tolist() == [13, 14, 15, -100, 22, 23]
    assert rank1["position_ids"][0].tolist() == [2, 3, 4, 5, 1, 2]
    assert q.positions.tolist() == [2, 3, 4, 5, 1, 2]
    assert q.row_ids.tolist() == [0, 0, 0, 0, 1, 1]
    assert (q.cp_size, q.cp_rank) == (2, 1)
    # The gathered keys' reorder index, built once with the split.
    # Whole position g is gathered entry: rank 0 holds 0 1 6 7 8 11, rank 1 holds 2 3 4 5 9 10.
    assert q.cp_order.tolist() == [0, 1, 6, 7, 8, 9, 2, 3, 4, 10, 11, 5]
    # What megatron-core hands Transformer Engine: the whole segments, padded bounds = bounds
    # (no padding between sequences), the longest segment for RoPE.
    assert q.cu_seqlens_q_padded.tolist() == q.cu_seqlens_q.tolist() == [0, 8, 12]
    assert q.cu_seqlens_kv_padded.tolist() == [0, 8, 12]
    assert (q.max_seqlen_q, q.max_seqlen_kv, q.qkv_format) == (8, 8, "thd")
    # Per-row sums of this rank's positions land in their rows.
    values = torch.arange(1.0, 7.0).unsqueeze(1)
    sums = segment_sums(values, torch.arange(6), 1, 6, q)
    assert sums[:, 0].tolist() == [1 + 2 + 3 + 4, 5 + 6]


def test_padded_rows_are_split_along_the_sequence():
    batch = _micro_batch()
    batch = {
        k: torch.nn.functional.pad(v, (0, 2), value=IGNORE_INDEX if k == "labels" else 0)
        for k, v in batch.items()
    }
    batch["position_ids"] = torch.arange(8).expand(2, 8)
    batch[SCORED_SPANS] = label_spans(batch["labels"])
    rank0, rank1 = (split_micro_batch(batch, 2, r) for r in (0, 1))
    assert (rank0[NUM_SCORED], rank1[NUM_SCORED]) == (1, 4)
    # [2, 8] rows in 4 chunks of 2: rank 0 keeps columns 0-1 and 6-7, rank 1 columns 2-5.
    assert rank0["tokens"].tolist() == [[11, 12, 0, 0], [21, 22, 0, 0]]
    assert rank0["position_ids"].tolist() == [[0, 1, 6, 7], [0, 1, 6, 7]]
    assert rank1["tokens"].tolist() == [[13, 14, 15, 16], [23, 0, 0, 0]]
    assert rank1["labels"].tolist() == [[13, 14, 15, -100], [23, -100, -100, -100]]


@pytest.mark.parametrize(
    ("overrides", "world", "start"),
    [
        (["model.context_parallel_size=2"], 1, "model.tensor_model_parallel_size: world size 1"),
        (["model.context_parallel_size=0"], 2, "model.context_parallel_size: must be >= 1"),
        (
            [
                "model.context_parallel_size=2",
                "model.attention_backend=local",
                "model.data.pack_sequences=false",
            ],
            2,
            "model.attention_backend: 'local' (megatron's unfused attention) has no context "
            "parallelism (context parallel size 2): set model.attention_backend=sdpa",
        ),
    ],  # fmt: skip
)
def test_impossible_context_parallel_layouts_name_the_key(overrides, world, start):
    with pytest.raises(ConfigError) as info:
        compose_run_config("gpt_kto", overrides, "kto", world_size=world)
    message = str(info.value)
    assert message.startswith(start), message
    assert "\n" not in message


def test_transformer_config_asks_te_for_the_cp_communication_it_has_for_thd():
    """Transformer Engine (2.9-2.12) runs packed (THD) context parallelism only with "p2p"."""
    from megatron_kto.config.architecture import GPTArchitecture
    from megatron_kto.models.builder import ParallelLayout, make_transformer_config

    arch = GPTArchitecture(
        num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
        num_query_groups=2, encoder_seq_length=64, vocab_size=64, padded_vocab_size=64,
    )  # fmt: skip
    config = make_transformer_config(arch, ParallelLayout(context_parallel_size=2))
    assert (config.context_parallel_size, config.cp_comm_type) == (2, "p2p")
    assert make_transformer_config(arch, ParallelLayout()).context_parallel_size == 1


def test_context_parallel_layout_validates():
    prepared = compose_run_config(
        "gpt_kto",
        ["model.context_parallel_size=2", "model.global_batch_size=2", "model.micro_batch_size=1"],
        "kto",
        world_size=4,
    )
    assert prepared.cfg.model.context_parallel_size == 2


class _SDPA:
    """The one method of `SDPAttention` that `prefix_causal_attention` calls."""

    def _sdpa(self, q, k, v, attn_mask, dropout_p, is_causal, native_gqa):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
            enable_gqa=native_gqa,
        )  # fmt: skip


@pytest.mark.parametrize("lower_right_mask", [True, False])
def test_prefix_causal_attention_is_the_causal_mask_of_the_last_queries(lower_right_mask):
    """The last c queries of a length-s causal attention, from an explicit softmax: query i
    (position s − c + i) weighs keys 0 .. s − c + i. Both implementations, values and grads."""
    from megatron_kto.models.cp_attention import prefix_causal_attention

    g = torch.Generator().manual_seed(0)
    b, n, c, s, d = 2, 4, 3, 9, 8
    q = torch.randn(b, n, c, d, generator=g, requires_grad=True)
    k = torch.randn(b, n, s, d, generator=g, requires_grad=True)
    v = torch.randn(b, n, s, d, generator=g, requires_grad=True)
    got = prefix_causal_attention(_SDPA(), q, k, v, 0.0, False, lower_right_mask)
    scores = q @ k.transpose(-1, -2) / d**0.5
    visible = torch.arange(s)[None, :] <= (s - c + torch.arange(c))[:, None]
    want = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v
    assert torch.allclose(got, want, atol=1e-6)
    w = torch.randn(want.shape, generator=g)
    grads_got = torch.autograd.grad((got * w).sum(), (q, k, v))
    grads_want = torch.autograd.grad((want * w).sum(), (q, k, v))
    for a, e in zip(grads_got, grads_want, strict=True):
        assert torch.allclose(a, e, atol=1e-5)
