"""A rank that hangs (alive, never joins a collective): the others stop after the collective
timeout with one line naming it and the step where it stopped.

The bundled tiny example runs on 2 ranks (DP=2) under torchrun with a checkpoint every 5 steps
and `trainer.distributed_timeout_minutes=0.1` (6 s). A test-only `sitecustomize` makes rank 1
block for good when it enters step 7 (after recording the step, as every rank does), as a rank
stuck in I/O or a deadlock would. Before, rank 0 printed torch's gloo timeout traceback
("Timed out waiting 6000ms for recv operation to complete") with no rank named.

Checked: the run exits 1; rank 0's stderr is exactly the one line naming rank 1, step 7, the
timeout key and the checkpoint still good, with no traceback on any rank; the time from the
hang to rank 0's line and to torchrun's exit; `step_5` is complete and `latest`.
"""

from __future__ import annotations

import os
import time

import pytest
from e2e_cli import KTO_SCRIPT, QUIET, TINY_EXAMPLE
from kill_rank import torchrun

from megatron_kto.checkpointing import files

pytestmark = pytest.mark.e2e

SITECUSTOMIZE = '''"""Test-only (tests/test_e2e_hung_rank.py): rank HANG_RANK blocks entering step HANG_STEP."""
import importlib.abc
import importlib.util
import os
import sys
import time

_RANK, _STEP = os.environ["HANG_RANK"], int(os.environ["HANG_STEP"])


def _patch(module):
    mark_step = module.mark_step

    def mark_step_hanging(step):
        mark_step(step)
        if step == _STEP:
            with open(os.environ["HANG_FLAG"], "w") as f:
                f.write(str(time.time()))
            while True:  # alive, never joins the step's collectives
                time.sleep(60)

    module.mark_step = mark_step_hanging


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "megatron_kto.runtime.peers":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("RANK") == _RANK:
    sys.meta_path.insert(0, _AfterImport())
'''

TIMEOUT_MINUTES = 0.1  # 6 s
#: Seconds from the hang to rank 0's line: the timeout, then the wait for the other survivors'
#: timeouts (the timeout again, at most 10 s).
LINE_BOUND_S = 25.0
#: ... and to the job's end: torchrun then stops the stuck worker with SIGTERM, which it takes
#: as a preemption request it cannot reach, and kills it 30 s later (torchrun's grace period).
END_BOUND_S = LINE_BOUND_S + 35.0


def test_the_survivor_names_the_stuck_rank(tmp_path):
    run, logs, site = tmp_path / "run", tmp_path / "logs", tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    flag = tmp_path / "hung"
    path = os.environ.get("PYTHONPATH", "")
    env = {
        "PYTHONPATH": f"{site}{os.pathsep}{path}" if path else str(site),
        "HANG_RANK": "1",
        "HANG_STEP": "7",
        "HANG_FLAG": str(flag),
    }
    args = [
        str(KTO_SCRIPT), *QUIET, TINY_EXAMPLE, f"exp_manager.explicit_log_dir={run}",
        "trainer.kto.max_steps=500", "trainer.kto.save_interval=5",
        f"trainer.distributed_timeout_minutes={TIMEOUT_MINUTES}",
    ]  # fmt: skip
    proc = torchrun(args, logs, env=env)
    try:
        _, err = proc.communicate(timeout=240)
        ended = time.time()
    finally:
        if proc.poll() is None:
            proc.kill()
    streams = {int(p.parent.name): p.read_text() for p in logs.rglob("stderr.log")}
    ckpts = run / "checkpoints"
    assert proc.returncode == 1, err[-3000:]
    assert streams[0].strip().splitlines() == [
        "error: rank 1 of 2 stopped answering at step 7 (its process is alive: stuck, e.g. in "
        "I/O or a deadlock); the other ranks timed out after "
        "trainer.distributed_timeout_minutes=0.1; the last good checkpoint, "
        f"{ckpts / 'step_5'}, is untouched and a rerun resumes from it"
    ], streams[0][-3000:]
    assert "Traceback" not in "".join(streams.values()), streams
    assert (ckpts / files.LATEST).read_text().strip() == "step_5"
    assert files.check_complete(ckpts / "step_5") is None
    hung = float(flag.read_text())
    line_at = next(logs.rglob("0/stderr.log")).stat().st_mtime - hung
    print(f"\nrank 1 hung at step 7: rank 0's line {line_at:.1f} s later, the job ended "
          f"{ended - hung:.1f} s later")  # fmt: skip
    assert TIMEOUT_MINUTES * 60 <= line_at < LINE_BOUND_S
    assert ended - hung < END_BOUND_S
