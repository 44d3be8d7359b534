"""The bf16 chunked output layer, megatron's way: bf16 hidden states, an fp32 weight gradient.

1. Accumulation (1 process): one bf16 KTO training step through the real path
   (`MegatronGPTKTOModel`, megatron DDP, the schedule) with the output layer in chunks of 2 tokens
   — about 120 chunks per micro-batch, ~490 scored tokens in 2 micro-batches. A spy records
   exactly what reaches `chunked_token_logprobs` (hidden states, weight, targets) and the
   gradient that comes back to its log-probs. The reference rebuilds the weight gradient from
   those in float64: logits = h·Wᵀ rounded to bf16 (the chunk's bf16 GEMM), softmax, the logit
   gradient g·(onehot − softmax) rounded to bf16 (the dtype the output layer's gradients
   flow in, as megatron's `grad_output`), then Σ over every token of every micro-batch exactly.
   Everything left is the summation itself: in fp32 (`main_grad`) it is ~1e-7 relative plus rare
   one-ulp flips where fp32 and fp64 softmaxes round to different bf16 values, so the output
   layer's `main_grad` must match to 1e-4 (relative L2); a running bf16 sum over ~240 chunks
   misses by ~1e-2 (bf16 keeps 8 significant bits; each chunk rounds the total again).
   Tied embeddings on one stage: the embedding's `main_grad` must hold the head's part *and*
   the lookup's own gradient (megatron's: `F.embedding`'s bf16 backward per micro-batch of the
   gradient captured at the lookup's output), to the same tolerance.
2. Layouts (2 gloo ranks, megatron's training schedule with DDP): the hidden states handed to
   the chunked head are bf16 under bf16 — TP=1 (above), TP=2 without and with sequence
   parallelism (then also the all-gathered tensor), the last stage of PP=2 with tied
   embeddings and of PP=2×VPP=2 — and fp32 under fp32. With TP=2 (±SP) each rank's
   vocabulary slice of the weight gradient matches the float64 reference over the full
   vocabulary; with PP=2 and tied embeddings both stages' copies hold head + lookup gradient
   after megatron's embedding-group all-reduce.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch
from multirank import run_multirank

pytestmark = pytest.mark.multirank

VOCAB = 100
PADDED = 128
SEQ = 128
CHUNK = 2
ACCUMULATION_TOL = 1e-4


def _kto_batch(rows: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    """Long completions: every position after a 3-token prompt is scored."""
    g = torch.Generator().manual_seed(seed)
    batch = {}
    for key in ("samples", "kl_samples"):
        tokens = torch.randint(0, VOCAB, (rows, length), generator=g)
        labels = tokens.roll(-1, 1).clone()
        labels[:, :3] = -100
        labels[:, -1] = -100
        batch[key] = tokens
        batch[key.replace("samples", "sample_labels")] = labels
        batch[key.replace("samples", "sample_lengths")] = torch.full((rows,), length)
    batch["position_ids"] = torch.arange(length).expand(rows, length).clone()
    batch["preference"] = torch.tensor([1, 0] * (rows // 2))
    return batch


@contextlib.contextmanager
def _spy_head(records: list[dict]):
    """Record every call of the chunked head (inputs, and the gradient of its log-probs) and the
    dtype of the hidden states `completion_stats` receives; the real functions still run."""
    from megatron.core import tensor_parallel

    from megatron_kto.models import forward, output_head

    real_head, real_stats = output_head.chunked_token_logprobs, forward.completion_stats
    real_gather = tensor_parallel.gather_from_sequence_parallel_region

    def head(hidden, weight, target, chunk_size, vocab_size):
        logp, mean_logit = real_head(hidden, weight, target, chunk_size, vocab_size)
        record = {
            "hidden": hidden.detach().clone(),
            "weight": weight.detach().clone(),
            "target": target.clone(),
        }
        if logp.requires_grad:
            logp.register_hook(lambda g, r=record: r.__setitem__("grad", g.detach().clone()))
        records.append(record)
        return logp, mean_logit

    def stats(hidden, *args, **kwargs):
        records.append({"stats_input_dtype": hidden.dtype})
        return real_stats(hidden, *args, **kwargs)

    def gather(tensor, *args, **kwargs):
        records.append({"gathered_dtype": tensor.dtype})
        return real_gather(tensor, *args, **kwargs)

    output_head.chunked_token_logprobs = head
    forward.completion_stats = stats
    tensor_parallel.gather_from_sequence_parallel_region = gather
    try:
        yield
    finally:
        output_head.chunked_token_logprobs = real_head
        forward.completion_stats = real_stats
        tensor_parallel.gather_from_sequence_parallel_region = real_gather


@contextlib.contextmanager
def _spy_lookups(gpt, lookups: list[dict]):
    """Record the ids and the gradient at the output of `gpt`'s embedding lookup (when it has
    one: None is a stage without the embedding) for every lookup that gets a backward."""

    def capture(module, inputs, output):
        if output.requires_grad:
            record = {"ids": inputs[0].detach().clone()}
            output.register_hook(lambda g, r=record: r.__setitem__("grad", g.detach().clone()))
            lookups.append(record)

    hook = gpt.embedding.word_embeddings.register_forward_hook(capture) if gpt else None
    try:
        yield
    finally:
        if hook is not None:
            hook.remove()


def _backward_calls(records: list[dict]) -> list[dict]:
    return [r for r in records if "grad" in r]


def _dtypes(records: list[dict], key: str) -> set:
    return {r[key] for r in records if key in r}


def _accumulation_step(rank: int, world_size: int, tied: bool) -> dict:
    """One bf16 KTO step (TP=1); the head's captured calls and the main_grads after it."""
    from megatron_kto.config.architecture import GPTArchitecture
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks, unwrap
    from megatron_kto.models.kto_model import (
        REF_KL,
        REF_SAMPLES,
        KTOSettings,
        MegatronGPTKTOModel,
    )
    from megatron_kto.models.reference import CPUSwapReference
    from megatron_kto.models.training_setup import wrap_ddp
    from megatron_kto.runtime import init_runtime, teardown

    rt = init_runtime(1, 1, seed=5)
    arch = GPTArchitecture(
        vocab_size=VOCAB,
        padded_vocab_size=PADDED,
        hidden_size=64,
        ffn_hidden_size=128,
        num_layers=2,
        encoder_seq_length=SEQ,
        init_method_std=0.05,
        share_embeddings_and_output_weights=tied,
    )
    chunks = wrap_ddp(
        build_gpt_chunks(arch, ParallelLayout(precision="bf16"), rt.device),
        use_distributed_optimizer=False,
    )
    settings = KTOSettings(
        beta=0.5,
        desirable_weight=1.0,
        undesirable_weight=1.5,
        loss_type="kto",
        sft_loss_weight=0.3,
        micro_batch_size=2,
        forward_micro_batch_size=2,
        vocab_size=VOCAB,
        logprob_chunk_size=CHUNK,
    )
    model = MegatronGPTKTOModel(chunks, CPUSwapReference(chunks), settings)
    gpt = unwrap(chunks[0])
    batch = _kto_batch(rows=4, length=SEQ, seed=6)
    batch[REF_SAMPLES], batch[REF_KL] = model.get_ref_policy_logprobs(batch).chunk(2)
    for c in chunks:
        c.zero_grad_buffer()
    records: list[dict] = []
    lookups: list[dict] = []
    with _spy_head(records), _spy_lookups(gpt, lookups):
        model.get_loss_and_metrics(batch, forward_only=False)
    head_weight = gpt.shared_embedding_or_output_weight() if tied else gpt.output_layer.weight
    teardown()
    return {
        "calls": _backward_calls(records),
        "stats_input_dtypes": _dtypes(records, "stats_input_dtype"),
        "main_grad": head_weight.main_grad.clone(),
        "lookups": lookups,
    }


