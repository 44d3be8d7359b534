"""Where a run's start-up time goes, said in one line before its first step.

A tiny run on one H200 spent ~21 s before its second step, most of it outside the steps
(imports, distributed set-up, the first step's kernel compilation); this line shows which
phase to look at, on any machine, without a profiler.
"""

from __future__ import annotations

import time

import psutil


class StartupClock:
    """Wall time of consecutive start-up phases, from the process's own start."""

    def __init__(self) -> None:
        now = time.time()
        # Interpreter start -> here: imports (torch, megatron-core) and config composition.
        self._phases: list[tuple[str, float]] = [("imports", now - psutil.Process().create_time())]
        self._last = time.monotonic()

    def lap(self, phase: str) -> None:
        """Close `phase`: the time since the previous lap (or the clock's creation)."""
        now = time.monotonic()
        self._phases.append((phase, now - self._last))
        self._last = now

    def line(self) -> str:
        """e.g. 'start-up 15.9 s: imports 5.1 s, distributed set-up 9.6 s, data 0.1 s, ...'."""
        total = sum(seconds for _, seconds in self._phases)
        parts = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in self._phases)
        return f"start-up {total:.1f} s: {parts}"
