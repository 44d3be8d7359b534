"""Padding-free micro-batches equal the padded path under TP (with sequence parallelism), PP,
PP × VPP and DP: one spawn of 4 gloo ranks, fp32, the real megatron-core schedules.

For each layout the same weights take one KTO step (and, for two layouts, one DPO step) through
`MegatronGPTKTOModel` / `MegatronGPTDPOModel` twice — rows padded to the batch's longest, then
packed end to end — on this rank's DP share of one global batch with long-tailed row lengths:

* the reference pass over samples + KL rows (forward-only; results broadcast to every stage),
* the policy's forward-only pass over the KL rows (z₀, all-reduced over DP),
* the training pass in micro-batches (forward + backward; megatron's DP all-reduce and
  tied-embedding sync in `finalize_model_grads`).

The TP=2 (+SP) × PP=2 layout runs a Gemma 3 model (`gemma3_arch`: sliding windows shorter than
most rows, a local RoPE base, post-norms, (1 + w) norms, GeGLU, scaled embeddings).

Reference log-probs, every metric (z₀ included) and every gradient this rank holds must agree
to 1e-5 (gradients: relative to each tensor's largest entry). Under sequence parallelism each
packed micro-batch is padded to a multiple of TP; under PP every packed micro-batch of a pass to
the pass's longest packed length (`schedule.pipeline_packed_length`).
"""

from __future__ import annotations

import pytest
import torch
from multirank import run_multirank
from test_parallel_common import Layout, gemma3_arch, kto_train_step, tiny_arch

from megatron_kto.data.collate import dpo_custom_collate, kto_custom_collate
from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks, unwrap
from megatron_kto.models.dpo_model import (
    REF_CHOSEN,
    REF_REJECTED,
    DPOSettings,
    MegatronGPTDPOModel,
)
from megatron_kto.models.kto_model import KTOSettings, MegatronGPTKTOModel
from megatron_kto.models.schedule import to_device
from megatron_kto.models.training_setup import wrap_ddp
from megatron_kto.runtime import init_runtime, teardown

pytestmark = pytest.mark.multirank

WORLD = 4
VOCAB = 100
TOL = 1e-5
GLOBAL_ROWS = 8
#: (layout, sequence parallel, also run DPO)
LAYOUTS = [
    (Layout("tp2_sp_dp2", tp=2, pp=1), True, True),
    (Layout("pp2_dp2", tp=1, pp=2), False, True),
    (Layout("tp2_sp_pp2", tp=2, pp=2), True, False),
    (Layout("pp2_vpp2_dp2", tp=1, pp=2, vpp=2), False, False),
]


#: The layout whose model is a Gemma 3 (module docstring).
GEMMA_LAYOUT = "tp2_sp_pp2"


