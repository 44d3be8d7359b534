"""Per-token log-probs of the same weights agree across parallel layouts (4 gloo ranks).

One spawn of 4 ranks: build a TP=1/PP=1 model (seed 1), save it with `save_model`, compute the
reference log-probs by a plain forward of the whole batch; then for each layout re-initialise
megatron's parallel state, build the chunks with a *different* seed (so only the checkpoint can
make them equal), `load_model` (dist_checkpointing reshards), shard the batch over DP, run the
forward-only megatron schedule over several micro-batches collecting non-loss data,
`broadcast_from_last_stage` to every PP stage and all-gather over DP. Every rank reports its
max |Δ| against the reference.
"""

from __future__ import annotations

import pytest
import torch
from multirank import run_multirank
from test_parallel_common import (
    Layout,
    dp_shard,
    gather_over_dp,
    logprob_forward_step,
    make_batch,
    tiny_arch,
)

from megatron_kto.checkpointing.model_io import load_model, save_model
from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks
from megatron_kto.models.logprobs import token_logprobs
from megatron_kto.models.schedule import (
    broadcast_from_last_stage,
    run_schedule,
    split_micro_batches,
)
from megatron_kto.runtime import init_runtime, teardown

pytestmark = pytest.mark.multirank

WORLD = 4
LAYOUTS = [
    Layout("tp2_dp2", tp=2, pp=1),
    Layout("pp2_dp2", tp=1, pp=2),
    Layout("tp2_pp2", tp=2, pp=2),
    Layout("pp2_vpp2_dp2", tp=1, pp=2, vpp=2),
    Layout("dp4", tp=1, pp=1),
]
TOLERANCE = 1e-5


def _layout_logprobs(layout: Layout, ckpt: str, batch: dict) -> tuple[torch.Tensor, int]:
    """Global-batch log-probs [B, T] on this rank under `layout`; also the micro-batch count."""
    from megatron.core import parallel_state

    arch = tiny_arch()
    rt = init_runtime(layout.tp, layout.pp, layout.vpp, seed=2)
    chunks = build_gpt_chunks(arch, layout.parallel_layout(), rt.device)
    load_model(ckpt, chunks)
    for c in chunks:
        c.eval()
    local = dp_shard(batch, rt.data_parallel_rank, rt.data_parallel_size)
    micro = split_micro_batches(local, micro_batch_size=1)
    with torch.no_grad():
        results = run_schedule(
            chunks, micro, logprob_forward_step, forward_only=True, collect_non_loss_data=True
        )
    is_last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    assert len(results) == (len(micro) if is_last else 0), "results only on the last stage"
    shape = tuple(local["labels"].shape)
    local_logp = broadcast_from_last_stage(
        torch.cat(results) if is_last else None, shape, torch.float32, rt.device
    )
    return gather_over_dp(local_logp), len(micro)


def _worker(rank: int, world_size: int, ckpt: str) -> dict:
    arch = tiny_arch()
    batch = make_batch(arch.vocab_size)

    rt = init_runtime(1, 1, seed=1)
    (ref_model,) = build_gpt_chunks(arch, ParallelLayout(), rt.device)
    ref_model.eval()
    with torch.no_grad():
        logits = ref_model(batch["samples"], batch["position_ids"], None)
        reference = token_logprobs(logits, batch["labels"])
    save_model(ckpt, [ref_model], arch)

    report: dict = {"reference": reference}
    for layout in LAYOUTS:
        got, n_micro = _layout_logprobs(layout, ckpt, batch)
        report[layout.name] = {
            "max_abs_diff": (got - reference).abs().max().item(),
            "num_microbatches": n_micro,
        }
    teardown()
    return report


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    ckpt = tmp_path_factory.mktemp("logprobs_ckpt")
    return run_multirank(_worker, WORLD, str(ckpt), timeout=240)


def test_reference_is_informative(reports):
    """The reference log-probs are far from uniform and masked positions are exactly 0."""
    ref = reports[0]["reference"]
    labels = make_batch(tiny_arch().vocab_size)["labels"]
    scored = ref[labels != -100]
    assert torch.all(ref[labels == -100] == 0)
    assert scored.std() > 0.3, "near-uniform log-probs would make the comparison weak"


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
def test_layout_matches_tp1_pp1(reports, layout):
    """Every rank (every TP/PP/DP position) holds the TP1/PP1 log-probs to 1e-5."""
    for rank, rep in enumerate(reports):
        got = rep[layout.name]
        assert got["num_microbatches"] >= 2, "several micro-batches go through the schedule"
        assert got["max_abs_diff"] <= TOLERANCE, f"rank {rank}: {got}"
