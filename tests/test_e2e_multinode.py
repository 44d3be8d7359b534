"""Several nodes on one machine: two torchrun agents rendezvousing over c10d, and a SLURM-style
launch (one process per task, SLURM's variables, no torchrun), train the same steps as one
agent with all ranks.

Each launch runs the bundled tiny example for 8 steps on 2 ranks at TP=2 (so the tensor-parallel
all-reduces cross the "nodes"), writing to its own log directory:

* the reference: `torchrun --nproc_per_node 2` (one agent);
* `torchrun --nnodes 2 --nproc_per_node 1 --rdzv_backend c10d --rdzv_endpoint 127.0.0.1:PORT
  --rdzv_id ...` started twice, as the README's multi-node command on two nodes;
* two `python examples/train_gpt_kto.py` processes with `SLURM_PROCID` 0/1,
  `SLURM_STEP_NUM_TASKS=2`, `SLURM_LOCALID` 0 (one task per node), `SLURM_JOB_ID` and
  `MASTER_ADDR` — as `srun` starts them under the README's sbatch script; MASTER_PORT is the one
  `runtime.launcher_env` derives from the job id.

Checked: every launch exits 0 and writes the same metrics.jsonl numbers (time and memory
measurements aside) and the same final checkpoint tensor files as the reference.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from e2e_cli import KTO_SCRIPT, QUIET, REPO, TINY_EXAMPLE, cli_env, read_metrics, run_script

from megatron_kto.runtime.distributed import rendezvous_port

pytestmark = pytest.mark.e2e

MEASURED = {"step_time", "tokens_per_sec", "samples_per_sec", "peak_memory_gb", "mfu"}
TIMEOUT_S = 240


def _args(run) -> list[str]:
    return [
        *QUIET,
        TINY_EXAMPLE,
        f"exp_manager.explicit_log_dir={run}",
        "model.tensor_model_parallel_size=2",
        "trainer.kto.max_steps=8",
        "trainer.kto.val_check_interval=4",
    ]


def _numbers(rows):
    return [{k: v for k, v in r.items() if k not in MEASURED} for r in rows]


def _wait(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    results = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=TIMEOUT_S)
            results.append((p.returncode, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results


def _start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("one_agent") / "run"
    run_script(KTO_SCRIPT, _args(run), 2)
    return run


def _same_run(run, reference) -> None:
    assert _numbers(read_metrics(run)) == _numbers(read_metrics(reference))
    assert _numbers(read_metrics(run, "val")) == _numbers(read_metrics(reference, "val"))
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 9))
    # The final weights: the checkpoints' tensor files are identical byte for byte (same
    # layout, same values; the metadata files carry no times).
    shards = sorted((reference / "checkpoints" / "step_8").glob("*.distcp"))
    assert len(shards) == 4  # two writer processes per rank
    for ref in shards:
        assert (run / "checkpoints" / "step_8" / ref.name).read_bytes() == ref.read_bytes()


def test_two_torchrun_agents_over_c10d(tmp_path, reference):
    run = tmp_path / "run"
    port = rendezvous_port()
    agent = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
        "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
        "--rdzv_id", f"kto{port}", str(KTO_SCRIPT), *_args(run),
    ]  # fmt: skip
    results = _wait([_start(agent, cli_env()), _start(agent, cli_env())])
    for code, err in results:
        assert code == 0, err[-3000:]
    _same_run(run, reference)


def _slurm_job_port() -> tuple[int, int]:
    """(job id, port) with port = the one `launcher_env` derives from the job id, free now."""
    while True:
        port = rendezvous_port()
        if 20000 <= port < 40000:
            return port - 20000, port


def test_slurm_tasks_without_torchrun(tmp_path, reference):
    run = tmp_path / "run"
    job, _ = _slurm_job_port()
    procs = []
    for task in range(2):
        env = cli_env()
        env.update(
            SLURM_PROCID=str(task),
            SLURM_STEP_NUM_TASKS="2",
            SLURM_NTASKS="2",
            SLURM_LOCALID="0",
            SLURM_JOB_ID=str(job),
            MASTER_ADDR="127.0.0.1",
        )
        procs.append(_start([sys.executable, str(KTO_SCRIPT), *_args(run)], env))
    for code, err in _wait(procs):
        assert code == 0, err[-3000:]
    _same_run(run, reference)
