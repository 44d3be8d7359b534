"""NCCL's ordering rules, checked on gloo: record every rank's communication, replay it as NCCL.

gloo forgives orders that hang NCCL. On a GPU each NCCL communicator has its own stream, and a
communicator runs its operations strictly in the order each rank issued them: the k-th operation
on a communicator can only start when every rank it involves has reached it. Our CPU tests run
gloo, which matches a collective by its tag and lets other work pass it, so an order that
deadlocks NCCL can pass CI. This module records, during multi-rank gloo runs, what NCCL would
queue where, and replays the trace under NCCL's rules.

The rules modelled (PyTorch's ProcessGroupNCCL, torch >= 2.8):

- **Communicators.** Every process group is its own communicator, named here by its global rank
  list plus a creation index (the k-th group created with that rank list: two groups with the
  same ranks are two communicators). A group's collectives and its batched point-to-point
  operations (`batch_isend_irecv`) run on the group's communicator. A lone `send` / `recv` /
  `isend` / `irecv` runs on a communicator of its own for that pair of ranks (one per group and
  pair) — except when the default group was made with `device_id` (as `runtime.distributed`
  does on GPUs), where PyTorch queues lone P2P on the group's communicator too. Both placements
  are replayed (`check`), as either can be what a GPU run does.
- **Order.** Each communicator is one in-order queue per rank. A collective completes when it is
  at the head of the queue of every member; then the members must agree on it (operation,
  dtype, shape), or NCCL would mix up data (reported as a mismatch). A send completes when its
  matching receive (the next unmatched receive from this rank, same communicator) is at the head
  of the peer's queue, and vice versa; the parts of one batched P2P operation progress
  independently, and the batch completes when all its parts have. Matched sends and receives
  must agree in dtype and element count.
- **The host.** A rank issues operations in program order without waiting, except where it
  blocks: `Work.wait()` of an asynchronous operation, the end of a synchronous one
  (`async_op=False`), the wait of a coalescing manager. On CUDA those waits make the compute
  stream — and so every operation issued afterwards — wait for the operation; the replay holds
  the rank's later operations back until it completes, which is the same constraint.

If the replay cannot make progress it raises `NcclOrderError` with the stuck head of every
rank's queues (rank, communicator, operation, shape) and what each host is waiting for.

Recording: `install(trace_dir, rank)` patches `torch.distributed`'s functions in place (before
megatron-core is imported: it keeps references to some of them) and writes
``<trace_dir>/rank<N>.jsonl`` at exit. `tests/multirank.py` and `tests/e2e_cli.py` do this for
every multi-rank run — installed once in the forkserver their ranks fork from
(`tests/multirank_preload.py`, then `bind_rank` per rank), or through `tests/nccl_trace_main.py`
for a real torchrun launch (`TRACE_ENV`) — and replay the traces when the run succeeded; a run that cannot be traced (a world of another size inside the launch,
a receive from any source) is not replayed. Recorded: the collectives of `_COLLECTIVES` (object
collectives through the ones they call), send / recv / isend / irecv, `batch_isend_irecv`,
`_coalescing_manager` (megatron's bucketed gradient and parameter syncs), `Work.wait`, and
`new_group` / `init_process_group` (to name communicators). What it cannot see: operations
issued from C++ or other processes, and device-side waits that are no `wait()` (a compute
stream waiting on another stream's event) — none in our paths.

Layouts whose CLI runs were replayed clean when this was written (besides every multi-rank test
of the suite): PP=2 with HF output and checkpoint saves; PP=2 x VPP=2; TP=2 with sequence
parallelism; DP=2 with the distributed optimizer, overlapped gradient reduction and HF output;
CP=2; LoRA at TP=2 with HF output; Qwen3-MoE with the aux loss at EP=2 x PP=2, TP=2 (SP) x PP=2,
and EP=2 with the distributed optimizer and HF output.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import json
import os
import threading
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "TRACE_ENV",
    "NcclOrderError",
    "check",
    "check_trace_dir",
    "install",
    "replay",
]

#: Environment variable naming the directory a process writes its trace to (`install`).
TRACE_ENV = "MEGATRON_KTO_NCCL_TRACE"

# Collectives: name -> the parameter whose tensor describes the operation, and the parameters
# whose values every member must agree on besides (op, dtype, shape).
_COLLECTIVES: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "all_reduce": ("tensor", ("op",)),
    "broadcast": ("tensor", ("src", "group_src")),
    "reduce": ("tensor", ("dst", "group_dst", "op")),
    "all_gather": ("tensor", ()),
    "all_gather_into_tensor": ("input_tensor", ()),
    "_all_gather_base": ("input_tensor", ()),
    "reduce_scatter": ("output", ("op",)),
    "reduce_scatter_tensor": ("output", ("op",)),
    "_reduce_scatter_base": ("output", ("op",)),
    "gather": ("tensor", ("dst", "group_dst")),
    "scatter": ("tensor", ("src", "group_src")),
    "all_to_all": (None, ()),  # per-rank sizes may differ legitimately
    "all_to_all_single": (None, ()),
    "barrier": (None, ()),
}
_LONE_P2P = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}


class NcclOrderError(AssertionError):
    """The recorded communication would hang NCCL, or its ranks disagree on an operation."""


# ---------------------------------------------------------------------------------------------
# Recording
# ---------------------------------------------------------------------------------------------


def _describe(tensor: Any) -> tuple[str, list[int], int]:
    """(dtype, shape, element count) of a tensor; a list's first tensor (with its length)."""
    if isinstance(tensor, list | tuple):
        if not tensor:
            return "none", [0], 0
        dtype, shape, numel = _describe(tensor[0])
        return dtype, [len(tensor), *shape], numel * len(tensor)
    return str(tensor.dtype).removeprefix("torch."), list(tensor.shape), int(tensor.numel())


