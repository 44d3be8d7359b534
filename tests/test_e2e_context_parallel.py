"""The entry script and the eval tool under context parallelism reproduce CP = 1.

From one starting checkpoint, `examples/train_gpt_kto.py` runs 3 fp32 steps on one process
(CP=1), and with `model.context_parallel_size=2` on two processes: packed micro-batches, padded
ones (`pack_sequences=false`), and with a precomputed reference table. Every step's logged
metrics (loss, rewards, log-probs, logits, z₀, grad norm), the validation row, and the final
weights — saved at CP=2 and read back into a CP=1 model (CP shards no weight) — must equal the
CP=1 run to a relative 1e-4. `tools/eval_kto_rewards.py --context-parallel-size 2` must report
the numbers it reports at CP=1. Impossible layouts fail in one `error:` line.
"""

from __future__ import annotations

import json

import pytest
from e2e_cli import (
    EVAL_TOOL,
    KTO_SCRIPT,
    VALIDATION_DATA,
    launch,
    load_tp1_state_dicts,
    read_metrics,
    run_script,
    save_initial_checkpoint,
)
from test_e2e_layouts import METRICS, RTOL, STEPS, _metric_rel_diff, _overrides, _weight_rel_diffs

pytestmark = pytest.mark.e2e

CP2 = "model.context_parallel_size=2"
#: name -> (processes, extra overrides)
RUNS = {
    "cp1": (1, ["exp_manager.save_hf=true"]),
    "cp2": (2, [CP2, "exp_manager.save_hf=true"]),
    "cp2_padded": (2, [CP2, "model.data.pack_sequences=false"]),
    "cp2_precomputed": (2, [CP2, "model.kto.reference_policy=precomputed"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp")
    init = save_initial_checkpoint(root / "init", seed=97)
    metrics = {}
    for name, (nproc, extra) in RUNS.items():
        run_script(KTO_SCRIPT, [*_overrides(init, root / name), *extra], nproc=nproc)
        metrics[name] = read_metrics(root / name) + read_metrics(root / name, "val")
    states = load_tp1_state_dicts([init, *(root / name for name in RUNS)])
    return {
        "root": root,
        "init": init,
        "states": dict(zip(["init", *RUNS], states, strict=True)),
        "metrics": metrics,
    }


@pytest.mark.parametrize("name", ["cp2", "cp2_padded", "cp2_precomputed"])
def test_context_parallel_training_matches_cp1(runs, name):
    want, got = runs["metrics"]["cp1"], runs["metrics"][name]
    assert len(want) == len(got) == STEPS + 1
    assert all(r["kl"] > 0.1 for r in want[1:STEPS]), "z₀ > 0 should be exercised"
    for ref_row, row in zip(want, got, strict=True):
        assert (row["split"], row["step"]) == (ref_row["split"], ref_row["step"])
        for key in METRICS:
            if key in ref_row:
                assert _metric_rel_diff(row[key], ref_row[key]) <= RTOL, (row["step"], key)
    moved = _weight_rel_diffs(runs["states"]["cp1"], runs["states"]["init"])
    assert min(v for k, v in moved.items() if "weight" in k) > 10 * RTOL
    diffs = _weight_rel_diffs(runs["states"][name], runs["states"]["cp1"])
    assert max(diffs.values()) <= RTOL, diffs


def test_hf_output_at_cp2_equals_cp1(runs):
    """One writer per pipeline stage whatever the CP size: the CP=2 run's `hf/` has the CP=1
    run's files and tensors (to the training tolerance)."""
    from safetensors.torch import load_file

    dirs = {name: runs["root"] / name / "hf" for name in ("cp1", "cp2")}
    files = {name: sorted(p.name for p in d.iterdir()) for name, d in dirs.items()}
    assert files["cp1"] == files["cp2"] and "config.json" in files["cp1"], files
    want, got = (
        {k: v for f in sorted(dirs[n].glob("*.safetensors")) for k, v in load_file(f).items()}
        for n in ("cp1", "cp2")
    )
    assert want.keys() == got.keys() and want
    for key, ref in want.items():
        scale = ref.abs().max().clamp_min(1e-12)
        assert ((got[key] - ref).abs().max() / scale).item() <= RTOL, key


def test_eval_tool_at_cp2_equals_cp1(runs, tmp_path):
    reports = {}
    for cp in (1, 2):
        out = tmp_path / f"eval{cp}.json"
        args = ["--policy", str(runs["root"] / "cp2"), "--data", str(VALIDATION_DATA)]
        args += ["--json", str(out), "--context-parallel-size", str(cp)]
        run_script(EVAL_TOOL, args, nproc=2)
        reports[cp] = json.loads(out.read_text())
    numbers = {k for k, v in reports[1].items() if isinstance(v, float)}
    assert {"auc", "accuracy", "margin", "mean_reward_desirable"} <= numbers, reports[1]
    for key in numbers:
        assert reports[2][key] == pytest.approx(reports[1][key], rel=1e-5, abs=1e-6), key


def test_impossible_context_parallel_layout_is_one_error_line(runs, tmp_path):
    args = [str(KTO_SCRIPT), *_overrides(runs["init"], tmp_path / "bad"), CP2]
    proc, _ = launch(args, nproc=1, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert lines[-1] == (
        "error: model.tensor_model_parallel_size: world size 1 is not divisible by TP (1) x "
        "PP (1) x CP (2)"
    ), lines[-1]
