"""A rank that died: which one, said in one line instead of a gloo/NCCL stack trace.

When a process of the job is killed (`kill -9`, the OOM killer, a crash), every collective that
needs it fails on the others at once with the transport's words — gloo's "Connection reset by
peer", "Connection closed by peer" — and no rank number. `register_process` writes each rank's
host and pid into the job's rendezvous store at start-up; after such a failure `dead_ranks`
reads them back and asks the OS which processes on this host are gone. Under torchrun the store
is the agent's, so it outlives any worker; without torchrun rank 0 hosts it, and a store that no
longer answers means rank 0 is the one gone.
"""

from __future__ import annotations

import datetime
import os
import socket
import time

import torch.distributed as dist

from megatron_kto.runtime.errors import PeerLost

_KEY = "megatron_kto/process/{rank}"
#: Words of the transports' errors when a peer's process is gone (gloo's TCP pairs, NCCL's
#: remote-error / abort reports, torch's socket wrappers).
_PEER_GONE = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Connection refused",
    "remote process exited",
    "NCCL communicator was aborted",
)
#: Words of a collective's timeout: gloo's (provoked: "[.../gloo/transport/tcp/
#: unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete") and NCCL's
#: (torch's ProcessGroupNCCL.cpp watchdog: "Watchdog caught collective operation timeout:
#: WorkNCCL(...) ran for ... milliseconds before timing out").
_TIMED_OUT = ("Timed out waiting", "Watchdog caught collective operation timeout")
_STEP_KEY = "megatron_kto/step/{rank}"
_TIMED_OUT_KEY = "megatron_kto/timed_out/{rank}"


def register_process() -> None:
    """Record this rank's host and pid in the default group's store (every rank, once)."""
    store = dist.distributed_c10d._get_default_store()
    store.set(_KEY.format(rank=dist.get_rank()), f"{socket.gethostname()}\t{os.getpid()}")


def mark_step(step: int) -> None:
    """Record in the store that this rank enters training step `step` (read after a timeout to
    say where a stuck rank stopped); nothing without a process group of several ranks."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        store = dist.distributed_c10d._get_default_store()
        store.set(_STEP_KEY.format(rank=dist.get_rank()), str(step))


def _matches(error: BaseException, words: tuple[str, ...]) -> bool:
    """Whether `error` or an exception it wraps is a collective's error containing `words`."""
    seen = 0
    e: BaseException | None = error
    while e is not None and seen < 8:
        if isinstance(e, dist.DistError | RuntimeError) and any(w in str(e) for w in words):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def is_timeout(error: BaseException) -> bool:
    """True when `error` (or what it wraps) is a collective that timed out waiting for a peer."""
    return _matches(error, _TIMED_OUT)


def is_peer_failure(error: BaseException) -> bool:
    """True when `error` (or what it wraps) is a collective failing because a peer is gone or
    never joined (a timeout)."""
    return _matches(error, _PEER_GONE + _TIMED_OUT)


