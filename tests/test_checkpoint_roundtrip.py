"""Save → resume is exact: model, Adam state, scheduler, RNG and trainer state (DP=2, 2 ranks).

Each scenario trains 2 steps with dropout on, saves, and continues 2 more steps; a fresh run
(different seed, so different weights and RNG) that resumes from the checkpoint must reproduce
those 2 steps bit for bit, as must the original run reloading the checkpoint into its own,
already advanced, optimizer and scheduler. Both megatron optimizers are covered; the distributed
one is also saved before its first step, and with bf16 parameters (fp32 main weights).

The second half proves each megatron-core 0.16.1 workaround in `optimizer_state.py`
is needed: with the workaround switched off, the same resume fails or diverges.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from multirank import run_multirank

pytestmark = pytest.mark.multirank

CONFIG_YAML = "model:\n  seed: 1\n"
TRAINER_STATE = {"epoch": 0, "consumed_samples": 8, "sampler": {"seed": 3, "order": [2, 0, 1]}}


def _draws() -> list[float]:
    """One draw from each generator a resume must restore (megatron's tracker: via dropout)."""
    return [torch.rand(()).item(), random.random(), float(np.random.rand())]


def _continue(run, first_step: int) -> tuple[dict, list[float], float]:
    draws = _draws()
    run.step(first_step)
    run.step(first_step + 1)
    return run.params(), draws, run.optimizer.param_groups[0]["lr"]


def _roundtrip(root: Path, dist_opt: bool, precision: str = "32") -> dict:
    from test_checkpoint_harness import LogCapture, bitwise_equal, build_run

    from megatron_kto.checkpointing.manager import CheckpointManager

    logs = LogCapture()
    run = build_run(1, 1, dist_opt, seed=1, dropout=0.1, precision=precision)
    manager = CheckpointManager(root, keep_last=0)
    out: dict = {"fresh": manager.load_latest(run.chunks, run.optimizer, run.scheduler)}
    if dist_opt and precision == "32":
        # Before the first step (e.g. preempted during step 1): needs init_empty_adam_state.
        manager.save(
            0,
            run.chunks,
            run.optimizer,
            run.scheduler,
            {**TRAINER_STATE, "consumed_samples": 0},
            CONFIG_YAML,
            run.arch,
        )
    run.step(1)
    run.step(2)
    manager.save(2, run.chunks, run.optimizer, run.scheduler, TRAINER_STATE, CONFIG_YAML, run.arch)
    reference = _continue(run, 3)

    other = build_run(1, 1, dist_opt, seed=7, dropout=0.1, precision=precision)
    out["state"] = CheckpointManager(root).load_latest(
        other.chunks, other.optimizer, other.scheduler
    )
    resumed = _continue(other, 3)
    out["fresh_resume_exact"] = bitwise_equal(reference[0], resumed[0])
    out["fresh_resume_draws"] = reference[1] == resumed[1]
    out["fresh_resume_lr"] = reference[2] == resumed[2]

    CheckpointManager(root).load_latest(run.chunks, run.optimizer, run.scheduler)
    again = _continue(run, 3)
    out["reload_exact"] = bitwise_equal(reference[0], again[0]) and reference[1:] == again[1:]

    if dist_opt and precision == "32":
        first = build_run(1, 1, dist_opt, seed=1, dropout=0.1)
        first.step(1)
        from_zero = build_run(1, 1, dist_opt, seed=9, dropout=0.1)
        CheckpointManager(root).load(
            root / "step_0", from_zero.chunks, from_zero.optimizer, from_zero.scheduler
        )
        from_zero.step(1)
        out["step0_exact"] = bitwise_equal(first.params(), from_zero.params())
    out["warnings"] = logs.take()
    return out


def _without(root: Path, workaround: str) -> dict:
    """Resume the distributed-optimizer checkpoint under `root` with one workaround disabled.

    Returns {"error": message} if the resume raised, else {"run": the resumed run}.
    """
    from test_checkpoint_harness import build_run

    from megatron_kto.checkpointing import manager as manager_mod
    from megatron_kto.checkpointing import optimizer_state
    from megatron_kto.checkpointing.errors import CheckpointError

    disabled = {
        "init_empty_adam_state": lambda optimizer: None,
        "untie_steps": lambda optimizer: None,
        # megatron's own DistributedOptimizer.load_state_dict, param state included
        "_load_distributed": lambda opt, state: opt.load_state_dict(state),
        "load_scheduler_state": lambda scheduler, state: scheduler.load_state_dict(state),
    }
    original = getattr(optimizer_state, workaround)
    setattr(optimizer_state, workaround, disabled[workaround])
    try:
        run = build_run(1, 1, True, seed=7, dropout=0.1)
        if workaround == "load_scheduler_state":
            run.step(1)  # a scheduler that has stepped: the case the workaround is for
        try:
            manager_mod.CheckpointManager(root).load_latest(
                run.chunks, run.optimizer, run.scheduler
            )
        except CheckpointError as e:
            return {"error": str(e)}
        return {"run": run}
    finally:
        setattr(optimizer_state, workaround, original)


def _worker(rank: int, world_size: int, tmp: str) -> dict:
    from test_checkpoint_harness import build_run, max_abs_diff

    from megatron_kto.checkpointing.manager import CheckpointManager
    from megatron_kto.runtime import teardown

    tmp_path = Path(tmp)
    out = {
        "standard": _roundtrip(tmp_path / "standard", dist_opt=False),
        "distributed": _roundtrip(tmp_path / "distributed", dist_opt=True),
        "distributed_bf16": _roundtrip(tmp_path / "bf16", dist_opt=True, precision="bf16"),
    }
    root = tmp_path / "distributed"

    # The correct resume: step 3 from step_2 with every workaround on.
    good = build_run(1, 1, True, seed=7, dropout=0.1)
    CheckpointManager(root).load_latest(good.chunks, good.optimizer, good.scheduler)
    lr_good = good.optimizer.param_groups[0]["lr"]
    good.step(3)
    reference = good.params()

    broken = {}
    for workaround in (
        "init_empty_adam_state",
        "_load_distributed",
        "untie_steps",
        "load_scheduler_state",
    ):
        result = _without(root, workaround)
        if "error" in result:
            broken[workaround] = {"error": result["error"]}
            continue
        run = result["run"]
        entry = {"lr_matches": run.optimizer.param_groups[0]["lr"] == lr_good}
        run.step(3)
        entry["step_diff"] = max_abs_diff(reference, run.params())
        broken[workaround] = entry
    out["broken"] = broken
    measured = build_run(1, 1, True, seed=7)
    measured.step(1)
    out["save_host_bytes"] = _optimizer_save_host_bytes(measured)
    teardown()
    return out


def _optimizer_save_host_bytes(run) -> dict[str, int]:
    """Bytes of fp32 optimizer state this rank holds while building its save (distributed
    optimizer, `fully_reshardable`, megatron-core's memory-efficient gather), and the model
    shard's parameter count."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from megatron_kto.checkpointing import optimizer_state
    from megatron_kto.checkpointing.model_io import model_sharded_state_dict

    model_sd = model_sharded_state_dict(run.chunks)
    sd = optimizer_state.sharded_state_dict(run.optimizer, model_sd, is_loading=False)
    tensors = []

    def walk(value):
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)):
            tensors.append(value.data)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)

    walk(sd["param_state"] or {})
    return {
        "state_bytes": sum(t.numel() * t.element_size() for t in tensors),
        "params": sum(p.numel() for c in run.chunks for p in c.parameters()),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("roundtrip")
    res = run_multirank(_worker, 2, str(tmp), timeout=400)
    res[0]["tmp"] = tmp
    return res


@pytest.mark.parametrize("optimizer", ["standard", "distributed", "distributed_bf16"])
def test_resume_is_bitwise_exact(results, optimizer) -> None:
    for rank_result in results:
        r = rank_result[optimizer]
        assert r["fresh"] is None, "an empty root must mean a fresh start"
        assert r["state"] == {**TRAINER_STATE, "step": 2}
        assert r["fresh_resume_draws"], "RNG states were not restored"
        assert r["fresh_resume_lr"], "scheduler state was not restored"
        assert r["fresh_resume_exact"], "continued steps after resume differ"
        assert r["reload_exact"], "reloading into a used optimizer/scheduler is not exact"
        assert r["warnings"] == []


def test_distributed_optimizer_saved_before_first_step(results) -> None:
    for rank_result in results:
        assert rank_result["distributed"]["step0_exact"]


def test_checkpoint_files(results) -> None:
    step_dir = results[0]["tmp"] / "standard" / "step_2"
    assert (step_dir / "config.yaml").read_text() == CONFIG_YAML
    assert json.loads((step_dir / "scheduler.json").read_text())["num_steps"] == 2
    assert json.loads((step_dir / "architecture.json").read_text())["hidden_size"] == 32
    meta = json.loads((step_dir / "checkpoint.json").read_text())
    assert meta["optimizer"] == "standard" and meta["layout"]["data_parallel_size"] == 2
    assert sorted(p.name for p in (step_dir / "rng").iterdir()) == [
        "rank_00000.pt",
        "rank_00001.pt",
    ]
    # RNG files hold tensors and plain values only.
    torch.load(step_dir / "rng" / "rank_00001.pt", weights_only=True)
    assert (results[0]["tmp"] / "standard" / "latest").read_text().strip() == "step_2"


def test_distributed_optimizer_save_gathers_on_dp_rank0_only(results) -> None:
    """megatron-core's memory-efficient `fully_reshardable` save: DP rank 0 holds the model
    shard's full fp32 state (param, exp_avg, exp_avg_sq = 12 bytes per parameter), DP rank 1
    none of it (the default all-gather would give both ranks the 12 bytes per parameter)."""
    rank0, rank1 = (r["save_host_bytes"] for r in results)
    assert rank0["state_bytes"] == 12 * rank0["params"]
    assert rank1["state_bytes"] == 0


def test_each_workaround_is_needed(results) -> None:
    """Switching any workaround off breaks the distributed-optimizer resume on megatron 0.16.1."""
    broken = results[0]["broken"]
    # DistributedOptimizer.state_dict() asserts on empty optimizer state.
    assert "AssertionError" in broken["init_empty_adam_state"]["error"]
    # DistributedOptimizer._set_main_param_and_optimizer_states(): KeyError 'step'.
    assert (
        "KeyError" in broken["_load_distributed"]["error"]
        and "step" in broken["_load_distributed"]["error"]
    )
    # DistributedOptimizer.load_state_dict(): one shared step tensor → wrong bias correction.
    assert broken["untie_steps"]["step_diff"] > 1e-4
    # OptimizerParamScheduler.load_state_dict() adds to the current step count.
    assert not broken["load_scheduler_state"]["lr_matches"]
