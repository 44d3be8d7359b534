"""The NCCL order replay (`tests/nccl_order.py`): hand-written traces whose NCCL behaviour is
known, and a recorded 2-rank gloo run.

The hand-written traces are what each rank would issue; the expected outcome follows from NCCL's
rules (one in-order queue per communicator and rank, see `nccl_order`):

- the MoE x PP deadlock that the router statistics had (their all-reduce on the pipeline group,
  whose communicator also carries megatron's batched activation sends): stage 0 queues
  [all-reduce(mb0), send(mb0)], the last stage [recv(mb0), ..., all-reduce(mb0)] on the one
  pipeline communicator — neither head can complete. The same operations with the all-reduce on
  a group of its own (same ranks, another communicator) complete.
- lone P2P on the pair's communicator passes where the same order on the group's communicator
  (PyTorch with `device_id`) deadlocks;
- a host blocked in `wait()` issues nothing further;
- parts of one batched P2P operation progress independently.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from multirank import MultirankError, run_multirank
from nccl_order import NcclOrderError, check, load_traces, replay

#: The traces `examples/train_gpt_kto.py` recorded (`tests/nccl_trace_main.py`) for one step of
#: a tiny Qwen3-MoE (`hf_tiny.tiny_qwen3_moe_config`, aux loss 0.01) at PP=2, TP=1 on 2 ranks, with
#: the router statistics' all-reduce on megatron's pipeline group (before `router_stats.own_group`).
OLD_ROUTER_TRACE = (
    Path(__file__).parent / "data" / "nccl_order" / "moe_pp2_router_on_pipeline_group"
)

PP = "w1:[0, 1]#0 pipeline"
ROUTER = "w1:[0, 1]#1 router statistics"


class _Trace:
    """Builds one rank's events."""

    def __init__(self) -> None:
        self.events: list[dict] = []

    def coll(self, comm: str, kind: str = "all_reduce", shape=(9,), members=(0, 1), wait=False):
        op = len(self.events)
        self.events.append(
            {
                "e": "op",
                "id": op,
                "kind": kind,
                "comm": comm,
                "members": list(members),
                "dtype": "float32",
                "shape": list(shape),
                "agree": {},
            }
        )
        if wait:
            self.wait(op)
        return op

    def p2p(self, comm: str, parts, lone=False, wait=False, members=(0, 1)):
        op = len(self.events)
        event = {
            "e": "op",
            "id": op,
            "kind": "isend" if lone else "batch_isend_irecv",
            "comm": comm,
            "members": list(members),
            "parts": [[d, peer, "float32", [4, 2], 8] for d, peer in parts],
        }
        if lone:
            event["lone"] = True
        self.events.append(event)
        if wait:
            self.wait(op)
        return op

    def wait(self, *ops: int) -> None:
        self.events.append({"e": "wait", "ids": list(ops)})


def _pipeline_step(router_comm: str) -> dict[int, list[dict]]:
    """Two stages, two micro-batches, 1F1B as megatron-core's non-interleaved schedule issues
    it (batched P2P on the pipeline group), with the router statistics' asynchronous all-reduce
    after each stage's forward of a micro-batch, waited in its backward."""
    s0, s1 = _Trace(), _Trace()
    # stage 0: warm-up forward of mb0 then send it; steady state: forward mb1 + send, recv grad
    a0 = s0.coll(router_comm)
    s0.p2p(PP, [("send", 1)], wait=True)
    a1 = s0.coll(router_comm)
    s0.p2p(PP, [("send", 1), ("recv", 1)], wait=True)  # send_forward_recv_backward
    s0.wait(a0)  # backward of mb0 reads the statistics
    s0.p2p(PP, [("recv", 1)], wait=True)
    s0.wait(a1)
    # stage 1: recv mb0, forward, all-reduce, send grad of mb0 / recv mb1, ...
    s1.p2p(PP, [("recv", 0)], wait=True)
    b0 = s1.coll(router_comm)
    s1.wait(b0)
    s1.p2p(PP, [("send", 0), ("recv", 0)], wait=True)  # send_backward_recv_forward
    b1 = s1.coll(router_comm)
    s1.wait(b1)
    s1.p2p(PP, [("send", 0)], wait=True)
    return {0: s0.events, 1: s1.events}


def test_router_all_reduce_on_pipeline_communicator_deadlocks():
    """The old router statistics (all-reduce on the pipeline group): rank 0 is stuck with the
    all-reduce at the head of the pipeline communicator, rank 1 with the batched receive."""
    with pytest.raises(NcclOrderError) as err:
        check(_pipeline_step(router_comm=PP))
    message = str(err.value)
    print(message)
    assert "deadlock" in message
    rank0, rank1 = message.split("rank 1:")
    assert f"{PP}: head all_reduce #0 float32[9]" in rank0
    assert f"{PP}: head batch_isend_irecv #0 [recv<-0 float32[4, 2]]" in rank1


def test_recorded_moe_pp2_run_with_the_old_router_group_deadlocks():
    """The real run's trace (old code): gloo finished it; under NCCL's rules stage 0 waits with
    the first micro-batch's router all-reduce at the head of the pipeline communicator, before
    its batched send of the activations, and stage 1 with the batched receive of them at the
    head of the same communicator, before its all-reduce. Both lone-P2P placements."""
    traces, why = load_traces(OLD_ROUTER_TRACE)
    assert not why and sorted(traces) == [0, 1]
    pipeline = "w1:[0, 1]#1 PIPELINE_MODEL_PARALLEL_GROUP"
    for on_group in (False, True):
        with pytest.raises(NcclOrderError, match="deadlock") as err:
            replay(traces, lone_p2p_on_group=on_group)
        print(err.value)
        rank0, rank1 = str(err.value).split("rank 1:")
        assert f"{pipeline}: head all_reduce #30 float32[9]" in rank0
        assert f"{pipeline}: head batch_isend_irecv #30 [recv<-0 float32[41, 1, 64]]" in rank1


