"""`multirank.run_multirank` itself: ranks forked from the preloaded forkserver behave as
freshly spawned processes would.

- a rank's exception fails the test with that rank's traceback;
- a rank sees the caller's environment at the time of the call (not the forkserver's);
- module state a rank changes does not reach the next run (each rank forks from the pristine
  forkserver), and the heavy modules are already imported when the function starts.
"""

from __future__ import annotations

import os
import sys

import pytest
from multirank import MultirankError, run_multirank

pytestmark = pytest.mark.multirank

_STATE: list[str] = []


def _raises_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 says no")
    return rank


def _facts(rank: int, world_size: int, mark: str) -> dict:
    seen = list(_STATE)
    _STATE.append(mark)
    return {
        "env": os.environ.get("MULTIRANK_TEST_PROBE"),
        "rank_env": (os.environ["RANK"], os.environ["WORLD_SIZE"]),
        "state_before": seen,
        "preloaded": "megatron.core" in sys.modules,
    }


def test_a_raising_rank_fails_with_its_traceback():
    with pytest.raises(MultirankError, match="rank 1 raised") as err:
        run_multirank(_raises_on_rank_1, 2, timeout=120)
    assert "ValueError: rank 1 says no" in str(err.value)


def test_ranks_see_the_callers_environment_and_start_clean(monkeypatch):
    monkeypatch.setenv("MULTIRANK_TEST_PROBE", "first")
    first = run_multirank(_facts, 2, "a", timeout=120)
    monkeypatch.setenv("MULTIRANK_TEST_PROBE", "second")
    second = run_multirank(_facts, 2, "b", timeout=120)
    assert [r["env"] for r in first] == ["first", "first"]
    assert [r["env"] for r in second] == ["second", "second"]
    assert [r["rank_env"] for r in second] == [("0", "2"), ("1", "2")]
    assert all(r["state_before"] == [] for r in first + second)  # nothing leaks between runs
    assert all(r["preloaded"] for r in first + second)