def _alive(pid: int) -> bool:
    """Whether process `pid` still runs; a zombie (killed, not yet reaped by its launcher,
    which is what a fresh `kill -9` leaves under torchrun) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc: trust kill(0)
    return state not in ("Z", "X")


def dead_ranks(timeout_s: float = 5.0, settle_s: float = 3.0) -> list[int] | None:
    """The ranks whose process on this host no longer exists, lowest first; None when the store
    does not answer (it lived in rank 0's process). Ranks on other hosts are never listed.

    A killed process closes its sockets while it exits, so a peer can see the connection drop
    before the process is gone: local peers are looked at again for up to `settle_s` seconds
    until one is found dead.
    """
    world, me = dist.get_world_size(), dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    host = socket.gethostname()
    local = {}
    try:
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
        for rank in range(world):
            if rank != me:
                where, pid = store.get(_KEY.format(rank=rank)).decode().split("\t")
                if where == host:
                    local[rank] = int(pid)
    except (RuntimeError, dist.DistError, ValueError):
        return None
    deadline = time.monotonic() + settle_s
    while True:
        dead = [rank for rank, pid in sorted(local.items()) if not _alive(pid)]
        if dead or not local or time.monotonic() > deadline:
            return dead
        time.sleep(0.05)


def lost_peer_line(dead: list[int] | None, world_size: int) -> str:
    """What the surviving ranks say: which rank died (or that the store's host, rank 0, did)."""
    if dead is None:
        who = "rank 0 (which held the job's rendezvous store) is gone"
    elif not dead:
        who = "a rank on another host is gone (its host's log says which and why)"
    elif len(dead) == 1:
        who = f"rank {dead[0]} of {world_size} died (killed or crashed: its own log says why)"
    else:
        who = f"ranks {', '.join(map(str, dead))} of {world_size} died (killed or crashed)"
    return f"{who}; the other ranks stopped"


def stuck_ranks(settle_s: float, timeout_s: float = 5.0) -> tuple[list[int], dict[int, int]]:
    """After a collective timed out on this rank: the ranks that are stuck, lowest first, and
    the step each rank last entered (`mark_step`; absent before its first step).

    Every rank whose collective times out says so in the store, then waits up to `settle_s`
    seconds for the others to say the same (their collectives may have started a little later);
    a rank that has not said it by then, or that is behind this rank's step while the rest
    have said it, is stuck. Returns ([], {}) when the store does not answer.
    """
    world, me = dist.get_world_size(), dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    others = [r for r in range(world) if r != me]
    try:
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
        store.set(_TIMED_OUT_KEY.format(rank=me), "1")
        deadline = time.monotonic() + settle_s
        while True:
            steps = {
                r: int(store.get(_STEP_KEY.format(rank=r)))
                for r in range(world)
                if store.check([_STEP_KEY.format(rank=r)])
            }
            silent = [r for r in others if not store.check([_TIMED_OUT_KEY.format(rank=r)])]
            mine = steps.get(me, 0)
            behind = {r for r in silent if steps.get(r, 0) < mine}
            if time.monotonic() > deadline or (silent and set(silent) == behind):
                return silent, steps
            time.sleep(0.1)
    except (RuntimeError, dist.DistError, ValueError):
        return [], {}


def stuck_line(stuck: list[int], steps: dict[int, int], world_size: int, minutes: float) -> str:
    """What the survivors say after a timeout: which rank(s) stopped answering, and where."""
    waited = f"trainer.distributed_timeout_minutes={minutes:g}"
    if not stuck:
        return (
            f"every rank timed out waiting for the others after {waited} (a collective that "
            "no rank could finish: the ranks called different collectives)"
        )
    at = sorted({steps.get(r, 0) for r in stuck})
    where = (
        "before its first step"
        if at == [0]
        else f"at step{'s' if len(at) > 1 else ''} {', '.join(map(str, at))}"
    )
    who = f"rank {stuck[0]}" if len(stuck) == 1 else f"ranks {', '.join(map(str, stuck))}"
    alive = "its process is" if len(stuck) == 1 else "their processes are"
    return (
        f"{who} of {world_size} stopped answering {where} ({alive} alive: stuck, e.g. in I/O "
        f"or a deadlock); the other ranks timed out after {waited}"
    )


def reporting_rank(dead: list[int] | None, world_size: int) -> int:
    """The lowest surviving rank: the one that prints the line."""
    gone = {0} if dead is None else set(dead)
    return min((r for r in range(world_size) if r not in gone), default=0)


def peer_lost(kept: str, error: BaseException, timeout_minutes: float) -> PeerLost:
    """The `PeerLost` this rank raises after `is_peer_failure(error)`: `kept` says what stays
    for a rerun (the last good checkpoint); `timeout_minutes` is the collectives' timeout.

    A timeout with every local peer alive names the stuck ranks (`stuck_ranks`, waiting up to
    the timeout again, at most 10 s, for the other survivors' timeouts); otherwise the dead.
    """
    world = dist.get_world_size()
    timed_out = is_timeout(error)
    dead = dead_ranks(settle_s=0.0 if timed_out else 3.0)
    if timed_out and dead == []:
        stuck, steps = stuck_ranks(settle_s=min(timeout_minutes * 60, 10.0))
        line = f"{stuck_line(stuck, steps, world, timeout_minutes)}; {kept}"
        return PeerLost(line, reporting_rank(stuck, world) == dist.get_rank())
    line = f"{lost_peer_line(dead, world)}; {kept}"
    return PeerLost(line, reporting_rank(dead, world) == dist.get_rank())
