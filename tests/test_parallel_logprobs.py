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
from megatron_kto.models.logprobs import IGNORE_INDEX, token_logprobs
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


def _layout_logprobs(layout: Layout, ckpt: str, batch: dict) -> tuple[torch.Tensor, dict]:
    """Global-batch log-probs [B, T] on this rank under `layout`, and facts about the run."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

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
    facts = {"num_microbatches": len(micro), "schedule": get_forward_backward_func().__name__}
    return gather_over_dp(local_logp), facts


def _vocab_parallel_checks() -> dict:
    """`token_logprobs` on this rank's vocabulary slice vs `log_softmax` of the full logits.

    For each logit scale, full logits [B, T, V] (identical on every rank) are sliced to this TP
    rank's V/TP columns. Values are compared with float64 `log_softmax(full).gather(target)`
    and with float32 torch; gradients of a random weighting of the log-probs w.r.t. the slice
    are compared with float64 autograd through the full `log_softmax`.
    """
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    b, t, v = 3, 10, 128
    shard = v // tp_size
    g = torch.Generator().manual_seed(11)
    labels = torch.randint(0, v, (b, t), generator=g)
    labels[0, :4] = torch.arange(4) * (v // 4)  # targets in every rank's slice
    labels[1, 2] = v - 1
    labels[:, 0] = IGNORE_INDEX
    labels[2, 5:] = IGNORE_INDEX
    labels[1, 3] = 7  # its logit is made the clear argmax below: log-prob ~ 0
    mask = labels != IGNORE_INDEX
    target = labels.clamp(min=0)
    weights = torch.randn(b, t, generator=g)
    out: dict = {"tp_size": tp_size}
    for scale in (1.0, 1e4):
        full = torch.randn(b, t, v, generator=g) * scale
        full[1, 3, 7] = 5 * scale

        ref64 = full.double().requires_grad_()
        ref = torch.log_softmax(ref64, dim=-1).gather(-1, target[..., None])[..., 0] * mask
        (ref * weights).sum().backward()
        ref32 = torch.log_softmax(full, dim=-1).gather(-1, target[..., None])[..., 0] * mask

        local = full[..., tp_rank * shard : (tp_rank + 1) * shard].clone().requires_grad_()
        got = token_logprobs(local, labels)
        (got * weights).sum().backward()
        ref_grad = ref64.grad[..., tp_rank * shard : (tp_rank + 1) * shard].float()
        err = (got.double() - ref.detach()).abs()
        out[scale] = {
            "finite": bool(torch.isfinite(got).all()),
            "masked_exact_zero": bool((got[~mask] == 0).all()),
            "masked_grad_zero": bool((local.grad[~mask] == 0).all()),
            "max_err_vs_fp64": err.max().item(),
            "max_rel_err_vs_fp64": (err / ref.detach().abs().clamp(min=1)).max().item(),
            "max_err_vs_fp32_torch": (got - ref32).abs().max().item(),
            "max_grad_err": (local.grad - ref_grad).abs().max().item(),
            "min_logprob": ref.min().item(),
        }
    return out


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

    report: dict = {"reference": reference, "vocab_parallel_tp1": _vocab_parallel_checks()}
    for layout in LAYOUTS:
        got, facts = _layout_logprobs(layout, ckpt, batch)
        if layout.tp == 2 and layout.pp == 1:  # TP=2 groups are live: {0, 1} and {2, 3}
            report["vocab_parallel_tp2"] = _vocab_parallel_checks()
        report[layout.name] = {"max_abs_diff": (got - reference).abs().max().item(), **facts}
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


def _expected_schedule(layout: Layout) -> str:
    if layout.vpp:
        return "forward_backward_pipelining_with_interleaving"
    if layout.pp > 1:
        return "forward_backward_pipelining_without_interleaving"
    return "forward_backward_no_pipelining"


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
def test_layout_matches_tp1_pp1(reports, layout):
    """Every rank (every TP/PP/DP position) holds the TP1/PP1 log-probs to 1e-5, having run
    megatron's schedule for the layout (interleaved 1F1B for VPP) over several micro-batches."""
    for rank, rep in enumerate(reports):
        got = rep[layout.name]
        assert got["num_microbatches"] >= 2, "several micro-batches go through the schedule"
        assert got["schedule"] == _expected_schedule(layout)
        assert got["max_abs_diff"] <= TOLERANCE, f"rank {rank}: {got}"


@pytest.mark.parametrize("tp_key", ["vocab_parallel_tp1", "vocab_parallel_tp2"])
@pytest.mark.parametrize("scale", [1.0, 1e4], ids=["scale1", "scale1e4"])
def test_vocab_parallel_logprobs_match_full_log_softmax(reports, tp_key, scale):
    """`token_logprobs` on a V/TP logits slice equals log_softmax(full).gather(target):
    values within 1e-6 relative to float64 (|log p| up to ~4e4 at scale 1e4, where a naive
    exp would overflow), within 1e-5 of float32 torch at unit scale, masked positions exactly
    0 with zero gradient, and d/d(logits) within 1e-6 of float64 autograd."""
    for rank, rep in enumerate(reports):
        got = rep[tp_key][scale]
        assert rep[tp_key]["tp_size"] == (2 if tp_key.endswith("tp2") else 1)
        assert got["finite"] and got["masked_exact_zero"] and got["masked_grad_zero"], got
        assert got["max_rel_err_vs_fp64"] <= 1e-6, f"rank {rank}: {got}"
        if scale == 1.0:
            assert got["max_err_vs_fp32_torch"] <= TOLERANCE, f"rank {rank}: {got}"
        else:
            assert got["min_logprob"] < -1e4, "large-magnitude case must reach large log-probs"
        assert got["max_grad_err"] <= 1e-6, f"rank {rank}: {got}"
