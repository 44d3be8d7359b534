"""A checkpoint saved under one TP/PP/DP layout resumes under another (model AND optimizer).

Every DP rank trains on the same global batch (see test_checkpoint_harness), so the weights after
step 3 are layout-independent up to float rounding: resuming the step-2 checkpoint under another
layout and taking step 3 must land within 1e-5 of the source layout's own step 3. A control run
that restores only the weights (fresh Adam moments) misses by far more, so the comparison really
measures the resharded optimizer state.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from multirank import run_multirank

pytestmark = pytest.mark.multirank

TRAINER_STATE = {"epoch": 0, "consumed_samples": 8}

# (name, distributed optimizer?, source (TP, PP, VPP), destination (TP, PP, VPP)) on a world of
# 2: DP = 2 / (TP * PP). The interleaved (VPP) scenario uses 4 layers: one per model chunk.
SCENARIOS = [
    ("std_tp2_to_tp1dp2", False, (2, 1, None), (1, 1, None)),
    ("std_pp2_to_tp2", False, (1, 2, None), (2, 1, None)),
    ("dist_tp1dp2_to_tp2", True, (1, 1, None), (2, 1, None)),
    ("dist_pp2_to_tp1dp2", True, (1, 2, None), (1, 1, None)),
    ("dist_pp2vpp2_to_tp1dp2", True, (1, 2, 2), (1, 1, None)),
]


def _scenario(root: Path, dist_opt: bool, src: tuple, dst: tuple) -> dict:
    from test_checkpoint_harness import build_run, max_abs_diff, params_from_model_checkpoint

    from megatron_kto.checkpointing.manager import CheckpointManager, restore_pretrained
    from megatron_kto.checkpointing.model_io import save_model

    layers = 4 if src[2] or dst[2] else 2

    def build(layout: tuple, seed: int):
        tp, pp, vpp = layout
        return build_run(tp, pp, dist_opt, seed=seed, vpp=vpp, num_layers=layers)

    run = build(src, seed=1)
    manager = CheckpointManager(root / "ckpt")
    run.step(1)
    run.step(2)
    manager.save(2, run.chunks, run.optimizer, run.scheduler, TRAINER_STATE, "", run.arch)
    for ref in ("ref2", "ref3"):
        (root / ref).mkdir(parents=True, exist_ok=True)
    save_model(root / "ref2", run.chunks, run.arch)
    run.step(3)
    save_model(root / "ref3", run.chunks, run.arch)
    lr3 = run.optimizer.param_groups[0]["lr"]

    resumed = build(dst, seed=5)
    state = CheckpointManager(root / "ckpt").load_latest(
        resumed.chunks, resumed.optimizer, resumed.scheduler
    )
    weights_diff = max_abs_diff(
        resumed.params(), params_from_model_checkpoint(root / "ref2", resumed)
    )
    resumed.step(3)
    step_diff = max_abs_diff(resumed.params(), params_from_model_checkpoint(root / "ref3", resumed))

    control = build(dst, seed=5)
    restore_pretrained(root / "ckpt", control.chunks)
    control.scheduler.step(increment=2)
    control.step(3)
    control_diff = max_abs_diff(
        control.params(), params_from_model_checkpoint(root / "ref3", control)
    )
    return {
        "state": state,
        "weights_diff": weights_diff,
        "step_diff": step_diff,
        "control_diff": control_diff,
        "lr": (lr3, resumed.optimizer.param_groups[0]["lr"]),
    }


def _wrong_optimizer(root: Path) -> str:
    """Loading the distributed-optimizer checkpoint into the standard optimizer: one clear line."""
    from test_checkpoint_harness import build_run

    from megatron_kto.checkpointing.errors import CheckpointError
    from megatron_kto.checkpointing.manager import CheckpointManager

    run = build_run(2, 1, distributed_optimizer=False, seed=5)
    try:
        CheckpointManager(root / "ckpt").load_latest(run.chunks, run.optimizer, run.scheduler)
    except CheckpointError as e:
        return str(e)
    return "no error"


def _worker(rank: int, world_size: int, tmp: str) -> dict:
    from megatron_kto.runtime import teardown

    out = {}
    for name, dist_opt, src, dst in SCENARIOS:
        out[name] = _scenario(Path(tmp) / name, dist_opt, src, dst)
    out["wrong_optimizer"] = _wrong_optimizer(Path(tmp) / "dist_tp1dp2_to_tp2")
    teardown()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_multirank(_worker, 2, str(tmp_path_factory.mktemp("reshard")), timeout=400)


@pytest.mark.parametrize("name", [s[0] for s in SCENARIOS])
def test_resume_under_another_layout(results, name) -> None:
    for rank_result in results:
        r = rank_result[name]
        assert r["state"]["step"] == 2
        assert r["weights_diff"] == 0.0, "resharded weights differ from the saved ones"
        assert r["step_diff"] <= 1e-5, f"step after resharded resume off by {r['step_diff']:.2e}"
        assert r["control_diff"] > 1e-3, "control without optimizer state should diverge"
        assert r["lr"][0] == r["lr"][1]


def test_distributed_to_standard_optimizer_is_a_clear_error(results) -> None:
    message = results[0]["wrong_optimizer"]
    assert "distributed optimizer" in message and "standard optimizer" in message, message
    assert "TP=1 PP=1 DP=2" in message and "TP=2 PP=1 DP=1" in message, message
    assert "\n" not in message