def reference_weight_grad(calls: list[dict]) -> torch.Tensor:
    """Float64 Σ over tokens of bf16(g·(onehot − softmax(bf16(h·Wᵀ))))ᵀ·h, full vocabulary."""
    total = None
    for call in calls:
        h, weight = call["hidden"].double(), call["weight"].double()
        logits = (h @ weight.t()).bfloat16().double()
        logits[:, VOCAB:] = float("-inf")  # padded vocabulary columns are not tokens
        softmax = torch.softmax(logits, dim=-1)
        onehot = torch.nn.functional.one_hot(call["target"], weight.shape[0]).double()
        grad_logits = (call["grad"].double()[:, None] * (onehot - softmax)).bfloat16().double()
        part = grad_logits.t() @ h
        total = part if total is None else total + part
    assert total is not None
    return total


def _lookup_grad(lookups: list[dict], shape: torch.Size) -> torch.Tensor:
    """The embedding lookup's own gradient as megatron forms it: per micro-batch, the backward
    of `F.embedding` on the bf16 table (what `VocabParallelEmbedding` calls at TP=1) applied to
    the gradient captured at the lookup's output; DDP's hook adds each in fp32."""
    total = torch.zeros(shape, dtype=torch.float64)
    for r in lookups:
        table = torch.zeros(shape, dtype=r["grad"].dtype, requires_grad=True)
        torch.nn.functional.embedding(r["ids"], table).backward(r["grad"])
        total += table.grad.double()
    return total


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def accumulation(request) -> dict:
    return run_multirank(_accumulation_step, 1, request.param, timeout=300)[0] | {
        "tied": request.param
    }


