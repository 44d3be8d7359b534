"""Context parallelism equals CP = 1: one spawn of 4 gloo ranks, fp32, the real megatron-core
schedules, DDP and our SDPA context-parallel attention.

For each pair of layouts — CP=2 × DP=2 against DP=4; CP=2 × TP=2 (+SP) against TP=2 × DP=2;
CP=2 × PP=2 against PP=2 × DP=2 — the same weights take one KTO step (padded and packed
micro-batches) and one DPO step (padded and packed; packed again with `aot` / `aot_unpaired`,
whose sort over the global batch runs a policy pre-pass, and LD-DPO's `ld_alpha` weights)
through `MegatronGPTKTOModel` / `MegatronGPTDPOModel`:
reference pass (forward-only), the policy's KL pass (z₀), the training pass (forward + backward,
megatron's gradient reduction over the data- and context-parallel ranks). Rows are 3..16 tokens,
mostly not multiples of 2·CP (× TP under SP), so every row is padded before the split.

The CP=2 × PP=2 pair's model is a Gemma 3 (`gemma3_arch`: sliding windows of 5 tokens in layers
1 and 3 of 4, so each pipeline stage holds a windowed and a full layer, with the local RoPE base,
post-norms, (1 + w) norms, GeGLU, scaled embeddings), so windows and the per-layer RoPE under the
2·CP split are checked there.

Per-row reference log-probs (gathered over DP), every metric (z₀ and the loss included) and
every gradient this rank holds must agree to 1e-5 (gradients relative to each tensor's largest
entry). The CP=1 runs are the independent reference: they never split a row (`SDPAttention`'s
plain causal path, RoPE from `cu_seqlens`, no CP reduction).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from multirank import run_multirank
from test_packing_parallel import VOCAB, _examples, _grads, _Reference

from megatron_kto.data.collate import dpo_custom_collate, kto_custom_collate
from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks
from megatron_kto.models.dpo_model import (
    REF_CHOSEN,
    REF_REJECTED,
    DPOSettings,
    MegatronGPTDPOModel,
)
from megatron_kto.models.kto_model import REF_KL, REF_SAMPLES, KTOSettings, MegatronGPTKTOModel
from megatron_kto.models.schedule import to_device
from megatron_kto.models.training_setup import wrap_ddp
from megatron_kto.runtime import init_runtime, teardown

pytestmark = pytest.mark.multirank

WORLD = 4
TOL = 1e-5
#: name -> ((tp, pp, cp, sp) with CP, the same without CP)
PAIRS = {
    "cp2_dp2": ((1, 1, 2, False), (1, 1, 1, False)),
    "cp2_tp2_sp": ((2, 1, 2, True), (2, 1, 1, True)),
    "cp2_pp2": ((1, 2, 2, False), (1, 2, 1, False)),
}
RUNS = ("kto_padded", "kto_packed", "dpo_padded", "dpo_packed", "dpo_sorted_ld_packed")


def _chunks(rt, tp: int, pp: int, cp: int, sp: bool):
    """Policy (DDP-wrapped) and reference chunks, the same weights for every CP size."""
    from megatron.core import tensor_parallel
    from test_parallel_common import gemma3_arch, tiny_arch

    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    layout = ParallelLayout(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        sequence_parallel=sp,
        attention_backend="sdpa",
    )
    # The PP=2 pair (both of its layouts) runs a Gemma 3 (module docstring).
    arch = (gemma3_arch if pp == 2 else tiny_arch)(vocab_size=VOCAB)
    policy = build_gpt_chunks(arch, layout, rt.device)
    reference = build_gpt_chunks(arch, layout, rt.device)
    g = torch.Generator().manual_seed(100 + rt.pipeline_parallel_rank)
    with torch.no_grad():
        for pc, rc in zip(policy, reference, strict=True):
            for p, q in zip(pc.parameters(), rc.parameters(), strict=True):
                q.copy_(p + 0.2 * torch.randn(p.shape, generator=g))
    return wrap_ddp(policy, use_distributed_optimizer=False), reference


def _dp_share(batch: dict, rt) -> dict:
    n = next(iter(batch.values())).shape[0] // rt.data_parallel_size
    lo = rt.data_parallel_rank * n
    return to_device({k: v[lo : lo + n] for k, v in batch.items()}, rt.device)


def _gather_dp(values: torch.Tensor) -> torch.Tensor:
    """The whole global batch's values from every DP rank's share (in DP-rank order)."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    parts = [torch.empty_like(values) for _ in range(group.size())]
    torch.distributed.all_gather(parts, values.contiguous(), group=group)
    return torch.cat(parts)


