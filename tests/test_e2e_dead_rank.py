"""A rank killed mid-run (`kill -9`): the others stop at once with one line naming it.

The bundled tiny example runs on 2 ranks (DP=2) under torchrun with a checkpoint every 5 steps;
once step 7 is in metrics.jsonl the test kills rank 0 with SIGKILL, which leaves rank 1 to
report. Before, the survivor printed a
60-line gloo traceback ("Read error [127.0.0.1]:6035: Connection reset by peer") and a second
one from the barrier of its teardown.

Checked: torchrun reports the killed rank (exit -9) and the run exits 1; the surviving rank's
stderr is exactly the one line naming the dead rank and the checkpoint still good, with no
traceback; the time from the kill to torchrun's exit; `step_5` is complete and `latest`.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from e2e_cli import KTO_SCRIPT, QUIET, TINY_EXAMPLE
from kill_rank import rank_pids, torchrun, wait_for_step

from megatron_kto.checkpointing import files

pytestmark = pytest.mark.e2e

#: Seconds from the kill to the job's end (a hang is the collective timeout: minutes).
BOUND_S = 20.0


#: Rank 0 is the harder case (rank 1 must know it reports; without torchrun rank 0 would also
#: take the rendezvous store with it). Killing rank 1 instead was measured the same way: the job
#: ended 1.4 s after the kill with rank 0's line (one run of ~35 s kept out of the suite).
@pytest.mark.parametrize("victim", [0])
def test_the_survivor_names_the_dead_rank(tmp_path, victim):
    run, logs = tmp_path / "run", tmp_path / "logs"
    args = [str(KTO_SCRIPT), *QUIET, TINY_EXAMPLE, f"exp_manager.explicit_log_dir={run}"]
    proc = torchrun([*args, "trainer.kto.max_steps=500", "trainer.kto.save_interval=5"], logs)
    try:
        wait_for_step(proc, run, 7)
        pids = rank_pids(run)
        assert sorted(pids) == [0, 1], pids
        os.kill(pids[victim], signal.SIGKILL)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=120)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
    survivor = 1 - victim
    streams = {int(p.parent.name): p.read_text() for p in logs.rglob("stderr.log")}
    ckpts = run / "checkpoints"
    assert proc.returncode == 1
    assert f"exitcode  : -9 (pid: {pids[victim]})" in err, err[-2000:]
    assert streams[survivor].strip().splitlines() == [
        f"error: rank {victim} of 2 died (killed or crashed: its own log says why); the other "
        f"ranks stopped; the last good checkpoint, {ckpts / 'step_5'}, is untouched and a "
        "rerun resumes from it"
    ], streams[survivor][-3000:]
    assert "Traceback" not in "".join(streams.values())
    assert (ckpts / files.LATEST).read_text().strip() == "step_5"
    assert files.check_complete(ckpts / "step_5") is None
    print(f"\nkilled rank {victim}: the job ended {took:.1f} s later")
    assert took < BOUND_S
