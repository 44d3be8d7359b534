"""Helpers for the end-to-end tests: run the real entry scripts and tools in subprocesses, make
a starting checkpoint, and read checkpoints back into a TP=1 model.

The entry scripts are launched exactly as a user would: ``python examples/train_gpt_kto.py`` for
one rank, ``python -m torch.distributed.run --nproc_per_node N ...`` (torchrun) for several, with
one intra-op thread per rank (CI has 2 cores). A run of several ranks goes through
``tests/nccl_trace_main.py``, which records each rank's torch.distributed calls; when the run
succeeds they are replayed under NCCL's ordering rules (`nccl_order`), and an order that would
deadlock NCCL (gloo let it pass) fails the run with every rank's stuck queue heads.

Fast path (`launch`'s default): the heavy imports (torch, megatron-core, our package: ~4 CPU s
per process, ~10 s of wall on a loaded CI box) are most of a tiny run. So a run's ranks are
forked from the forkserver `multirank` keeps (which imported them once, with the NCCL-order
recorder installed first) and each runs the script as ``python SCRIPT ARGS`` would
(`runpy`, as ``__main__``, with torchrun's variables for several ranks, its own streams, exit
code and atexit handlers). What a fork cannot show is kept real: a run that fails is run again
with the real launchers (so every failure a test reads — exit code, torchrun's report, one
`error:` line, nothing imported before validation — is a user's), and so are runs with per-rank
`logs` and those that ask for it (``real=True``: console noise, launcher behaviour).
``MEGATRON_KTO_REAL_LAUNCH=1`` runs everything with the real launchers.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import multirank
import nccl_order
from multirank import run_multirank

from megatron_kto.runtime.distributed import rendezvous_port

REPO = Path(__file__).resolve().parents[1]
KTO_SCRIPT = REPO / "examples" / "train_gpt_kto.py"
EVAL_TOOL = REPO / "tools" / "eval_kto_rewards.py"
CONF = REPO / "conf"
TOKENIZER = REPO / "examples" / "data" / "tokenizer" / "tiny_sp.model"
TRAIN_DATA = REPO / "examples" / "data" / "tiny_kto" / "train.jsonl"
VALIDATION_DATA = REPO / "examples" / "data" / "tiny_kto" / "validation.jsonl"

#: Overrides every e2e run uses: no TensorBoard, and a fixed peak FLOP/s so start-up does not
#: spend time measuring it (MFU is not under test here).
QUIET = ["exp_manager.create_tensorboard_logger=false", "trainer.peak_flops_per_device=1e12"]
#: The bundled tiny example, chosen explicitly: a run that also gives a starting checkpoint (or
#: data) would otherwise be a real run with the schema's defaults, not the example's.
TINY_EXAMPLE = "example=tiny_kto"

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def cli_env() -> dict[str, str]:
    """The environment for a launched script: one thread per rank, no inherited torchrun vars."""
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def launcher(nproc: int, extra: list[str] | None = None) -> list[str]:
    """Command prefix: plain python for one rank, torchrun (standalone, local) for several."""
    if nproc == 1:
        return [sys.executable]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *(extra or []),
    ]


def _forked_rank(
    script: str, args: list[str], env: dict[str, str], out: str, err: str, trace: str, nproc: int
) -> None:
    """In a rank forked from the preloaded forkserver: run `script args` as ``python`` would."""
    code = 1
    try:
        os.setpgid(0, 0)  # a timeout kill reaches what the script started too
        for fd, path in ((1, out), (2, err)):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(target, fd)
            os.close(target)
        sys.stdout.reconfigure(line_buffering=True)  # PYTHONUNBUFFERED, near enough
        os.environ.clear()
        os.environ.update(env)
        os.chdir(REPO)
        nccl_order.install(trace)  # installed in the forkserver already: a no-op
        nccl_order.bind_rank(int(env.get("RANK", "0")), nproc, trace)
        sys.argv = [script, *args]
        sys.path[0] = str(Path(script).resolve().parent)
        code = 0
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()  # os._exit below skips them; `python` runs them (trace, logs)
    except BaseException:  # setting the rank up failed: say so (the run is then rerun for real)
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _kill_group(proc: Any) -> None:
    if proc.is_alive():
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.join(5)


def _forked_launch(
    args: list[str], nproc: int, timeout: float, env: dict[str, str], trace_dir: str
) -> subprocess.CompletedProcess:
    """`args` on `nproc` ranks forked from the preloaded forkserver, with torchrun's variables
    (several ranks) or none (one): exit code 0 when every rank exited 0, else the first
    failure's (torchrun reports 1). Streams: each rank's stdout, then stderr, in rank order."""
    ctx = multirank._context()
    work = Path(tempfile.mkdtemp(prefix="cli_fork_"))
    port = rendezvous_port()
    procs = []
    for rank in range(nproc):
        rank_env = dict(env)
        if nproc > 1:
            rank_env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                GROUP_RANK="0",
                ROLE_RANK=str(rank),
                WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc),
                ROLE_WORLD_SIZE=str(nproc),
                GROUP_WORLD_SIZE="1",
                ROLE_NAME="default",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                TORCHELASTIC_RESTART_COUNT="0",
                TORCHELASTIC_MAX_RESTARTS="0",
                TORCHELASTIC_RUN_ID="none",
            )
        out, err = work / f"{rank}.out", work / f"{rank}.err"
        procs.append(
            ctx.Process(
                target=_forked_rank,
                args=(args[0], args[1:], rank_env, str(out), str(err), trace_dir, nproc),
                name=f"cli-rank{rank}",
            )
        )
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        failed_at = None
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = now
            if failed_at is not None and now - failed_at > 5.0:
                break
            if now > deadline:
                for p in procs:
                    _kill_group(p)
                raise subprocess.TimeoutExpired(args, timeout)
            time.sleep(0.05)
        for p in procs:
            _kill_group(p)
        codes = [p.exitcode for p in procs]
        failed = [c for c in codes if c != 0]
        code = 0 if not failed else (failed[0] if nproc == 1 else 1)
        stdout, stderr = (
            "".join(
                (work / f"{r}{ext}").read_text(errors="replace")
                for r in range(nproc)
                if (work / f"{r}{ext}").exists()
            )
            for ext in (".out", ".err")
        )
        return subprocess.CompletedProcess(args, code, stdout, stderr)
    finally:
        for p in procs:
            if p.pid is not None:
                _kill_group(p)
        shutil.rmtree(work, ignore_errors=True)


def launch(
    args: list[str],
    nproc: int = 1,
    timeout: float = 300,
    logs: Path | None = None,
    real: bool = False,
) -> tuple[subprocess.CompletedProcess, list[tuple[str, str]]]:
    """Run `args` (a script and its arguments, from the repository root) on `nproc` ranks.

    With several ranks and `logs`, torchrun writes each rank's streams to files under `logs`
    (its own launcher report stays on the process's stderr), and they are returned as
    (stdout, stderr) per rank, in rank order; otherwise that list is empty.

    Unless `real`, `logs` or ``MEGATRON_KTO_REAL_LAUNCH=1``, the ranks are first forked from
    the preloaded forkserver (module docstring); a run that fails there is run again with the
    real launchers, whose result is returned.

    Raises:
        nccl_order.NcclOrderError: a successful run of several ranks whose communication would
            deadlock NCCL or mismatch a collective (the message lists the stuck queue heads).
    """
    if not (real or logs or os.environ.get("MEGATRON_KTO_REAL_LAUNCH") == "1"):
        env = cli_env()
        trace_dir = tempfile.mkdtemp(prefix="nccl_trace_")
        proc = _forked_launch(args, nproc, timeout, env, trace_dir)
        if proc.returncode == 0:
            if nproc > 1:
                nccl_order.check_trace_dir(trace_dir, nproc)  # the error names the kept trace
            shutil.rmtree(trace_dir, ignore_errors=True)
            return proc, []
        shutil.rmtree(trace_dir, ignore_errors=True)
        # Shown with a failing test's captured output: what the forked run said.
        print(
            f"e2e_cli: forked run exited {proc.returncode}; running it again with the real "
            f"launcher.\n--- forked stderr (tail)\n{proc.stderr[-1500:]}",
            file=sys.stderr,
        )
    return _real_launch(args, nproc, timeout, logs)


def _real_launch(
    args: list[str], nproc: int, timeout: float, logs: Path | None
) -> tuple[subprocess.CompletedProcess, list[tuple[str, str]]]:
    """`launch` with `python` / torchrun, as a user runs it."""
    extra = ["--log-dir", str(logs), "--redirects", "3"] if nproc > 1 and logs else []
    env = cli_env()
    trace_dir = tempfile.mkdtemp(prefix="nccl_trace_")
    if nproc > 1:
        env[nccl_order.TRACE_ENV] = trace_dir
        args = [str(REPO / "tests" / "nccl_trace_main.py"), *args]
    proc = subprocess.run(
        [*launcher(nproc, extra), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if nproc > 1 and proc.returncode == 0:
        nccl_order.check_trace_dir(trace_dir, nproc)  # the error names the kept trace
    shutil.rmtree(trace_dir, ignore_errors=True)
    ranks = []
    if extra:
        for err in sorted(logs.rglob("stderr.log"), key=lambda p: int(p.parent.name)):
            ranks.append(((err.parent / "stdout.log").read_text(), err.read_text()))
    return proc, ranks


def run_script(
    script: Path,
    args: list[str],
    nproc: int = 1,
    timeout: float = 300,
    check: bool = True,
    real: bool = False,
) -> subprocess.CompletedProcess:
    """Run `script args` (from the repository root) on `nproc` ranks (`launch`).

    Raises:
        AssertionError: with the tail of the output, if `check` and the exit code is not 0.
    """
    proc, _ = launch([str(script), *args], nproc, timeout, real=real)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{script.name} {' '.join(args)} (nproc={nproc}) exited {proc.returncode}\n"
            f"--- stdout (tail)\n{proc.stdout[-3000:]}\n--- stderr (tail)\n{proc.stderr[-6000:]}"
        )
    return proc


def read_metrics(log_dir: Path, split: str = "train") -> list[dict[str, Any]]:
    """The `split` rows of a run's metrics.jsonl, in file order."""
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == split]