def _run(rt, shape, run: str) -> dict:
    tp, pp, cp, sp = shape
    chunks, reference = _chunks(rt, tp, pp, cp, sp)
    pack = run.endswith("packed")
    if run.startswith("kto"):
        settings = KTOSettings(
            beta=0.5, desirable_weight=1.0, undesirable_weight=1.5, loss_type="kto",
            sft_loss_weight=0.2, micro_batch_size=1, forward_micro_batch_size=2,
            vocab_size=VOCAB, logprob_chunk_size=5, pack_sequences=pack,
        )  # fmt: skip
        model = MegatronGPTKTOModel(chunks, _Reference(reference), settings)
        batch = _dp_share(kto_custom_collate(_examples(seed=1), pad_id=0, max_length=16), rt)
        refs = model.get_ref_policy_logprobs(batch)
        rows = batch["samples"].shape[0]
        batch[REF_SAMPLES], batch[REF_KL] = refs[:rows], refs[rows:]
        per_row = torch.cat([_gather_dp(refs[:rows]), _gather_dp(refs[rows:])])
    else:
        settings = DPOSettings(
            beta=0.3, loss_type="sigmoid", label_smoothing=0.0, average_log_probs=False,
            sft_loss_weight=0.1, micro_batch_size=1, forward_micro_batch_size=2,
            vocab_size=VOCAB, logprob_chunk_size=5, pack_sequences=pack,
        )  # fmt: skip
        if "sorted_ld" in run:  # the global-batch sort's pre-pass and LD-DPO's weights
            settings = dataclasses.replace(
                settings, loss_type=("sigmoid", "aot", "aot_unpaired"),
                loss_weights=(1.0, 0.5, 0.5), label_smoothing=0.1, sft_loss_weight=0.0,
                ld_alpha=0.4,
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
        per_row = torch.cat([_gather_dp(part) for part in refs.chunk(2)])
    for c in chunks:
        c.zero_grad_buffer()
    _, metrics = model.get_loss_and_metrics(batch, forward_only=False)
    return {"refs": per_row, "metrics": metrics, "grads": _grads(chunks)}


def _compare(want: dict, got: dict) -> dict:
    return {
        "refs_err": (got["refs"] - want["refs"]).abs().max().item(),
        "refs_scale": want["refs"].abs().max().item(),
        "metrics": {k: (got["metrics"][k], v) for k, v in want["metrics"].items()},
        "grads": {
            name: ((got["grads"][name] - w).abs().max().item(), w.abs().max().item())
            for name, w in want["grads"].items()
        },
    }


def _worker(rank: int, world_size: int) -> dict:
    out = {}
    for name, (with_cp, without_cp) in PAIRS.items():
        results = {}
        for shape in (without_cp, with_cp):
            tp, pp, cp, _ = shape
            rt = init_runtime(tp, pp, seed=3, context_parallel_size=cp)
            results[cp] = {run: _run(rt, shape, run) for run in RUNS}
        for run in RUNS:
            out[f"{name}/{run}"] = _compare(results[1][run], results[2][run])
    teardown()
    return out


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return run_multirank(_worker, WORLD, timeout=600)


@pytest.mark.parametrize("case", [f"{p}/{r}" for p in PAIRS for r in RUNS])
def test_context_parallel_equals_cp1(reports, case):
    for rank, rep in enumerate(reports):
        got = rep[case]
        assert got["refs_scale"] > 1.0, "informative log-probs"
        assert got["refs_err"] <= TOL * got["refs_scale"], f"rank {rank}: reference {got}"
        for name, (value, want) in got["metrics"].items():
            assert abs(value - want) <= TOL * max(1.0, abs(want)), f"rank {rank}: {name}"
        if case.endswith("kto_padded") or case.endswith("kto_packed"):
            assert got["metrics"]["kl"][1] > 0, "z₀ > 0 should be exercised"
        assert got["grads"], "gradients compared"
        for name, (err, scale) in got["grads"].items():
            assert scale > 0, f"rank {rank}: {name} has no gradient"
            assert err <= TOL * scale, f"rank {rank}: {name} differs by {err} (max {scale})"
