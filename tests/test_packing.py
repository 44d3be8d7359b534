"""Padding-free micro-batches on one process (fp32): packing, THD parameters, per-row attention,
and whole KTO / DPO steps packed vs padded.

The multi-rank layouts (TP=2 with sequence parallelism, PP=2, PP=2 × VPP=2, DP=2) are in
`test_packing_parallel.py`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_parallel_common import kto_train_step, tiny_arch

from megatron_kto.data.collate import dpo_custom_collate, kto_custom_collate
from megatron_kto.models import attention as attention_module
from megatron_kto.models.builder import (
    ParallelLayout,
    build_gpt_chunks,
    make_transformer_config,
    unwrap,
)
from megatron_kto.models.dpo_model import (
    REF_CHOSEN,
    REF_REJECTED,
    DPOSettings,
    MegatronGPTDPOModel,
)
from megatron_kto.models.forward import LOGP_SUM, forward_sequence_stats
from megatron_kto.models.kto_model import KTOSettings, MegatronGPTKTOModel
from megatron_kto.models.packing import (
    PACKED,
    ROW_LENGTHS,
    PackedRows,
    host_row_lengths,
    kept_lengths,
    pack_micro_batch,
    segment_sums,
)
from megatron_kto.models.schedule import HOST_LENGTHS, to_device
from megatron_kto.models.training_setup import wrap_ddp
from megatron_kto.runtime import init_runtime, teardown

TOL = 1e-5
VOCAB = 100


@pytest.fixture(scope="module")
def runtime():
    rt = init_runtime(1, 1, seed=5)
    yield rt
    teardown()


def _labels(rows: list[list[int]], width: int) -> torch.Tensor:
    out = torch.full((len(rows), width), -100)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(row)
    return out


# ---------------------------------------------------------------------------------------------
# Packing a micro-batch
# ---------------------------------------------------------------------------------------------


def test_kept_length_is_last_scored_position_plus_one():
    labels = _labels([[-100, 5, 6, -100], [-100, -100, 7], [-100], [1, 2, 3, 4, 5, 6]], 6)
    # Row 0: a -100 after its last scored label is dropped; row 2 has none: it keeps 1.
    assert host_row_lengths(labels) == [3, 3, 1, 6]
    assert kept_lengths(labels).tolist() == [3, 3, 1, 6]


def test_pack_micro_batch_layout():
    tokens = torch.arange(1, 31).view(3, 10)
    labels = _labels([[-100, 12, 13], [-100] * 3 + [24, 25, 26, 27], [-100, 32]], 10)
    batch = {
        "tokens": tokens,
        "labels": labels,
        "position_ids": torch.arange(10).repeat(3, 1),
        "preference": torch.tensor([1, 0, 1]),
        "num_scored": 7,
        ROW_LENGTHS: [3, 7, 2],
    }
    packed = pack_micro_batch(batch, [3, 7, 2], length=16)
    want_tokens = [1, 2, 3, 11, 12, 13, 14, 15, 16, 17, 21, 22] + [0] * 4
    assert packed["tokens"].tolist() == [want_tokens]
    assert packed["position_ids"].tolist() == [[0, 1, 2, *range(7), 0, 1, 0, 0, 0, 0]]
    assert packed["labels"].tolist() == [
        [-100, 12, 13, -100, -100, -100, 24, 25, 26, 27, -100, 32, -100, -100, -100, -100]
    ]
    assert torch.equal(packed["preference"], batch["preference"])
    assert packed["num_scored"] == 7 and ROW_LENGTHS not in packed
    params = packed[PACKED]
    assert params.qkv_format == "thd" and params.num_rows == 3
    assert params.cu_seqlens_q.dtype == torch.int32
    assert params.cu_seqlens_q.tolist() == [0, 3, 10, 12, 16]
    assert params.cu_seqlens_kv is params.cu_seqlens_q
    assert params.seqlens == (3, 7, 2, 4) and params.max_seqlen_q == params.max_seqlen_kv == 7
    assert params.row_ids.tolist() == [0] * 3 + [1] * 7 + [2] * 2 + [3] * 4

    exact = pack_micro_batch(batch, [3, 7, 2])
    assert exact["tokens"].shape == (1, 12) and exact[PACKED].seqlens == (3, 7, 2)
    assert exact[PACKED].cu_seqlens_q.tolist() == [0, 3, 10, 12]


def test_pack_refuses_what_it_cannot_pad():
    batch = {
        "tokens": torch.zeros(2, 4, dtype=torch.long),
        "labels": _labels([[1, 2], [3]], 4),
        "position_ids": torch.arange(4).repeat(2, 1),
        "attention_mask": torch.ones(2, 4),
    }
    with pytest.raises(ValueError, match="'attention_mask'"):
        pack_micro_batch(batch, [2, 1])
    del batch["attention_mask"]
    with pytest.raises(ValueError, match="shorter"):
        pack_micro_batch(batch, [2, 1], length=2)
    with pytest.raises(ValueError, match="3 row lengths"):
        pack_micro_batch(batch, [2, 1, 1])


def test_segment_sums_equal_per_row_sums_and_gradients():
    g = torch.Generator().manual_seed(0)
    lengths = [3, 7, 2]
    params = pack_micro_batch(
        {
            "tokens": torch.zeros(3, 8, dtype=torch.long),
            "labels": torch.stack(
                [torch.arange(8).masked_fill(torch.arange(8) >= n, -100) for n in lengths]
            ),  # fmt: skip
            "position_ids": torch.arange(8).repeat(3, 1),
        },
        lengths,
        length=14,
    )[PACKED]
    values = torch.randn(14, 2, generator=g, requires_grad=True)
    positions = torch.tensor([0, 2, 3, 5, 9, 11])  # scored positions of rows 0, 0, 1, 1, 1, 2
    sums = segment_sums(values[positions], positions, 1, 14, params)
    want = torch.stack([values[[0, 2]].sum(0), values[[3, 5, 9]].sum(0), values[[11]].sum(0)])
    torch.testing.assert_close(sums, want, rtol=1e-6, atol=1e-7)
    sums.square().sum().backward()
    grad = values.grad.clone()
    values.grad = None
    want.square().sum().backward()
    torch.testing.assert_close(grad, values.grad, rtol=1e-6, atol=1e-7)
    # Padded layout: rows of a [3, 5] micro-batch.
    flat = torch.tensor([1, 4, 5, 14])
    padded = segment_sums(values[:4].detach(), flat, 3, 5)
    want = torch.stack([values[:2].sum(0), values[2], values[3]]).detach()
    torch.testing.assert_close(padded, want, rtol=1e-6, atol=1e-7)


def test_packed_params_follow_megatron_thd_contract(runtime):
    """What megatron-core 0.16.1 reads from `PackedSeqParams` in the `thd` format, checked on the
    parameters a packed micro-batch carries (TE itself cannot run here):

    * `TEDotProductAttention` passes exactly the base dataclass's fields to TE
      (`kept_packed_seq_params`): our extra fields never reach it; `cu_seqlens_*` are int32,
      start at 0 and end at the packed length, `max_seqlen_*` are host ints (TE >= 1.3 then
      needs no device-to-host copy), the `_padded` variants and the CP fields are unset;
    * RoPE: megatron's unfused THD path (`rope_utils._apply_rotary_pos_emb_thd`, the reference
      for TE's fused kernel) with our `cu_seqlens` and `max_seqlen` equals RoPE applied to each
      row alone from position 0.
    """
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.packed_seq_params import PackedSeqParams

    rows = [5, 1, 9]
    width = max(rows)
    labels = torch.stack([torch.arange(width).masked_fill(torch.arange(width) >= n, -100)
                          for n in rows])  # fmt: skip
    batch = {"tokens": labels.clamp(min=0), "labels": labels,
             "position_ids": torch.arange(width).repeat(3, 1)}  # fmt: skip
    params = pack_micro_batch(batch, rows, length=16)[PACKED]
    kept = {f.name for f in dataclasses.fields(PackedSeqParams)}
    te_kwargs = {name: getattr(params, name) for name in kept}
    assert set(te_kwargs) == kept and "seqlens" not in kept and "row_ids" not in kept
    assert te_kwargs["qkv_format"] == "thd"
    for name in ("cu_seqlens_q", "cu_seqlens_kv"):
        cu = te_kwargs[name]
        assert cu.dtype == torch.int32 and cu.dim() == 1 and cu.is_contiguous()
        assert cu[0] == 0 and cu[-1] == 16 and bool((cu[1:] >= cu[:-1]).all())
    assert type(te_kwargs["max_seqlen_q"]) is int and te_kwargs["max_seqlen_q"] == 9
    assert te_kwargs["cu_seqlens_q_padded"] is None and te_kwargs["cu_seqlens_kv_padded"] is None
    assert te_kwargs["cp_group"] is None and te_kwargs["local_cp_size"] is None

    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)
    freqs = rope(max(params.max_seqlen_q, params.max_seqlen_kv), packed_seq=True)
    g = torch.Generator().manual_seed(1)
    t = torch.randn(16, 2, 8, generator=g)
    packed = _apply_rotary_pos_emb_thd(
        t, params.cu_seqlens_q, freqs, cp_group=parallel_state.get_context_parallel_group()
    )
    start = 0
    for n in params.seqlens:
        alone = _apply_rotary_pos_emb_thd(
            t[start : start + n],
            torch.tensor([0, n], dtype=torch.int32),
            rope(n, packed_seq=True),
            cp_group=parallel_state.get_context_parallel_group(),
        )
        assert torch.equal(packed[start : start + n], alone)
        start += n
    # RoPE leaves position 0 unrotated: row 1 (packed position 5) restarts there.
    assert torch.equal(packed[5], t[5]) and not torch.equal(packed[4], t[4])


# ---------------------------------------------------------------------------------------------
# SDPAttention on packed rows
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_sdpa_packed_rows_equal_rows_alone(runtime, heads, groups):
    """Causal attention inside each packed row equals each row run alone (unpacked, causal):
    values and the gradients of q, k, v; a plain `PackedSeqParams` (lengths only on the device)
    gives the same result."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    arch = tiny_arch(num_attention_heads=heads, num_query_groups=groups)
    config = make_transformer_config(arch, ParallelLayout())
    sdpa = attention_module.SDPAttention(
        config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
    )
    rows, dim = [6, 1, 9, 3], 8
    total = sum(rows)
    g = torch.Generator().manual_seed(2)
    q = (2 * torch.randn(total, heads, dim, generator=g)).requires_grad_()
    k = (2 * torch.randn(total, groups, dim, generator=g)).requires_grad_()
    v = torch.randn(total, groups, dim, generator=g).requires_grad_()
    cu = torch.tensor([0, 6, 7, 16, 19], dtype=torch.int32)
    params = PackedRows(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9,
        seqlens=tuple(rows), num_rows=4,
    )  # fmt: skip
    weights = torch.randn(total, heads * dim, generator=g)

    out = sdpa(q, k, v, None, packed_seq_params=params)
    assert out.shape == (total, heads * dim)
    (out * weights).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]

    alone, start = [], 0
    qd, kd, vd = (t.detach().clone().requires_grad_() for t in (q, k, v))
    for n in rows:
        sl = slice(start, start + n)
        o = sdpa(qd[sl, None], kd[sl, None], vd[sl, None], None)  # [n, 1, heads·dim]
        alone.append(o[:, 0])
        start += n
    want = torch.cat(alone)
    (want * weights).sum().backward()
    assert (out - want).abs().max() <= TOL
    for got, t in zip(grads, (qd, kd, vd), strict=True):
        assert (got - t.grad).abs().max() <= TOL * t.grad.abs().max()

    plain = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                            max_seqlen_q=9, max_seqlen_kv=9)  # fmt: skip
    assert torch.equal(sdpa(q, k, v, None, packed_seq_params=plain), out.detach())
    with pytest.raises(NotImplementedError, match="'thd'"):
        sdpa(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd"))


# ---------------------------------------------------------------------------------------------
# Whole KTO and DPO steps: packed vs padded, same weights
# ---------------------------------------------------------------------------------------------


def _examples(n: int, seed: int) -> list[dict]:
    """KTO examples with long-tailed lengths (prompts 2..9, completions 1..20 tokens)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = int(torch.randint(2, 10, (1,), generator=g))
        c = 1 + int(torch.randint(0, 5, (1,), generator=g)) ** 2 % 20
        out.append(
            {
                "prompt_ids": torch.randint(1, VOCAB, (p,), generator=g).tolist(),
                "completion_ids": torch.randint(1, VOCAB, (c,), generator=g).tolist(),
                "label": i % 3 != 2,
            }
        )
    return out


class _Reference:
    """A reference policy with its own weights (a perturbed copy), no swapping."""

    def __init__(self, chunks):
        self.chunks = chunks

    def log_probs(self, batch, forward):
        return forward(self.chunks)


class _TokenCounter:
    """Counts the input positions entering a model chunk (a forward pre-hook on its embedding)."""

    def __init__(self, chunks):
        self.positions = 0
        for c in chunks:
            unwrap(c).embedding.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        self.positions += (args[0] if args else kwargs["input_ids"]).numel()


def _models(runtime):
    """Policy chunks (DDP-wrapped) and reference chunks (the policy's weights + noise, so r ≠ 0),
    the same weights on every call."""
    torch.manual_seed(0)
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(0)
    arch = tiny_arch(num_layers=2, encoder_seq_length=32, vocab_size=VOCAB)
    policy = build_gpt_chunks(arch, ParallelLayout(), runtime.device)
    ref = build_gpt_chunks(arch, ParallelLayout(), runtime.device)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p, q in zip(policy[0].parameters(), ref[0].parameters(), strict=True):
            q.copy_(p + 0.2 * torch.randn(p.shape, generator=g))
    return wrap_ddp(policy, use_distributed_optimizer=False), ref


def _grads(chunks) -> dict[str, torch.Tensor]:
    return {n: p.main_grad.clone() for n, p in chunks[0].module.named_parameters()}


def _kto_step(runtime, batch, pack: bool, chunk: int):
    chunks, ref = _models(runtime)
    settings = KTOSettings(
        beta=0.5, desirable_weight=1.0, undesirable_weight=1.5, loss_type="kto",
        sft_loss_weight=0.2, micro_batch_size=2, forward_micro_batch_size=4, vocab_size=VOCAB,
        logprob_chunk_size=chunk, pack_sequences=pack,
    )  # fmt: skip
    model = MegatronGPTKTOModel(chunks, _Reference(ref), settings)
    counter = _TokenCounter(chunks + ref)
    batch = dict(batch)
    refs, _, metrics = kto_train_step(model, chunks, batch)
    return refs, metrics, _grads(chunks), counter.positions


@pytest.mark.parametrize("chunk", [0, 4], ids=["full_logits", "chunked"])
def test_kto_step_packed_equals_padded(runtime, chunk):
    """The KTO step — reference pass (samples + KL rows), the KL rows' policy pass (z₀), and the
    training pass in 4 micro-batches — packed and padded on the same weights: reference
    log-probs, loss, z₀, every metric and every gradient equal to 1e-5; the packed step feeds the
    model only the rows' own positions (no padding), the padded one all of them."""
    batch = to_device(kto_custom_collate(_examples(8, seed=1), pad_id=0), runtime.device)
    lengths = batch[HOST_LENGTHS]
    real = sum(lengths["sample_labels"]) + sum(lengths["kl_sample_labels"])
    padded_positions = batch["samples"].numel() + batch["kl_samples"].numel()
    assert real < 0.7 * padded_positions, "the batch must have padding to remove"

    ref_pad, m_pad, g_pad, n_pad = _kto_step(runtime, batch, pack=False, chunk=chunk)
    ref_pack, m_pack, g_pack, n_pack = _kto_step(runtime, batch, pack=True, chunk=chunk)
    # Reference pass (2B rows) + KL policy pass (B) + training pass (B).
    assert n_pad == 2 * padded_positions
    assert n_pack == 2 * real
    assert (ref_pack - ref_pad).abs().max() <= TOL * ref_pad.abs().max()
    assert m_pad["kl"] > 0, "the test should exercise z₀ > 0"
    for name, want in m_pad.items():
        assert abs(m_pack[name] - want) <= TOL * max(1.0, abs(want)), (name, m_pack[name], want)
    for name, want in g_pad.items():
        scale = want.abs().max()
        assert scale > 0, name
        assert (g_pack[name] - want).abs().max() <= TOL * scale, name


def test_dpo_step_packed_equals_padded(runtime):
    """DPO: a micro-batch packs its pairs' chosen rows then rejected rows; reference log-probs,
    metrics and gradients equal the padded step's."""
    examples = _examples(8, seed=2)
    pairs = [
        {"prompt_ids": a["prompt_ids"], "chosen_ids": a["completion_ids"],
         "rejected_ids": b["completion_ids"]}
        for a, b in zip(examples[::2], examples[1::2], strict=True)
    ]  # fmt: skip
    batch = to_device(dpo_custom_collate(pairs, pad_id=0), runtime.device)
    out = {}
    for pack in (False, True):
        chunks, ref = _models(runtime)
        settings = DPOSettings(
            beta=0.3, loss_type="sigmoid", label_smoothing=0.0, average_log_probs=False,
            sft_loss_weight=0.1, micro_batch_size=2, forward_micro_batch_size=4,
            vocab_size=VOCAB, logprob_chunk_size=4, pack_sequences=pack,
        )  # fmt: skip
        model = MegatronGPTDPOModel(chunks, _Reference(ref), settings)
        b = dict(batch)
        refs = model.get_ref_policy_logprobs(b)
        b[REF_CHOSEN], b[REF_REJECTED] = refs.chunk(2)
        for c in chunks:
            c.zero_grad_buffer()
        _, metrics = model.get_loss_and_metrics(b, forward_only=False)
        out[pack] = (refs, metrics, _grads(chunks))
    (ref_a, m_a, g_a), (ref_b, m_b, g_b) = out[False], out[True]
    assert (ref_b - ref_a).abs().max() <= TOL * ref_a.abs().max()
    for name, want in m_a.items():
        assert abs(m_b[name] - want) <= TOL * max(1.0, abs(want)), name
    for name, want in g_a.items():
        assert (g_b[name] - want).abs().max() <= TOL * want.abs().max(), name


def test_forward_pass_without_host_lengths_packs_the_same(runtime):
    """`forward_sequence_stats` on device tensors with no recorded host lengths (the eval tool's
    path) computes them from the labels and equals the padded pass."""
    batch = kto_custom_collate(_examples(6, seed=4), pad_id=0)
    chunks, _ = _models(runtime)
    args = (chunks, batch["samples"], batch["sample_labels"], batch["position_ids"], 3, VOCAB, 4)
    padded = forward_sequence_stats(*args, pack=False)
    packed = forward_sequence_stats(*args, pack=True)
    scale = padded[:, LOGP_SUM].abs().max()
    assert (packed[:, LOGP_SUM] - padded[:, LOGP_SUM]).abs().max() <= TOL * scale
    assert torch.equal(packed[:, 1], padded[:, 1])


def _pairs_batch(runtime, seed: int):
    examples = _examples(8, seed=seed)
    pairs = [
        {"prompt_ids": a["prompt_ids"], "chosen_ids": a["completion_ids"],
         "rejected_ids": b["completion_ids"]}
        for a, b in zip(examples[::2], examples[1::2], strict=True)
    ]  # fmt: skip
    return to_device(dpo_custom_collate(pairs, pad_id=0), runtime.device)


def _dpo_settings(**kw) -> DPOSettings:
    base = dict(
        beta=0.3, loss_type="sigmoid", label_smoothing=0.0, average_log_probs=False,
        sft_loss_weight=0.0, micro_batch_size=2, forward_micro_batch_size=4, vocab_size=VOCAB,
    )  # fmt: skip
    return DPOSettings(**{**base, **kw})


@pytest.mark.parametrize("pack,chunk", [(False, 0), (True, 4)])
def test_ld_alpha_log_probs_mix_the_shared_and_full_sums(runtime, pack, chunk):
    """LD-DPO's log-prob of a completion, α·(full sum) + (1 − α)·(sum over its first m = min(n_c,
    n_r) completion tokens): checked against two plain passes, one over the full completions and
    one whose labels stop after the m-th completion token — padded with full logits and packed
    with chunked log-probs."""
    batch = _pairs_batch(runtime, seed=7)
    chunks, _ = _models(runtime)
    s = dict(logprob_chunk_size=chunk, pack_sequences=pack)
    plain = MegatronGPTDPOModel(chunks, None, _dpo_settings(**s))
    weighted = MegatronGPTDPOModel(chunks, None, _dpo_settings(ld_alpha=0.25, **s))
    full = plain.forward_logprobs(batch, chunks)
    # Only the tensors: the host facts recorded for the full labels do not fit the cut ones.
    shared = {k: v for k, v in batch.items() if torch.is_tensor(v)}
    n_c = (batch["chosen_labels"] != -100).sum(1)
    n_r = (batch["rejected_labels"] != -100).sum(1)
    m = torch.minimum(n_c, n_r)
    assert (n_c != n_r).any()  # some pair has a tail
    for key in ("chosen_labels", "rejected_labels"):
        labels = batch[key].clone()
        ordinal = (labels != -100).cumsum(1)
        labels[ordinal > m[:, None]] = -100
        shared[key] = labels
    head = plain.forward_logprobs(shared, chunks)
    want = 0.25 * full + 0.75 * head
    torch.testing.assert_close(weighted.forward_logprobs(batch, chunks), want, rtol=1e-6, atol=1e-5)


def test_ld_alpha_and_global_sort_step_packed_equals_padded(runtime):
    """A step with LD-DPO weights and the global-batch sort of ``aot`` / ``aot_unpaired`` (pre-
    pass, partners per micro-batch): packed with chunked log-probs equal to padded with full
    logits — loss, metrics and gradients."""
    batch = _pairs_batch(runtime, seed=5)
    out = {}
    for pack, chunk in ((False, 0), (True, 4)):
        chunks, ref = _models(runtime)
        settings = _dpo_settings(
            loss_type=("aot", "aot_unpaired"), loss_weights=(1.0, 0.5), label_smoothing=0.1,
            ld_alpha=0.5, logprob_chunk_size=chunk, pack_sequences=pack,
        )  # fmt: skip
        model = MegatronGPTDPOModel(chunks, _Reference(ref), settings)
        assert model.sorts_batch
        b = dict(batch)
        b[REF_CHOSEN], b[REF_REJECTED] = model.get_ref_policy_logprobs(b).chunk(2)
        for c in chunks:
            c.zero_grad_buffer()
        _, metrics = model.get_loss_and_metrics(b, forward_only=False)
        out[pack] = (metrics, _grads(chunks))
    (m_a, g_a), (m_b, g_b) = out[False], out[True]
    for name, want in m_a.items():
        assert abs(m_b[name] - want) <= TOL * max(1.0, abs(want)), name
    for name, want in g_a.items():
        assert (g_b[name] - want).abs().max() <= TOL * want.abs().max(), name
