"""`torchrun --max-restarts 1` after a killed worker: the restarted ranks re-form the process
groups, resume from the last complete checkpoint and end where an uninterrupted run ends.

The bundled tiny example, 2 ranks (DP=2), 30 steps, a checkpoint every 10. Rank 1 is killed
with SIGKILL once step 12 is logged; torchrun stops rank 0 and starts both again (attempt 1).
Before the fix the restarted ranks never formed their gloo group: `env://` joined the agent's
store under the same `default_pg` prefix as the killed attempt, whose keys (a dead worker's
address) were still there, so gloo's connectFullMesh failed with "Connection refused" or
waited on it (`runtime.distributed._rendezvous` now gives every attempt its own prefix).

Checked: exit code 0; attempt 1's rank 0 says it resumed from `step_10`; metrics.jsonl's
training rows equal those of an uninterrupted run of the same command in every number that
does not measure time or memory (steps 11-12 are logged again, not twice); the final
checkpoints hold identical weights.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from e2e_cli import KTO_SCRIPT, QUIET, TINY_EXAMPLE, load_tp1_state_dicts, read_metrics, run_script
from kill_rank import rank_pids, rank_stderr, torchrun, wait_for_step

pytestmark = pytest.mark.e2e

#: Row entries that measure the machine, not the training.
MEASURED = {"step_time", "tokens_per_sec", "samples_per_sec", "peak_memory_gb", "mfu"}
STEPS = ["trainer.kto.max_steps=30", "trainer.kto.save_interval=10"]


def _numbers(rows):
    return [{k: v for k, v in r.items() if k not in MEASURED} for r in rows]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("elastic")
    plain, restarted = root / "plain", root / "restarted"
    run_script(
        KTO_SCRIPT, [*QUIET, TINY_EXAMPLE, f"exp_manager.explicit_log_dir={plain}", *STEPS], 2
    )
    args = [str(KTO_SCRIPT), *QUIET, TINY_EXAMPLE, f"exp_manager.explicit_log_dir={restarted}"]
    proc = torchrun([*args, *STEPS], root / "logs", "--max-restarts", "1")
    try:
        wait_for_step(proc, restarted, 12)
        os.kill(rank_pids(restarted)[1], signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    return plain, restarted, proc.returncode, err, rank_stderr(root / "logs"), root / "logs"


def test_restarted_workers_resume_and_finish(runs):
    _, restarted, code, err, _, logs = runs
    assert code == 0, err[-3000:]
    attempts = sorted({p.parent.parent.name for p in logs.rglob("stdout.log")})
    assert len(attempts) == 2, attempts  # the killed attempt and the restarted one
    out0 = next(logs.glob(f"*/{attempts[-1]}/0/stdout.log")).read_text()
    assert f"resumed from {restarted / 'checkpoints' / 'step_10'} (step 10)" in out0


def test_metrics_and_weights_equal_an_uninterrupted_run(runs):
    plain, restarted, code, err, _, _ = runs
    assert code == 0, err[-3000:]
    got, want = read_metrics(restarted), read_metrics(plain)
    assert [r["step"] for r in got] == list(range(1, 31))
    assert _numbers(got) == _numbers(want)
    assert _numbers(read_metrics(restarted, "val")) == _numbers(read_metrics(plain, "val"))
    a, b = load_tp1_state_dicts([plain, restarted])
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