def _value(arg: Any) -> str:
    """A comparable text for an argument ranks must agree on (a `ReduceOp` object's repr holds
    its address; its type's name is what counts)."""
    op = getattr(arg, "op", None)
    return str(op if op is not None and not isinstance(arg, int) else arg)


class _Recorder:
    """Per-process recorder: the patched functions call `collective`, `lone_p2p`, `batch` and
    `wait`; events are kept in memory and written once, at exit."""

    def __init__(self, trace_dir: Path, rank: int, world_size: int):
        self.path = Path(trace_dir) / f"rank{rank}.jsonl"
        self.rank, self.world_size = rank, world_size
        self.events: list[dict] = []
        self.next_id = 0
        self.local = threading.local()
        self.groups: dict[int, tuple[Any, str, list[int]]] = {}  # id(pg) -> (pg, key, members)
        self.created: dict[tuple, int] = defaultdict(int)
        self.worlds = 0  # full-size worlds joined so far
        self.solos = 0
        self.world: tuple[str, list[int]] | None = None  # (key prefix, global -> launch rank)
        self.work_ops: dict[int, tuple[Any, list[int]]] = {}
        self.coalescing: list[list[int]] = []
        self.untraceable = ""

    # -- state ----------------------------------------------------------------------------
    def depth(self) -> int:
        return getattr(self.local, "depth", 0)

    def joined(self, world_size: int) -> None:
        """A default group of `world_size` ranks was created."""
        if world_size == self.world_size:
            self.worlds += 1
            self.world = (f"w{self.worlds}", list(range(world_size)))
        elif world_size == 1:  # a private world of one (`multirank.solo_world`)
            self.solos += 1
            self.world = (f"solo{self.rank}.{self.solos}", [self.rank])
        else:
            self.world = None
            self.untraceable = f"a world of {world_size} ranks inside a launch of {self.world_size}"

    def group_created(self, pg: Any, desc: str | None) -> None:
        import torch.distributed as dist

        if self.world is None or not isinstance(pg, dist.ProcessGroup):
            return
        prefix, launch = self.world
        members = [launch[r] for r in dist.get_process_group_ranks(pg)]
        index = self.created[(prefix, tuple(members))]
        self.created[(prefix, tuple(members))] += 1
        key = f"{prefix}:{members}#{index}" + (f" {desc}" if desc else "")
        self.groups[id(pg)] = (pg, key, members)

    def comm(self, group: Any) -> tuple[str, list[int]] | None:
        """(communicator key, member launch ranks) of `group` (None: the default group)."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        if self.world is None:
            return None
        prefix, launch = self.world
        if group is None or group is c10d._get_default_group():
            return f"{prefix}:world", list(launch)
        known = self.groups.get(id(group))
        if known is not None and known[0] is group:
            return known[1], known[2]
        members = [launch[r] for r in dist.get_process_group_ranks(group)]
        return f"{prefix}:{members}#?", members

    def global_peer(self, group: Any, peer: int | None, group_peer: int | None) -> int:
        import torch.distributed as dist

        if peer is None:
            peer = dist.get_global_rank(group, group_peer) if group is not None else group_peer
        return self.world[1][peer]

    # -- events ---------------------------------------------------------------------------
    def _op(self, event: dict, group: Any) -> int | None:
        where = self.comm(group)
        if where is None:
            return None
        event["id"], event["comm"], event["members"] = self.next_id, where[0], where[1]
        self.next_id += 1
        self.events.append(event)
        if self.coalescing:
            self.coalescing[-1].append(event["id"])
        return event["id"]

    def issued(self, op_id: int | None, work: Any, async_op: bool) -> None:
        """After an operation returned: remember its handle, or block for a synchronous one
        (inside a coalescing manager the manager's end decides)."""
        if op_id is None:
            return
        if async_op or self.coalescing:
            if work is not None:
                self.work_ops[id(work)] = (work, [op_id])
        else:
            self.wait([op_id])

    def collective(self, name: str, bound: inspect.BoundArguments) -> int | None:
        tensor_arg, agreed = _COLLECTIVES[name]
        args = bound.arguments
        event = {"e": "op", "kind": name}
        if tensor_arg is not None:
            event["dtype"], event["shape"], _ = _describe(args[tensor_arg])
        elif name.startswith("all_to_all"):
            tensor = args.get("input", args.get("input_tensor_list"))
            event["dtype"] = _describe(tensor)[0]
        event["agree"] = {a: _value(args[a]) for a in agreed if args.get(a) is not None}
        return self._op(event, args.get("group"))

    def lone_p2p(self, name: str, bound: inspect.BoundArguments) -> int | None:
        args = bound.arguments
        direction = _LONE_P2P[name]
        group = args.get("group")
        peer = args.get("dst" if direction == "send" else "src")
        group_peer = args.get("group_dst" if direction == "send" else "group_src")
        if peer is None and group_peer is None:
            self.untraceable = f"{name} from any source"
            return None
        dtype, shape, numel = _describe(args["tensor"])
        part = [direction, self.global_peer(group, peer, group_peer), dtype, shape, numel]
        return self._op({"e": "op", "kind": name, "lone": True, "parts": [part]}, group)

    def batch(self, ops: list) -> int | None:
        parts = []
        for op in ops:
            direction = "send" if getattr(op.op, "__name__", "") == "isend" else "recv"
            dtype, shape, numel = _describe(op.tensor)
            peer = self.global_peer(op.group, op.peer, op.group_peer)
            parts.append([direction, peer, dtype, shape, numel])
        return self._op({"e": "op", "kind": "batch_isend_irecv", "parts": parts}, ops[0].group)

    def wait(self, ids: list[int]) -> None:
        if ids:
            self.events.append({"e": "wait", "ids": ids})

    def dump(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            if self.untraceable:
                f.write(json.dumps({"e": "untraceable", "why": self.untraceable}) + "\n")
            for event in self.events:
                f.write(json.dumps(event) + "\n")
        tmp.rename(self.path)


_RECORDER: _Recorder | None = None


def _guarded(rec: _Recorder, original: Callable, record: Callable) -> Callable:
    """`original` wrapped so that only the outermost patched call records (torch's functions
    call each other: `batch_isend_irecv` -> `isend`, `_all_gather_base` -> ...)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if rec.depth() > 0:
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        rec.local.depth = 1
        try:
            return record(original, bound)
        finally:
            rec.local.depth = 0

    wrapper._nccl_order_original = original
    return wrapper


def _patch(name: str, wrapper: Callable) -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    # Both names: megatron-core calls `torch.distributed.X`, torch's own helpers (object
    # collectives, `P2POp`'s check of `op`) use the module's globals.
    setattr(c10d, name, wrapper)
    if getattr(dist, name, None) is not None:
        setattr(dist, name, wrapper)


def install(trace_dir: str | Path, rank: int | None = None) -> None:
    """Record this process's communication under `trace_dir` (written at exit).

    Call before megatron-core is imported (it binds some of these functions at import).
    Idempotent. `rank` / world size default to the launcher's RANK / WORLD_SIZE.
    """
    global _RECORDER
    if _RECORDER is not None:
        return
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    rec = _Recorder(Path(trace_dir), rank, int(os.environ.get("WORLD_SIZE", "1")))
    _RECORDER = rec
    # Nothing may slip past: refuse to record if megatron-core already holds the originals.
    import sys

    if "megatron.core" in sys.modules:
        rec.untraceable = "installed after megatron-core was imported"

    def record_collective(name: str) -> Callable:
        def record(original, bound):
            op_id = rec.collective(name, bound)
            work = original(*bound.args, **bound.kwargs)
            rec.issued(op_id, work, bool(bound.arguments.get("async_op")))
            return work

        return record

    for name in _COLLECTIVES:
        if hasattr(c10d, name):
            _patch(name, _guarded(rec, getattr(c10d, name), record_collective(name)))

    def record_p2p(name: str) -> Callable:
        def record(original, bound):
            op_id = rec.lone_p2p(name, bound)
            work = original(*bound.args, **bound.kwargs)
            rec.issued(op_id, work if name.startswith("i") else None, name.startswith("i"))
            return work

        return record

    for name in _LONE_P2P:
        _patch(name, _guarded(rec, getattr(c10d, name), record_p2p(name)))

    def record_batch(original, bound):
        op_id = rec.batch(bound.arguments["p2p_op_list"])
        works = original(*bound.args, **bound.kwargs)
        for work in works or []:
            rec.issued(op_id, work, True)
        return works

    _patch("batch_isend_irecv", _guarded(rec, c10d.batch_isend_irecv, record_batch))

    def record_new_group(original, bound):
        pg = original(*bound.args, **bound.kwargs)
        rec.group_created(pg, bound.arguments.get("group_desc"))
        return pg

    _patch("new_group", _guarded(rec, c10d.new_group, record_new_group))

    def record_init(original, bound):
        result = original(*bound.args, **bound.kwargs)
        rec.joined(dist.get_world_size())
        return result

    _patch("init_process_group", _guarded(rec, c10d.init_process_group, record_init))

    coalescing_manager = c10d._coalescing_manager

    @functools.wraps(coalescing_manager)
    def recorded_coalescing(group=None, device=None, async_ops=False):
        # Operations inside a coalescing manager are issued together at its end; a synchronous
        # manager blocks there, an asynchronous one at its `wait()`.
        import contextlib

        @contextlib.contextmanager
        def managed():
            outer = rec.depth() == 0  # batch_isend_irecv's own manager records as the batch
            ids: list[int] = []
            if outer:
                rec.coalescing.append(ids)
            try:
                with coalescing_manager(group, device, async_ops) as cm:
                    yield cm
            finally:
                if outer:
                    rec.coalescing.pop()
            if outer:
                cm._nccl_order_ids = ids
                if not async_ops:
                    rec.wait(ids)

        return managed()

    _patch("_coalescing_manager", recorded_coalescing)

    manager_wait = c10d._CoalescingManager.wait

    def coalesced_wait(self):
        ids = getattr(self, "_nccl_order_ids", None)
        if ids is not None and rec.depth() == 0:
            rec.wait(ids)
            self._nccl_order_ids = None
        return manager_wait(self)

    c10d._CoalescingManager.wait = coalesced_wait

    work_wait = dist.Work.wait

    def recorded_work_wait(self, *args, **kwargs):
        known = rec.work_ops.pop(id(self), None)
        if known is not None and known[0] is self:
            rec.wait(known[1])
        return work_wait(self, *args, **kwargs)

    dist.Work.wait = recorded_work_wait
    atexit.register(rec.dump)


def bind_rank(rank: int, world_size: int, trace_dir: str | Path | None = None) -> None:
    """Set this process's launch rank and world size (a recorder installed before the launcher's
    variables were set, as `multirank`'s ranks do: they inherit it from their forkserver), and
    the directory its trace goes to (default: where it was installed)."""
    if _RECORDER is not None:
        _RECORDER.rank, _RECORDER.world_size = rank, world_size
        parent = Path(trace_dir) if trace_dir is not None else _RECORDER.path.parent
        _RECORDER.path = parent / f"rank{rank}.jsonl"


def dump() -> None:
    """Write this process's trace now (also done at exit)."""
    if _RECORDER is not None:
        _RECORDER.dump()


# ---------------------------------------------------------------------------------------------
# Replay
# ---------------------------------------------------------------------------------------------


@dataclass
class _Entry:
    """One queued operation: a collective, or P2P parts [direction, peer, dtype, shape, numel]."""

    rank: int
    event: dict
    done: list[bool] = field(default_factory=list)

    @property
    def is_p2p(self) -> bool:
        return "parts" in self.event

    def describe(self) -> str:
        e = self.event
        if self.is_p2p:
            parts = [
                f"{d}{'->' if d == 'send' else '<-'}{peer} {dt}{shape}"
                + (" (done)" if self.done[i] else "")
                for i, (d, peer, dt, shape, _) in enumerate(e["parts"])
            ]
            return f"{e['kind']} #{e['id']} [{', '.join(parts)}]"
        shape = f" {e.get('dtype', '')}{e.get('shape', '')}" if "dtype" in e else ""
        return f"{e['kind']} #{e['id']}{shape}"


def _placed(event: dict, lone_p2p_on_group: bool) -> tuple[str, list[int]]:
    """The communicator an operation runs on (see the module docstring)."""
    if event.get("lone") and not lone_p2p_on_group:
        me_peer = sorted({event["parts"][0][1], event["rank"]})
        return f"{event['comm']} p2p{me_peer}", me_peer
    return event["comm"], event["members"]


def replay(traces: dict[int, list[dict]], lone_p2p_on_group: bool) -> None:
    """Simulate NCCL running the recorded operations of every rank.

    Args:
        traces: rank -> that rank's events in issue order: ``{"e": "op", ...}`` (see
            `_Recorder`) and ``{"e": "wait", "ids": [...]}`` (the host blocks until those of its
            operations complete).
        lone_p2p_on_group: place lone send/recv on the group's communicator (PyTorch with
            `device_id`) instead of the pair's own.

    Raises:
        NcclOrderError: the ranks disagree on an operation at the head of a communicator, or no
            rank can make progress before every operation completed (the message lists every
            rank's stuck queue heads and host).
    """
    ranks = sorted(traces)
    pc = dict.fromkeys(ranks, 0)
    completed: dict[int, set[int]] = {r: set() for r in ranks}
    queues: dict[tuple[int, str], deque[_Entry]] = defaultdict(deque)
    members: dict[str, list[int]] = {}

    def finish(entry: _Entry, comm: str) -> None:
        queues[(entry.rank, comm)].popleft()
        completed[entry.rank].add(entry.event["id"])

    def advance_hosts() -> bool:
        moved = False
        for r in ranks:
            events = traces[r]
            while pc[r] < len(events):
                event = events[pc[r]]
                if event["e"] == "op":
                    comm, who = _placed({**event, "rank": r}, lone_p2p_on_group)
                    members[comm] = who
                    parts = event.get("parts", [])
                    queues[(r, comm)].append(_Entry(r, event, [False] * len(parts)))
                elif event["e"] == "wait":
                    if not all(i in completed[r] for i in event["ids"]):
                        break
                pc[r] += 1
                moved = True
        return moved

    def run_collective(comm: str, heads: dict[int, _Entry]) -> bool:
        if set(heads) != set(members[comm]) or any(h.is_p2p for h in heads.values()):
            return False
        keyed = {
            r: {k: h.event.get(k) for k in ("kind", "dtype", "shape", "agree")}
            for r, h in heads.items()
        }
        if len({json.dumps(v, sort_keys=True) for v in keyed.values()}) > 1:
            lines = [f"  rank {r}: {heads[r].describe()} {keyed[r]['agree'] or ''}" for r in heads]
            raise NcclOrderError(
                f"ranks issue different collectives as the same operation of communicator "
                f"{comm}:\n" + "\n".join(lines)
            )
        for h in heads.values():
            finish(h, comm)
        return True

    def run_p2p(comm: str, heads: dict[int, _Entry]) -> bool:
        moved = False
        for r, entry in heads.items():
            if not entry.is_p2p:
                continue
            for i, (direction, peer, dtype, shape, numel) in enumerate(entry.event["parts"]):
                other = heads.get(peer)
                if entry.done[i] or other is None or not other.is_p2p:
                    continue
                # the peer's first unmatched part from this rank in the other direction
                want = "recv" if direction == "send" else "send"
                for j, (d2, p2, dt2, shape2, n2) in enumerate(other.event["parts"]):
                    if other.done[j] or d2 != want or p2 != r:
                        continue
                    if (dt2, n2) != (dtype, numel):
                        raise NcclOrderError(
                            f"on {comm}, rank {r}'s {direction} {dtype}{shape} is matched by "
                            f"rank {peer}'s {d2} {dt2}{shape2}"
                        )
                    entry.done[i] = other.done[j] = True
                    moved = True
                    break
        for entry in heads.values():
            if entry.is_p2p and all(entry.done):
                finish(entry, comm)
        return moved

    while True:
        moved = advance_hosts()
        for comm in list(members):
            heads = {r: queues[(r, comm)][0] for r in members[comm] if queues[(r, comm)]}
            if heads:
                moved |= run_collective(comm, heads) or run_p2p(comm, heads)
        if not moved:
            break

    if all(pc[r] == len(traces[r]) for r in ranks) and not any(queues.values()):
        return
    raise NcclOrderError(
        "NCCL would deadlock (lone P2P on "
        f"{'the group' if lone_p2p_on_group else 'a pair'}'s communicator); stuck heads:\n"
        + _stuck_report(ranks, traces, pc, queues)
    )


def _stuck_report(ranks, traces, pc, queues) -> str:
    lines = []
    for r in ranks:
        events = traces[r]
        host = (
            "finished"
            if pc[r] == len(events)
            else f"blocked in wait for ops {events[pc[r]]['ids']}"
        )
        lines.append(f"rank {r}: host {host}")
        for (qr, comm), queue in sorted(queues.items(), key=lambda kv: kv[0][1]):
            if qr == r and queue:
                more = f" (+{len(queue) - 1} queued behind)" if len(queue) > 1 else ""
                lines.append(f"  {comm}: head {queue[0].describe()}{more}")
    return "\n".join(lines)


def check(traces: dict[int, list[dict]]) -> None:
    """`replay` with lone P2P on the pair's communicator and on the group's (both can be a GPU
    run's placement)."""
    for on_group in (False, True):
        replay(traces, lone_p2p_on_group=on_group)


def load_traces(trace_dir: str | Path) -> tuple[dict[int, list[dict]], str]:
    """(rank -> events, why the trace cannot be checked or "") from `trace_dir`."""
    traces, why = {}, ""
    for path in sorted(Path(trace_dir).glob("rank*.jsonl")):
        events = [json.loads(line) for line in path.read_text().splitlines()]
        untraceable = [e["why"] for e in events if e["e"] == "untraceable"]
        why = why or (untraceable[0] if untraceable else "")
        traces[int(path.stem.removeprefix("rank"))] = [e for e in events if e["e"] != "untraceable"]
    return traces, why


def check_trace_dir(trace_dir: str | Path, world_size: int) -> bool:
    """Replay the traces of a finished run of `world_size` ranks (`check`).

    Returns:
        True if checked; False if the run could not be traced (a missing rank's file, a world
        of another size): nothing to say then.

    Raises:
        NcclOrderError: as `replay`, with the trace directory named.
    """
    traces, why = load_traces(trace_dir)
    if why or sorted(traces) != list(range(world_size)):
        return False
    try:
        check(traces)
    except NcclOrderError as err:
        raise NcclOrderError(f"{err}\n(trace: {trace_dir})") from None
    return True