def _examples(seed: int) -> list[dict]:
    """GLOBAL_ROWS KTO examples of 3..16 tokens (prompt 2..6), so rows differ a lot in length."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(GLOBAL_ROWS):
        p = int(torch.randint(2, 7, (1,), generator=g))
        c = int(torch.randint(1, 17 - p, (1,), generator=g))
        out.append(
            {
                "prompt_ids": torch.randint(1, VOCAB, (p,), generator=g).tolist(),
                "completion_ids": torch.randint(1, VOCAB, (c,), generator=g).tolist(),
                "label": i % 3 != 1,
            }
        )
    return out


def _dp_share(batch: dict, rt) -> dict:
    """This DP rank's contiguous share of a host batch's rows (before `to_device`)."""
    n = next(iter(batch.values())).shape[0] // rt.data_parallel_size
    lo = rt.data_parallel_rank * n
    return to_device({k: v[lo : lo + n] for k, v in batch.items()}, rt.device)


class _Reference:
    def __init__(self, chunks):
        self.chunks = chunks

    def log_probs(self, batch, forward):
        return forward(self.chunks)


def _chunks(rt, layout: Layout, sp: bool):
    """Policy (DDP-wrapped) and reference chunks; the same weights for both runs of a layout."""
    from megatron.core import tensor_parallel

    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    parallel = ParallelLayout(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        sequence_parallel=sp,
    )
    make = gemma3_arch if layout.name == GEMMA_LAYOUT else tiny_arch
    arch = make(vocab_size=VOCAB)
    policy = build_gpt_chunks(arch, parallel, rt.device)
    reference = build_gpt_chunks(arch, parallel, rt.device)
    # The same noise on every TP and DP rank of a pipeline stage: replicated weights (norms, and
    # every weight across DP) must stay identical across the ranks that hold them.
    g = torch.Generator().manual_seed(100 + rt.pipeline_parallel_rank)
    with torch.no_grad():
        for pc, rc in zip(policy, reference, strict=True):
            for p, q in zip(pc.parameters(), rc.parameters(), strict=True):
                q.copy_(p + 0.2 * torch.randn(p.shape, generator=g))
    return wrap_ddp(policy, use_distributed_optimizer=False), reference


def _grads(chunks) -> dict[str, torch.Tensor]:
    return {
        f"{i}.{n}": p.main_grad.clone()
        for i, c in enumerate(chunks)
        for n, p in unwrap(c).named_parameters()
    }


def _kto(rt, layout: Layout, sp: bool, pack: bool) -> dict:
    chunks, reference = _chunks(rt, layout, sp)
    settings = KTOSettings(
        beta=0.5, desirable_weight=1.0, undesirable_weight=1.5, loss_type="kto",
        sft_loss_weight=0.2, micro_batch_size=2, forward_micro_batch_size=2, vocab_size=VOCAB,
        logprob_chunk_size=5, pack_sequences=pack,
    )  # fmt: skip
    model = MegatronGPTKTOModel(chunks, _Reference(reference), settings)
    batch = _dp_share(kto_custom_collate(_examples(seed=1), pad_id=0, max_length=16), rt)
    refs, _, metrics = kto_train_step(model, chunks, batch)
    return {"refs": refs, "metrics": metrics, "grads": _grads(chunks)}


def _dpo(rt, layout: Layout, sp: bool, pack: bool) -> dict:
    chunks, reference = _chunks(rt, layout, sp)
    settings = DPOSettings(
        beta=0.3, loss_type="sigmoid", label_smoothing=0.0, average_log_probs=False,
        sft_loss_weight=0.1, micro_batch_size=1, forward_micro_batch_size=2, vocab_size=VOCAB,
        logprob_chunk_size=5, pack_sequences=pack,
    )  # fmt: skip
    model = MegatronGPTDPOModel(chunks, _Reference(reference), settings)
    ex = _examples(seed=2)
    pairs = [
        {"prompt_ids": a["prompt_ids"], "chosen_ids": a["completion_ids"],
         "rejected_ids": b["completion_ids"][: 16 - len(a["prompt_ids"])]}
        for a, b in zip(ex, ex[::-1], strict=True)
    ]  # fmt: skip
    batch = _dp_share(dpo_custom_collate(pairs, pad_id=0), rt)
    refs = model.get_ref_policy_logprobs(batch)
    batch[REF_CHOSEN], batch[REF_REJECTED] = refs.chunk(2)
    for c in chunks:
        c.zero_grad_buffer()
    _, metrics = model.get_loss_and_metrics(batch, forward_only=False)
    return {"refs": refs, "metrics": metrics, "grads": _grads(chunks)}


def _compare(padded: dict, packed: dict) -> dict:
    grads = {}
    for name, want in padded["grads"].items():
        grads[name] = ((packed["grads"][name] - want).abs().max().item(), want.abs().max().item())
    return {
        "refs_err": (packed["refs"] - padded["refs"]).abs().max().item(),
        "refs_scale": padded["refs"].abs().max().item(),
        "metrics": {k: (packed["metrics"][k], v) for k, v in padded["metrics"].items()},
        "grads": grads,
    }


def _worker(rank: int, world_size: int) -> dict:
    out = {}
    for layout, sp, dpo in LAYOUTS:
        rt = init_runtime(layout.tp, layout.pp, layout.vpp, seed=3)
        runs = {"kto": _kto}
        if dpo:
            runs["dpo"] = _dpo
        for algo, fn in runs.items():
            padded, packed = fn(rt, layout, sp, False), fn(rt, layout, sp, True)
            out[f"{layout.name}/{algo}"] = _compare(padded, packed)
    teardown()
    return out


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return run_multirank(_worker, WORLD, timeout=400)


CASES = [
    f"{layout.name}/{algo}" for layout, _, dpo in LAYOUTS for algo in ("kto", "dpo")[: 1 + dpo]
]


@pytest.mark.parametrize("case", CASES)
def test_packed_equals_padded(reports, case):
    for rank, rep in enumerate(reports):
        got = rep[case]
        assert got["refs_scale"] > 1.0, "informative log-probs"
        assert got["refs_err"] <= TOL * got["refs_scale"], f"rank {rank}: reference {got}"
        for name, (value, want) in got["metrics"].items():
            assert abs(value - want) <= TOL * max(1.0, abs(want)), f"rank {rank}: {name}"
        if case.endswith("kto"):
            assert got["metrics"]["kl"][1] > 0, "z₀ > 0 should be exercised"
        for name, (err, scale) in got["grads"].items():
            assert scale > 0, f"rank {rank}: {name} gets no gradient"
            assert err <= TOL * scale, f"rank {rank}: {name} |Δ| {err:.2e} vs {scale:.2e}"