def tiny_architecture(overrides: list[str] | None = None):
    """The architecture the bundled example builds (conf/gpt_kto.yaml + example=tiny_kto, whose
    preset is model=tiny), with the tokenizer's vocabulary, composed as the entry script does."""
    from hydra import compose, initialize_config_dir

    from megatron_kto.config.schema import architecture_of, register
    from megatron_kto.data.tokenizers import load_tokenizer

    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="gpt_kto", overrides=[TINY_EXAMPLE, *(overrides or [])])
    arch = architecture_of(cfg.model)
    arch.vocab_size = load_tokenizer("sentencepiece", str(TOKENIZER)).vocab_size
    return arch


def _save_initial_worker(rank: int, world_size: int, out_dir: str, seed: int) -> None:
    from megatron_kto.checkpointing.model_io import save_model
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks
    from megatron_kto.runtime import init_runtime, teardown

    runtime = init_runtime(1, 1, seed=seed)
    arch = tiny_architecture()
    chunks = build_gpt_chunks(arch, ParallelLayout(), runtime.device)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    save_model(out_dir, chunks, arch)
    teardown()


def save_initial_checkpoint(out_dir: Path, seed: int) -> Path:
    """Write a randomly initialised tiny model (TP=1, `seed`) as a restorable checkpoint."""
    run_multirank(_save_initial_worker, 1, str(out_dir), seed, timeout=180)
    return out_dir


def _load_worker(rank: int, world_size: int, paths: list[str]) -> list[dict[str, Any]]:
    import torch

    from megatron_kto.checkpointing.model_io import load_model, read_architecture
    from megatron_kto.checkpointing.pretrained import resolve_pretrained_dir
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks
    from megatron_kto.runtime import init_runtime, teardown

    runtime = init_runtime(1, 1, seed=0)
    out = []
    for path in paths:
        ckpt = resolve_pretrained_dir(path)
        chunks = build_gpt_chunks(read_architecture(ckpt), ParallelLayout(), runtime.device)
        load_model(ckpt, chunks)
        state = chunks[0].state_dict()
        out.append({k: v.detach().clone() for k, v in state.items() if torch.is_tensor(v)})
    teardown()
    return out


def load_tp1_state_dicts(paths: list[Path]) -> list[dict[str, Any]]:
    """Load each checkpoint (any layout; a run's log dir resolves to its latest) into a TP=1,
    PP=1 model and return its state dict (dist_checkpointing reshards on load)."""
    return run_multirank(_load_worker, 1, [str(p) for p in paths], timeout=180)[0]
