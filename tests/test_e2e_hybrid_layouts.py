"""A tiny Qwen3.5 (`qwen3_5_text`: DeltaNet, attention, DeltaNet, attention) trains the same
steps at PP=2 × VPP=2 and with the distributed optimizer at DP=2 as on one rank.

One HF directory (`test_qwen3_5_trl_parity._make_qwen3_5`, layers DeltaNet, attention, attention,
DeltaNet) is imported once; the entry script runs 2 fp32 KTO steps from it on one rank, at
PP=2 × VPP=2 (each of the 4 virtual chunks holds one layer: rank 0 layers 0 and 2, DeltaNet then
attention, rank 1 layers 1 and 3, attention then DeltaNet — so each rank's two chunks are of
different kinds and a layer kind taken from the chunk-local index would not load) and at DP=2 with `distributed_fused_adam` (gradients
reduce-scattered, parameters all-gathered). Every step's metrics and the final weights (read back
at TP=1) must equal the one-rank run's to 1e-5 relative — fp32 round-off — while the weights move
far beyond it (asserted).
"""

from __future__ import annotations

import pytest
from e2e_cli import KTO_SCRIPT, load_tp1_state_dicts, read_metrics, run_script
from hf_tiny import write_kto_rows
from test_qwen3_5_trl_parity import _make_qwen3_5
from trl_harness import import_start, imported_run

pytestmark = pytest.mark.e2e

STEPS = 2
RTOL = 1e-5
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "kl")
#: name -> (processes, extra overrides)
LAYOUTS = {
    "one_rank": (1, []),
    "pp2_vpp2": (
        2,
        ["model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2"],
    ),
    "dp2_distopt": (2, ["model.optim.name=distributed_fused_adam"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_layouts")
    _make_qwen3_5(
        root / "hf", ("linear_attention", "full_attention", "full_attention", "linear_attention")
    )
    write_kto_rows(root / "train.jsonl", 0, 16)
    import_start(root)
    metrics = {}
    for name, (nproc, extra) in LAYOUTS.items():
        overrides = [
            *imported_run(root, name),
            f"trainer.kto.max_steps={STEPS}",
            "model.global_batch_size=8",
            "model.micro_batch_size=2",
            "model.optim.sched.name=Constant",
            "model.optim.sched.warmup_steps=0",
            "model.optim.lr=1e-3",
            "model.kto.sft_loss_weight=1.0",
        ]
        run_script(KTO_SCRIPT, [*overrides, *extra], nproc=nproc, timeout=600)
        metrics[name] = read_metrics(root / name)
    states = load_tp1_state_dicts([root / "mcore", *(root / name for name in LAYOUTS)])
    return {"start": states[0], **{n: (metrics[n], states[i + 1]) for i, n in enumerate(LAYOUTS)}}


def _rel(state: dict, reference: dict) -> dict[str, float]:
    return {
        k: float((state[k] - reference[k]).abs().max() / reference[k].abs().max().clamp(min=1e-12))
        for k in reference
    }


@pytest.mark.parametrize("layout", ["pp2_vpp2", "dp2_distopt"])
def test_layout_trains_as_one_rank(runs, layout):
    ref_metrics, ref_state = runs["one_rank"]
    metrics, state = runs[layout]
    assert [r["step"] for r in metrics] == [r["step"] for r in ref_metrics] == [1, 2]
    worst = {
        key: max(
            abs(r[key] - q[key]) / max(abs(q[key]), 1e-6) for r, q in zip(metrics, ref_metrics)
        )
        for key in METRICS
    }
    assert state.keys() == ref_state.keys()
    weights = _rel(state, ref_state)
    moved = _rel(ref_state, runs["start"])
    deltanet = [k for k in moved if "linear_attn" in k or "in_proj" in k or "conv1d" in k]
    print(
        f"\n{layout}: metrics max rel {max(worst.values()):.1e}, weights max rel "
        f"{max(weights.values()):.1e}; smallest DeltaNet move {min(moved[k] for k in deltanet):.1e}"
    )
    assert all(v <= RTOL for v in worst.values()), worst
    assert max(weights.values()) <= RTOL, {k: v for k, v in weights.items() if v > RTOL}
    assert deltanet and min(moved[k] for k in deltanet) > 100 * RTOL