def test_router_all_reduce_on_its_own_communicator_completes():
    check(_pipeline_step(router_comm=ROUTER))


def test_mismatched_collectives_fail():
    a, b = _Trace(), _Trace()
    a.coll(PP, shape=(9,), wait=True)
    b.coll(PP, shape=(5,), wait=True)
    with pytest.raises(NcclOrderError, match="different collectives"):
        check({0: a.events, 1: b.events})
    a, b = _Trace(), _Trace()
    a.coll(PP, kind="all_reduce", wait=True)
    b.coll(PP, kind="broadcast", wait=True)
    with pytest.raises(NcclOrderError, match="different collectives"):
        check({0: a.events, 1: b.events})


def test_p2p_size_mismatch_fails():
    a, b = _Trace(), _Trace()
    a.p2p(PP, [("send", 1)], wait=True)
    b.p2p(PP, [("recv", 0)], wait=True)
    b.events[0]["parts"][0][4] = 6
    with pytest.raises(NcclOrderError, match="matched by"):
        check({0: a.events, 1: b.events})


def test_lone_p2p_placement():
    """A lone isend before an all-reduce on rank 0, after it on rank 1: fine on the pair's
    communicator, a deadlock when lone P2P shares the group's (PyTorch with `device_id`)."""
    a, b = _Trace(), _Trace()
    s = a.p2p(PP, [("send", 1)], lone=True)
    a.coll(PP, wait=True)
    a.wait(s)
    b.coll(PP, wait=True)
    b.p2p(PP, [("recv", 0)], lone=True, wait=True)
    traces = {0: a.events, 1: b.events}
    replay(traces, lone_p2p_on_group=False)
    with pytest.raises(NcclOrderError, match="deadlock"):
        replay(traces, lone_p2p_on_group=True)


def test_host_wait_blocks_later_operations():
    """Two communicators, each rank waits on the one the other reaches second: a deadlock only
    because the hosts block (asynchronous, both complete)."""
    x, y = "w1:[0, 1]#0 x", "w1:[0, 1]#1 y"

    def traces(blocking: bool) -> dict[int, list[dict]]:
        a, b = _Trace(), _Trace()
        a.coll(x, wait=blocking)
        a.coll(y, wait=blocking)
        b.coll(y, wait=blocking)
        b.coll(x, wait=blocking)
        return {0: a.events, 1: b.events}

    check(traces(blocking=False))
    with pytest.raises(NcclOrderError, match="host blocked in wait"):
        check(traces(blocking=True))


def test_batched_parts_progress_independently():
    """A 3-rank ring in one batch per rank, sends listed before receives: every part finds its
    peer's part in the peer's (same) batch."""
    comm = "w1:[0, 1, 2]#0"
    ranks = {}
    for r in range(3):
        t = _Trace()
        t.p2p(comm, [("send", (r + 1) % 3), ("recv", (r - 1) % 3)], wait=True, members=(0, 1, 2))
        ranks[r] = t.events
    check(ranks)
    # a receive that no rank sends never completes
    ranks[2] = _Trace().events
    with pytest.raises(NcclOrderError, match="deadlock"):
        check(ranks)


def _recorded_worker(rank: int, world_size: int, hang: bool) -> list[str]:
    import torch
    import torch.distributed as dist

    from megatron_kto.runtime import init_runtime, teardown

    init_runtime(1, 2, seed=0)
    from megatron.core import parallel_state

    from megatron_kto.models.router_stats import own_group

    pp = parallel_state.get_pipeline_model_parallel_group()
    own = own_group(pp)  # the router statistics' group: `pp`'s ranks, another communicator
    assert own is not pp and own_group(pp) is own  # made once
    assert dist.get_process_group_ranks(own) == dist.get_process_group_ranks(pp)
    group = pp if hang else own
    t = torch.ones(3)
    buf = torch.zeros(2)
    if rank == 0:  # stage 0: the all-reduce of its forward, then the activation's send
        work = dist.all_reduce(t, group=group, async_op=True)
        send = dist.P2POp(dist.isend, buf, 1, pp)
        for req in dist.batch_isend_irecv([send]):
            req.wait()
    else:  # the last stage: receive, run its forward, then its all-reduce
        recv = dist.P2POp(dist.irecv, buf, 0, pp)
        for req in dist.batch_isend_irecv([recv]):
            req.wait()
        work = dist.all_reduce(t, group=group, async_op=True)
    work.wait()
    teardown()
    return [float(t[0])]


def test_recorded_run_is_replayed():
    """A real 2-rank gloo run through `run_multirank` (which records and replays every run):
    gloo completes an all-reduce issued on the pipeline group before stage 0's batched send and
    after stage 1's receive; the replay stops the run. (Every other multi-rank test of the suite
    is the passing case: `_recorded_worker(..., hang=False)` is the same on a group of its own.)"""
    with pytest.raises(MultirankError, match="deadlock") as err:
        run_multirank(_recorded_worker, 2, True, timeout=120)
    assert "PIPELINE_MODEL_PARALLEL_GROUP: head all_reduce" in str(err.value)
