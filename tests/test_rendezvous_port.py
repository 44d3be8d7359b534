"""`rendezvous_port`: free ports for a local rendezvous store, outside the ephemeral range.

Why it matters: the multi-rank tests' rank 0 once failed with EADDRINUSE on a port that
`bind(0)` had handed out, because a peer retrying its connection was given that same port as its
local (ephemeral) port and connected to itself. A port outside the ephemeral range cannot be
handed out that way.
"""

from __future__ import annotations

import random
import socket

import pytest

from megatron_kto.runtime import distributed
from megatron_kto.runtime.distributed import rendezvous_port


def test_port_is_outside_the_ephemeral_range_and_bindable():
    low, high = distributed._ephemeral_range()
    assert 0 < low <= high <= 65535
    for _ in range(20):
        port = rendezvous_port()
        assert not low <= port <= high, (port, low, high)
        assert port >= distributed._LOWEST_PORT
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))  # free when returned


def test_seeding_random_does_not_repeat_the_draw():
    # Tests and `set_seed` seed Python's `random`; two processes seeded alike must not draw alike.
    draws = set()
    for _ in range(8):
        random.seed(1234)
        draws.add(rendezvous_port())
    assert len(draws) > 1


def test_a_taken_port_is_skipped(monkeypatch):
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    try:
        # Pretend the range is everything from busy+1 to 65535: only `busy` and one other port
        # lie outside it above the lowest port; `busy` must never come back.
        monkeypatch.setattr(distributed, "_LOWEST_PORT", busy)
        monkeypatch.setattr(distributed, "_ephemeral_range", lambda: (busy + 2, 65535))
        if not distributed._bindable(busy + 1):
            pytest.skip(f"port {busy + 1} is in use on this machine")
        assert {rendezvous_port() for _ in range(10)} == {busy + 1}
    finally:
        taken.close()


def test_falls_back_to_any_free_port_when_none_is_outside_the_range(monkeypatch):
    monkeypatch.setattr(distributed, "_ephemeral_range", lambda: (1, 65535))
    port = rendezvous_port()
    assert 0 < port <= 65535
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))
