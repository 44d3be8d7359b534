"""PreemptionHandler turns SIGTERM/SIGUSR1 into a flag and restores handlers; max_time parsing."""

from __future__ import annotations

import datetime
import os
import signal

import pytest

from megatron_kto.checkpointing.preemption import PreemptionHandler, parse_max_time


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_sets_flag_instead_of_killing(sig) -> None:
    with PreemptionHandler() as handler:
        assert not handler.requested
        os.kill(os.getpid(), sig)  # delivered to the main thread before the next bytecode
        assert handler.requested
        assert handler.received == sig
        os.kill(os.getpid(), signal.SIGUSR1)  # a second signal keeps the first reason
        assert handler.received == sig


def test_previous_handlers_are_restored() -> None:
    calls = []

    def mine(signum, frame):
        calls.append(signum)

    before_term = signal.getsignal(signal.SIGTERM)
    previous_usr1 = signal.signal(signal.SIGUSR1, mine)
    try:
        with PreemptionHandler() as handler:
            assert signal.getsignal(signal.SIGUSR1) == handler._handle
        assert signal.getsignal(signal.SIGUSR1) is mine
        assert signal.getsignal(signal.SIGTERM) == before_term
        os.kill(os.getpid(), signal.SIGUSR1)
        assert calls == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous_usr1)


def test_handlers_restored_when_body_raises() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError), PreemptionHandler():
        raise RuntimeError("training failed")
    assert signal.getsignal(signal.SIGTERM) == before


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("00:03:55:00", 3 * 3600 + 55 * 60),
        ("01:00:00:01", 86400 + 1),
        ("0:48:00:00", 48 * 3600),  # fields may overflow, as in Lightning
        (" 00:00:00:30 ", 30),
        (datetime.timedelta(hours=2), 7200),
        ({"days": 1, "hours": 2}, 93600),
        (90, 90),
        (1.5, 1.5),
    ],
)
def test_parse_max_time(value, seconds) -> None:
    assert parse_max_time(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", [None, "", "null", "None"])
def test_parse_max_time_unset(value) -> None:
    assert parse_max_time(value) is None


@pytest.mark.parametrize(
    "value", ["03:55:00", "1:2:3:4:5", "aa:bb:cc:dd", "00:00:00:00", -5, True, {"weeks": 1}, [1]]
)
def test_parse_max_time_rejects(value) -> None:
    with pytest.raises(ValueError):
        parse_max_time(value)
