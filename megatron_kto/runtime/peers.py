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


def register_process() -> None:
    """Record this rank's host and pid in the default group's store (every rank, once)."""
    store = dist.distributed_c10d._get_default_store()
    store.set(_KEY.format(rank=dist.get_rank()), f"{socket.gethostname()}\t{os.getpid()}")


def is_peer_failure(error: BaseException) -> bool:
    """True when `error` (or what it wraps) is a collective failing because a peer is gone."""
    seen = 0
    e: BaseException | None = error
    while e is not None and seen < 8:
        if isinstance(e, dist.DistError | RuntimeError) and any(w in str(e) for w in _PEER_GONE):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


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


def reporting_rank(dead: list[int] | None, world_size: int) -> int:
    """The lowest surviving rank: the one that prints the line."""
    gone = {0} if dead is None else set(dead)
    return min((r for r in range(world_size) if r not in gone), default=0)


def peer_lost(kept: str) -> PeerLost:
    """The `PeerLost` this rank raises after `is_peer_failure`: `kept` says what stays for a
    rerun (the last good checkpoint)."""
    dead, world = dead_ranks(), dist.get_world_size()
    line = f"{lost_peer_line(dead, world)}; {kept}"
    return PeerLost(line, reporting_rank(dead, world) == dist.get_rank())
