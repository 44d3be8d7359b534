"""Run a function on N gloo ranks from a pytest test — the shared spawn helper of our tests.

Public API (keep it small):

- ``run_multirank(fn, world_size, *args, timeout=...) -> list``: start ``world_size`` fresh
  processes (forked from a ``forkserver`` that has imported torch, megatron-core and our package
  once, `multirank_preload`; each rank gets the caller's current environment), call ``fn(rank, world_size, *args)`` in each with the
  torchrun environment set (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1, a free
  MASTER_PORT outside the kernel's ephemeral range, from `rendezvous_port`), and return the
  per-rank return values in rank order. If any rank raises, the test fails with a
  `MultirankError` carrying that rank's traceback; if the ranks do not all finish within
  ``timeout`` seconds, every rank is killed and the test fails the same way.
- ``solo_world()``: a context manager for *inside* a worker that hides the torchrun
  environment, so `init_runtime()` builds a private world of one process (e.g. a TP=1 reference
  run on the whole batch before the real world is joined). Call `teardown()` before leaving it.
- ``MultirankError``: raised in the pytest process.

Every run of several ranks also records each rank's torch.distributed calls and replays them
under NCCL's ordering rules (`nccl_order`): a run whose order would deadlock on GPUs (or whose
ranks disagree on a collective) fails with the stuck queue heads of every rank, even though gloo
let it finish.

Rules for ``fn``: it must be a module-level function of an importable module (a test module in
``tests/`` is fine — spawned children get the parent's ``sys.path``), its arguments and return
value must be picklable (CPU tensors are), and it should call ``teardown()`` at the end. Each
rank runs with one intra-op thread (``torch.set_num_threads(1)``): CI has 2 cores and up to 4
ranks. The heavy imports are paid once per pytest session (in the forkserver), but each rank
still imports the test module and initialises its world (~1 s), so group several checks into one
run where they share a setup.

Each rank starts from the forkserver's pristine state (it never runs a test function), so no
module state leaks from one run into the next.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.context
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import nccl_order

from megatron_kto.runtime.distributed import rendezvous_port

__all__ = ["MultirankError", "run_multirank", "solo_world"]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# After the first rank fails, the others are usually blocked in a collective with it; give
# them this long to fail on their own (their tracebacks are then reported too) before killing.
_GRACE_AFTER_FAILURE_S = 5.0
#: Imported once by the forkserver the ranks fork from (see `multirank_preload`).
_PRELOAD = ["multirank_preload"]


def _context() -> multiprocessing.context.BaseContext:
    """The start context of every rank: a forkserver that preloads `multirank_preload`.

    The preload list belongs to the one forkserver of this process; it is set before that server
    first starts (the first `run_multirank` of the session).
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    from multiprocessing import forkserver

    if forkserver._forkserver._forkserver_pid is None:
        # Python 3.11's forkserver ignores the caller's sys.path (it passes it but does not use
        # it): give it this process's path through PYTHONPATH so `multirank_preload` (in tests/,
        # which pytest put on sys.path) imports there. Ranks get sys.path from their parent.
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        try:
            forkserver.ensure_running()
        finally:
            if saved is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = saved
    return ctx


class MultirankError(AssertionError):
    """A rank raised, died, or the ranks did not finish in time."""


