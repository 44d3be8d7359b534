"""Test helpers for killing one rank of a running CLI job: find the workers' pids, wait for a
step to be logged, and start torchrun in the background with per-rank log files."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from e2e_cli import REPO, cli_env


def rank_pids(log_dir: Path) -> dict[int, int]:
    """rank -> pid of the worker processes of the run writing to `log_dir` (from /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            if f"exp_manager.explicit_log_dir={log_dir}".encode() not in cmd:
                continue
            if b"torch.distributed.run" in cmd:
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        env = dict(kv.split(b"=", 1) for kv in environ if b"=" in kv)
        if b"RANK" in env:
            found[int(env[b"RANK"])] = int(entry.name)
    return found


def wait_for_step(proc: subprocess.Popen, run: Path, step: int, timeout: float = 180) -> None:
    """Until metrics.jsonl of `run` holds `step` (fails if the job ends first)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if f'"step": {step},' in (run / "metrics.jsonl").read_text():
                return
        except OSError:
            pass
        assert proc.poll() is None, f"the job ended before step {step}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"no step {step} after {timeout} s"
        time.sleep(0.1)


def torchrun(
    args: list[str], logs: Path, *options: str, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """`torchrun --standalone --nproc_per_node=2 OPTIONS ARGS` in the background, each rank's
    streams under `logs` (`<attempt>/<rank>/stderr.log`); `env` is added to the environment."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "--log-dir", str(logs), "--redirects", "3", *options, *args,
    ]  # fmt: skip
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env={**cli_env(), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def rank_stderr(logs: Path) -> dict[tuple[str, int], str]:
    """(attempt directory, rank) -> that rank's stderr."""
    return {
        (p.parent.parent.name, int(p.parent.name)): p.read_text() for p in logs.rglob("stderr.log")
    }
