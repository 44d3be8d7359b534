"""Graceful stop on preemption (SIGTERM / SIGUSR1); `trainer.max_time` is read by
`config.max_time.parse_max_time`.

Schedulers (SLURM, Kubernetes) announce preemption with a signal some time before killing the
job. `PreemptionHandler` only records the signal; the trainer polls `requested` after each step,
agrees across ranks (one all-reduce), saves a checkpoint and exits 0, so the requeued job resumes
from it.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterable
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionHandler:
    """Context manager: while active, the given signals set `requested` instead of killing us.

    The previous handlers are restored on exit. Use from the main thread (Python delivers
    signals only there).

    Example::

        with PreemptionHandler() as preemption:
            for batch in data:
                train_step(batch)
                if all_ranks_agree(preemption.requested):
                    save(); break
    """

    def __init__(self, signals: Iterable[int] = DEFAULT_SIGNALS) -> None:
        self.signals = tuple(signals)
        self.received: int | None = None
        """The first signal received, None if none."""
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        """True once one of the signals has arrived."""
        return self.received is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
            logger.warning(
                "received %s: will save a checkpoint and stop after the current step",
                signal.Signals(signum).name,
            )

    def __enter__(self) -> PreemptionHandler:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionHandler must be entered from the main thread")
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, previous in self._previous.items():
            # signal.signal returns None for handlers not installed from Python; SIG_DFL is the
            # closest equivalent we can put back.
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
