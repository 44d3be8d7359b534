"""Preemption and resume through the real entry script.

Run A trains 12 steps straight. Run B is the same command, sent SIGTERM (what SLURM sends before
preemption) once it has logged step 2: it must finish its step, save a checkpoint and exit 0.
Rerunning B's command resumes from that checkpoint and finishes: every step's logged metrics
and the final weights must be identical to A's, bit for bit (same layout, fp32, cosine LR
schedule with warm-up, so the scheduler, optimizer, sampler and RNG state all have to be
restored). Run C is interrupted the same way but resumes under TP=2 (two processes): it must
match A within fp32 tolerance (dist_checkpointing reshards model and optimizer state).
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from e2e_cli import (
    KTO_SCRIPT,
    QUIET,
    REPO,
    cli_env,
    launcher,
    load_tp1_state_dicts,
    read_metrics,
    run_script,
    save_initial_checkpoint,
)

pytestmark = pytest.mark.e2e

STEPS = 12
COMPARED = ("loss", "rewards/chosen", "rewards/rejected", "kl", "logps/chosen", "grad_norm", "lr")


def _args(init: Path, log_dir: Path) -> list[str]:
    return [
        *QUIET,
        f"pretrained_checkpoint.restore_from_path={init}",
        f"exp_manager.explicit_log_dir={log_dir}",
        f"trainer.kto.max_steps={STEPS}",
        "trainer.kto.save_interval=0",  # only the preemption and final checkpoints
        "model.global_batch_size=32",
        "model.micro_batch_size=4",
        "model.optim.sched.warmup_steps=3",
        "model.data.data_prefix.validation=[]",
    ]


def _interrupt(args: list[str], log_dir: Path) -> tuple[int, str]:
    """Start a one-process run, SIGTERM it once step 2 is logged; (exit code, output)."""
    proc = subprocess.Popen(
        [*launcher(1), str(KTO_SCRIPT), *args],
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = log_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                proc.send_signal(signal.SIGTERM)
                break
            time.sleep(0.02)
        out, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    return proc.returncode, out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    init = save_initial_checkpoint(root / "init", seed=21)
    straight = root / "straight"
    run_script(KTO_SCRIPT, _args(init, straight))

    resumed = root / "resumed"
    code, out = _interrupt(_args(init, resumed), resumed)
    stopped_at = read_metrics(resumed)[-1]["step"]
    first = run_script(KTO_SCRIPT, _args(init, resumed))

    relayout = root / "relayout"
    code_c, _ = _interrupt(_args(init, relayout), relayout)
    run_script(KTO_SCRIPT, [*_args(init, relayout), "model.tensor_model_parallel_size=2"], nproc=2)
    weights = load_tp1_state_dicts([init, straight, resumed, relayout])
    return {
        "code": code,
        "output": out,
        "stopped_at": stopped_at,
        "resume_output": first.stdout,
        "code_c": code_c,
        "metrics": {n: read_metrics(root / n) for n in ("straight", "resumed", "relayout")},
        "weights": dict(zip(("init", "straight", "resumed", "relayout"), weights, strict=True)),
    }


def test_sigterm_saves_a_checkpoint_and_exits_zero(runs):
    assert runs["code"] == 0, runs["output"][-3000:]
    assert runs["code_c"] == 0
    assert 2 <= runs["stopped_at"] < STEPS, "the signal must land mid-run"
    assert f"resumed from step {runs['stopped_at']}" in runs["resume_output"]


def test_resumed_run_is_bitwise_identical(runs):
    straight, resumed = runs["metrics"]["straight"], runs["metrics"]["resumed"]
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))  # no gap, no duplicate
    for a, b in zip(straight, resumed, strict=True):
        for key in COMPARED:
            assert a[key] == b[key], (a["step"], key)
    ref, got = runs["weights"]["straight"], runs["weights"]["resumed"]
    assert ref.keys() == got.keys()
    for key in ref:
        assert torch.equal(ref[key], got[key]), key


def test_resume_under_another_layout_matches(runs):
    straight, relayout = runs["metrics"]["straight"], runs["metrics"]["relayout"]
    assert [r["step"] for r in relayout] == list(range(1, STEPS + 1))
    for a, b in zip(straight, relayout, strict=True):
        for key in ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
    ref, got = runs["weights"]["straight"], runs["weights"]["relayout"]
    for key in ref:
        scale = ref[key].abs().max().clamp(min=1e-12)
        assert ((got[key] - ref[key]).abs().max() / scale) <= 1e-4, key
    init = runs["weights"]["init"]
    moved = max(((ref[k] - init[k]).abs().max() / init[k].abs().max()).item() for k in ref)
    assert moved > 1e-2, "training must move the weights far beyond the tolerance"