def test_step_runs_many_chunks_on_bf16_hidden_states(accumulation):
    calls = accumulation["calls"]
    tokens = sum(c["target"].numel() for c in calls)
    assert len(calls) == 2 and tokens >= 400, (len(calls), tokens)  # 2 micro-batches
    assert min(c["target"].numel() for c in calls) // CHUNK >= 100  # >= 100 chunks each
    assert {c["hidden"].dtype for c in calls} == {torch.bfloat16}
    assert accumulation["stats_input_dtypes"] == {torch.bfloat16}, "no fp32 upcast before the head"


def test_output_weight_gradient_sums_in_fp32(accumulation):
    """The head's share of `main_grad` equals the exact sum of its per-token products."""
    calls = accumulation["calls"]
    head = reference_weight_grad(calls)
    got = accumulation["main_grad"]
    assert got.dtype == torch.float32
    if accumulation["tied"]:
        # The embedding's own gradient must be there too (DDP's hook must not drop it).
        lookup = _lookup_grad(accumulation["lookups"], head.shape)
        assert lookup.norm() >= 0.5 * head.norm(), "the lookup must matter for the test to bite"
        head = head + lookup
    assert _relative(got, head) <= ACCUMULATION_TOL, _relative(got, head)


@dataclass(frozen=True)
class Case:
    """A layout on 2 ranks for the dtype checks."""

    name: str
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    sp: bool = False
    tied: bool = False
    precision: str = "bf16"

    def last_stage(self, rank: int) -> bool:
        return self.pp == 1 or rank == 1


CASES = [
    Case("tp2_bf16", tp=2),
    Case("tp2_sp_bf16", tp=2, sp=True),
    Case("pp2_tied_bf16", pp=2, tied=True),
    Case("pp2_vpp2_bf16", pp=2, vpp=2),
    Case("tp2_sp_fp32", tp=2, sp=True, precision="32"),
]


