"""Training progress on rank 0: a tqdm bar on a terminal, one compact line per N steps otherwise.

CI logs are not terminals; a tqdm bar there is either silent or floods the log with carriage
returns, so when the stream is not a tty we print a plain summary line instead, e.g.::

    [train] step 20/100 (20%) | loss 0.6931 | rewards/margins 0.0123 | kl 0.0004 | lr 1.00e-05 | 1.52 s/step | eta 0:02:01
"""

from __future__ import annotations

import datetime
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

DEFAULT_KEYS: tuple[str, ...] = ("loss", "rewards/margins", "kl", "lr")


def format_value(name: str, value: float) -> str:
    """Short human-readable form: learning rates and tiny/huge values in scientific notation."""
    v = float(value)
    if name == "lr" or (v != 0.0 and (abs(v) < 1e-3 or abs(v) >= 1e5)):
        return f"{v:.2e}"
    return f"{v:.4f}"


class ProgressReporter:
    """Shows step/max_steps and key metrics on rank 0.

    Args:
        max_steps: total optimizer steps of the run.
        rank0: True only on global rank 0; every other rank prints nothing.
        initial_step: step the run resumes from (the bar starts there).
        print_every: without a tty, print a summary line every this many steps (and on the
            first and the last step).
        keys: metrics shown, in order, when present in the dict given to :meth:`update`.
        stream: where to write (default ``sys.stdout``).
        use_bar: force the tqdm bar on/off; default: on iff ``stream`` is a tty.
        desc: label shown before the bar / at the start of each line.
        clock: monotonic seconds, injectable for tests.
    """

    def __init__(
        self,
        max_steps: int,
        rank0: bool,
        initial_step: int = 0,
        print_every: int = 10,
        keys: Sequence[str] = DEFAULT_KEYS,
        stream: TextIO | None = None,
        use_bar: bool | None = None,
        desc: str = "train",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if print_every < 1:
            raise ValueError(f"print_every must be >= 1, got {print_every}")
        self.max_steps = max_steps
        self.enabled = rank0
        self.print_every = print_every
        self.keys = tuple(keys)
        self.stream = stream if stream is not None else sys.stdout
        self.desc = desc
        self._clock = clock
        self._step = initial_step
        self._start_step = initial_step
        self._start_time: float | None = None
        self._bar: Any = None
        if not self.enabled:
            return
        if use_bar is None:
            isatty = getattr(self.stream, "isatty", None)
            use_bar = bool(isatty and isatty())
        if use_bar:
            from tqdm.auto import tqdm  # imported lazily: only rank 0 with a terminal needs it

            self._bar = tqdm(
                total=max_steps,
                initial=initial_step,
                desc=desc,
                file=self.stream,
                dynamic_ncols=True,
                unit="step",
            )

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record that ``step`` finished with ``metrics`` (only the configured keys are shown)."""
        if not self.enabled:
            return
        now = self._clock()
        first = self._start_time is None
        if first:
            # Time from the first finished step on: it includes start-up cost (building,
            # compiling, first data loads) that would distort s/step and the ETA.
            self._start_time = now
            self._start_step = step
        previous, self._step = self._step, step
        shown = {k: metrics[k] for k in self.keys if k in metrics}
        if self._bar is not None:
            self._bar.set_postfix_str(
                " ".join(f"{k}={format_value(k, v)}" for k, v in shown.items()), refresh=False
            )
            self._bar.update(max(step - previous, 0))
            return
        if step % self.print_every == 0 or step >= self.max_steps or first:
            print(self._summary(step, shown, now), file=self.stream, flush=True)

    def validation(self, step: int, metrics: Mapping[str, float]) -> None:
        """Print a validation pass's result as one line (the configured keys that are present)."""
        shown = [f"{k} {format_value(k, metrics[k])}" for k in self.keys if k in metrics]
        self.write(" | ".join([f"[val] step {step}", *shown]))

    def write(self, message: str) -> None:
        """Print a message on rank 0 without breaking the bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message, file=self.stream)
        else:
            print(message, file=self.stream, flush=True)

    def close(self) -> None:
        """Close the bar (safe to call twice)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _summary(self, step: int, shown: Mapping[str, float], now: float) -> str:
        pct = 100.0 * step / self.max_steps if self.max_steps > 0 else 100.0
        parts = [f"[{self.desc}] step {step}/{self.max_steps} ({pct:.0f}%)"]
        parts += [f"{k} {format_value(k, v)}" for k, v in shown.items()]
        done = step - self._start_step
        if self._start_time is not None and done > 0:
            per_step = (now - self._start_time) / done
            eta = datetime.timedelta(seconds=round(per_step * max(self.max_steps - step, 0)))
            parts.append(f"{per_step:.2f} s/step | eta {eta}")
        return " | ".join(parts)
