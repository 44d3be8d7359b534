"""Launcher variables, read without importing torch (entry points call this first).

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT for each process;
`srun` starting one task per GPU sets SLURM's own names instead.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

#: The step's task count, not SLURM_NTASKS: a batch script runs as a step of ONE task while
#: SLURM_NTASKS (and SLURM_PROCID=0) describe the whole allocation, so a plain `python train.py`
#: in an sbatch script must stay a world of one instead of waiting for ranks that never start.
_SLURM_VARS = {
    "RANK": "SLURM_PROCID",
    "WORLD_SIZE": "SLURM_STEP_NUM_TASKS",
    "LOCAL_RANK": "SLURM_LOCALID",
}


def adopt_launcher_env(environ: MutableMapping[str, str] | None = None) -> None:
    """Fill torchrun's RANK / WORLD_SIZE / LOCAL_RANK from SLURM's when `srun` started the tasks.

    Under `srun --ntasks-per-node=<GPUs> python examples/train_gpt_kto.py ...` every task is a
    rank (SLURM delivers `--signal` / time-limit signals to each of them, which the preemption
    handler needs). The rendezvous address must be exported by the job script (MASTER_ADDR, the
    first host of the allocation); MASTER_PORT defaults to one derived from the job id, the same
    on every task. Variables already set (torchrun's) win. Call before reading WORLD_SIZE.

    Raises:
        RuntimeError: a multi-task SLURM step without MASTER_ADDR.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env or "SLURM_PROCID" not in env or "SLURM_STEP_NUM_TASKS" not in env:
        return
    for ours, slurm in _SLURM_VARS.items():
        env.setdefault(ours, env.get(slurm, "0"))
    if int(env["WORLD_SIZE"]) > 1 and "MASTER_ADDR" not in env:
        raise RuntimeError(
            "srun started this task without torchrun: export MASTER_ADDR in the job script, "
            "e.g. MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)"
        )
    env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