def _entry(
    rank: int,
    world_size: int,
    port: int,
    out_dir: str,
    env: dict[str, str],
    fn: Callable,
    args: tuple,
) -> None:
    # Own process group, so a timeout kill also reaches helpers a rank started (e.g. a
    # dist_checkpointing writer process).
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    # The forkserver's environment is the one of the session's first run; a rank sees the
    # caller's environment now, as a spawned process would.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    # Installed in the forkserver before megatron-core was imported (then this is a no-op; if
    # the preload failed, the recorder reports itself untraceable rather than miss calls).
    nccl_order.install(env[nccl_order.TRACE_ENV])
    nccl_order.bind_rank(rank, world_size, env[nccl_order.TRACE_ENV])
    out = Path(out_dir)
    try:
        result = fn(rank, world_size, *args)
    except BaseException:
        (out / f"{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1) from None
    nccl_order.dump()
    tmp = out / f"{rank}.pkl.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(result, f)
    tmp.rename(out / f"{rank}.pkl")


def _kill(proc: Any) -> None:
    if not proc.is_alive():
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:  # the rank had not made its own process group yet
        proc.kill()
    proc.join(5)


def run_multirank(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks.

    Args:
        fn: module-level (picklable) function; see the module docstring.
        world_size: number of processes.
        *args: picklable arguments passed to every rank after ``rank, world_size``.
        timeout: seconds for the whole run, imports included.

    Returns:
        The return values of ``fn``, indexed by rank.

    Raises:
        MultirankError: a rank raised (message holds every failed rank's traceback), exited
            without a result, or the run exceeded ``timeout`` (all ranks are killed).
    """
    ctx = _context()
    out_dir = tempfile.mkdtemp(prefix="multirank_")
    port = rendezvous_port()
    out = Path(out_dir)
    trace_dir = out / "nccl_trace"
    # Every multi-rank run records its communication for the NCCL order replay.
    env = {**os.environ, nccl_order.TRACE_ENV: str(trace_dir)}
    procs = [
        ctx.Process(
            target=_entry,
            args=(rank, world_size, port, out_dir, env, fn, args),
            name=f"{getattr(fn, '__name__', 'fn')}-rank{rank}",
        )
        for rank in range(world_size)
    ]
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        failed_at: float | None = None
        timed_out = False
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = now
            if failed_at is not None and now - failed_at > _GRACE_AFTER_FAILURE_S:
                break
            if now > deadline:
                timed_out = True
                break
            time.sleep(0.05)
        for p in procs:
            _kill(p)

        problems = []
        for rank, p in enumerate(procs):
            err = out / f"{rank}.err"
            if err.exists():
                problems.append(f"--- rank {rank} raised:\n{err.read_text()}")
            elif not (out / f"{rank}.pkl").exists():
                why = "was killed" if p.exitcode in (None, -signal.SIGKILL) else "died"
                problems.append(f"--- rank {rank} {why} (exit code {p.exitcode})")
        if timed_out:
            raise MultirankError(
                f"{name} on {world_size} ranks did not finish within {timeout:.0f} s; all ranks "
                f"were killed.\n" + "\n".join(problems)
            )
        if problems:
            raise MultirankError(f"{name} failed on {world_size} ranks:\n" + "\n".join(problems))
        if world_size > 1:
            kept = Path(tempfile.mkdtemp(prefix="nccl_trace_"))
            try:
                # Replayed from a copy that outlives the run's directory, named in the error.
                shutil.copytree(trace_dir, kept, dirs_exist_ok=True)
                nccl_order.check_trace_dir(kept, world_size)
            except nccl_order.NcclOrderError as err:
                raise MultirankError(f"{name} on {world_size} ranks: {err}") from None
            shutil.rmtree(kept, ignore_errors=True)
        results = []
        for rank in range(world_size):
            with open(out / f"{rank}.pkl", "rb") as f:
                results.append(pickle.load(f))
        return results
    finally:
        for p in procs:
            if p.pid is not None:
                _kill(p)
        shutil.rmtree(out_dir, ignore_errors=True)


@contextlib.contextmanager
def solo_world() -> Iterator[None]:
    """Inside a worker: hide the torchrun variables so `init_runtime()` makes a world of one.

    Use it for a single-process reference computation before joining the real world::

        with solo_world():
            rt = init_runtime(1, 1, seed=1)
            ...
            teardown()
        rt = init_runtime(2, 1, seed=1)   # the spawned world again

    The torchrun variables (and a MASTER_PORT that `init_runtime` may pick) are restored on exit.
    """
    saved = {k: os.environ[k] for k in _TORCHRUN_VARS if k in os.environ}
    for k in _TORCHRUN_VARS:
        os.environ.pop(k, None)
    try:
        yield
    finally:
        for k in _TORCHRUN_VARS:
            os.environ.pop(k, None)
        os.environ.update(saved)
