"""`planning.measure.AllocationTrace`: windows, rises, and the drift a free on another thread
leaves (the profiler records the allocator's events only on the threads it traces)."""

from __future__ import annotations

import threading

import torch

from megatron_kto.planning.measure import AllocationTrace

MIB = 2**20


def _free_elsewhere(box: list) -> None:
    t = threading.Thread(target=box.clear)
    t.start()
    t.join()


def test_windows_rise_and_drift():
    keep = []
    with AllocationTrace() as trace:
        keep.append(torch.empty(3 * MIB, dtype=torch.uint8))  # live before either window
        with trace.window():
            scratch = torch.empty(2 * MIB, dtype=torch.uint8)
            del scratch
            staged = [torch.empty(5 * MIB, dtype=torch.uint8)]
            _free_elsewhere(staged)  # freed, but the trace never sees it
        with trace.window():
            scratch = torch.empty(2 * MIB, dtype=torch.uint8)
            del scratch
    (start1, peak1), (start2, peak2) = trace.windows
    assert start1 >= 3 * MIB and trace.at_start == start1 and trace.peak == peak1
    assert peak1 - start1 == 5 * MIB  # the staged copy counted...
    assert start2 - start1 == 5 * MIB  # ...and never released: the running total drifted
    assert peak2 - start2 == 2 * MIB  # a later window's rise is unaffected
    assert trace.smallest_rise == 2 * MIB


def test_one_window_required():
    try:
        with AllocationTrace():
            torch.empty(10)
    except RuntimeError as e:
        assert "no memplan::window block" in str(e)
    else:
        raise AssertionError("a trace without a window must raise")