def _dtype_layout(case: Case) -> dict:
    """One training schedule over 2 micro-batches through the chunked head; what it saw."""
    from megatron_kto.config.architecture import GPTArchitecture
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks, unwrap
    from megatron_kto.models.forward import LOGP_SUM, stats_forward_step
    from megatron_kto.models.schedule import run_schedule, split_micro_batches, to_device
    from megatron_kto.models.training_setup import wrap_ddp
    from megatron_kto.runtime import init_runtime

    rt = init_runtime(case.tp, case.pp, case.vpp, seed=9)
    arch = GPTArchitecture(
        vocab_size=VOCAB,
        padded_vocab_size=PADDED,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_layers=4 if case.vpp else 2,
        encoder_seq_length=32,
        init_method_std=0.05,
        share_embeddings_and_output_weights=case.tied,
    )
    layout = ParallelLayout(
        tensor_model_parallel_size=case.tp,
        pipeline_model_parallel_size=case.pp,
        virtual_pipeline_model_parallel_size=case.vpp,
        sequence_parallel=case.sp,
        precision=case.precision,
    )
    chunks = wrap_ddp(build_gpt_chunks(arch, layout, rt.device), use_distributed_optimizer=False)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, VOCAB, (4, 32), generator=g)
    labels = tokens.roll(-1, 1).clone()
    labels[:, :5] = -100
    labels[:, -1] = -100
    batch = to_device(
        {"tokens": tokens, "labels": labels, "position_ids": torch.arange(32).expand(4, 32)},
        rt.device,
    )
    micro = split_micro_batches(batch, 2, scored=batch["host_scored"]["labels"])

    def loss(_batch, stats):
        return -stats[:, LOGP_SUM].sum(), {}

    for c in chunks:
        c.zero_grad_buffer()
    records: list[dict] = []
    lookups: list[dict] = []
    first, last = unwrap(chunks[0]), unwrap(chunks[-1])
    with _spy_head(records), _spy_lookups(first if first.pre_process else None, lookups):
        run_schedule(chunks, micro, stats_forward_step(loss, VOCAB, 4), forward_only=False)
    # The head's weight on this stage: the output layer, or the tied embedding on either end.
    head = None
    if case.tied and first.pre_process:
        head = first.shared_embedding_or_output_weight()
    elif last.post_process:
        head = last.output_layer.weight
    return {
        "stats_input_dtypes": _dtypes(records, "stats_input_dtype"),
        "gathered_dtypes": _dtypes(records, "gathered_dtype"),
        "calls": _backward_calls(records),
        "lookups": lookups,
        "main_grad": None if head is None else head.main_grad.clone(),
    }


def _dtype_worker(rank: int, world_size: int) -> list[dict]:
    from megatron_kto.runtime import teardown

    # One process group for every layout (`init_runtime` re-initialises megatron's groups).
    reports = [_dtype_layout(case) for case in CASES]
    teardown()
    return reports


@pytest.fixture(scope="module")
def dtype_reports() -> list[list[dict]]:
    return run_multirank(_dtype_worker, 2, timeout=300)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.name for c in CASES])
def test_hidden_states_reach_the_head_in_the_compute_dtype(dtype_reports, index):
    case = CASES[index]
    expected = torch.bfloat16 if case.precision == "bf16" else torch.float32
    for rank, reports in enumerate(dtype_reports):
        report = reports[index]
        seen = report["stats_input_dtypes"]
        assert seen == ({expected} if case.last_stage(rank) else set()), (case.name, rank, seen)
        if case.sp:  # the sequence-parallel all-gather moves it as is
            assert report["gathered_dtypes"] == {expected}, (case.name, rank)
        if case.last_stage(rank):
            assert {c["hidden"].dtype for c in report["calls"]} == {expected}


def test_tied_embedding_across_stages_sums_in_fp32(dtype_reports):
    """PP=2, tied: after megatron's embedding-group all-reduce both stages' copies hold the head's
    gradient (last stage) plus the lookup's (first stage)."""
    index = next(i for i, c in enumerate(CASES) if c.name == "pp2_tied_bf16")
    first, last = (reports[index] for reports in dtype_reports)
    head = reference_weight_grad(last["calls"])
    lookup = _lookup_grad(first["lookups"], head.shape)
    assert lookup.norm() >= 0.5 * head.norm(), "the lookup must matter for the test to bite"
    for rank, report in enumerate((first, last)):
        rel = _relative(report["main_grad"], head + lookup)
        assert rel <= ACCUMULATION_TOL, (rank, rel)


@pytest.mark.parametrize("name", ["tp2_bf16", "tp2_sp_bf16"])
def test_tensor_parallel_slices_sum_in_fp32(dtype_reports, name):
    """TP=2 bf16 (with and without SP): each rank's slice of `main_grad` against the
    full-vocabulary reference."""
    index = next(i for i, c in enumerate(CASES) if c.name == name)
    ranks = [reports[index] for reports in dtype_reports]
    calls = []
    for parts in zip(*(r["calls"] for r in ranks), strict=True):
        # The (gathered,) selected states are the same on both ranks; the weight is split.
        assert torch.equal(parts[0]["hidden"], parts[1]["hidden"])
        calls.append(parts[0] | {"weight": torch.cat([p["weight"] for p in parts])})
    want = reference_weight_grad(calls)
    width = PADDED // 2
    for rank, report in enumerate(ranks):
        got = report["main_grad"]
        rel = _relative(got, want[rank * width : (rank + 1) * width])
        assert rel <= ACCUMULATION_TOL, (rank, rel)
