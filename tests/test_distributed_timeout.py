"""`trainer.distributed_timeout_minutes` reaches the process groups: a collective that a peer
never joins fails after the configured timeout (3 s here), not after megatron-core's or torch's
30 minutes — on the default group and on a megatron-core group (TP) alike — with words that
`runtime.peers.is_timeout` recognises. One 2-rank run, ~8 s.
"""

from __future__ import annotations

import time

import pytest
from multirank import run_multirank

pytestmark = pytest.mark.multirank

TIMEOUT_MINUTES = 0.05  # 3 s


def _worker(rank: int, world_size: int) -> list[tuple[float, str]]:
    import nccl_order
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_kto.runtime.distributed import init_runtime
    from megatron_kto.runtime.peers import is_timeout

    if nccl_order._RECORDER is not None:  # a peer that never joins is this test's point
        nccl_order._RECORDER.untraceable = "rank 1 skips the collectives on purpose"
    init_runtime(2, 1, seed=0, timeout_minutes=TIMEOUT_MINUTES)
    if rank == 1:  # never joins; stays alive past both timeouts so rank 0 sees a timeout
        time.sleep(2 * TIMEOUT_MINUTES * 60 + 1.5)
        return []
    waits = []
    for group in (None, parallel_state.get_tensor_model_parallel_group()):
        started = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=group)
            message = "finished"
        except RuntimeError as e:
            message = str(e)
            assert is_timeout(e), message  # what run.py names the stuck rank after
        waits.append((time.monotonic() - started, message))
    return waits


def test_collectives_time_out_after_the_configured_minutes():
    waits = run_multirank(_worker, 2, timeout=60)[0]
    print("waits:", [(round(s, 2), m[:80]) for s, m in waits])
    assert len(waits) == 2
    for seconds, message in waits:
        assert "timed out" in message.lower() or "timeout" in message.lower(), message
        assert 2.5 <= seconds < 10, (seconds, message)
