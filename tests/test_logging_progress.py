"""Rank-0 progress display: compact lines without a tty, a tqdm bar with one."""

from __future__ import annotations

import io

import pytest

from megatron_kto.logging import ProgressReporter
from megatron_kto.logging.progress import format_value


class _FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class _TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


METRICS = {"loss": 0.6931, "rewards/margins": 0.0123, "kl": 0.5, "lr": 1e-5, "grad_norm": 3.0}


def test_non_tty_prints_compact_line_every_n_steps() -> None:
    """Steps 1..10 at 2 s each, print_every 4: lines at step 1 (first), 4, 8 and 10 (last).

    At step 8 the clock has run 7 steps × 2 s since step 1 → 2.00 s/step, 2 steps left → 0:00:04.
    """
    out, clock = io.StringIO(), _FakeClock()
    progress = ProgressReporter(max_steps=10, rank0=True, print_every=4, stream=out, clock=clock)
    for step in range(1, 11):
        progress.update(step, METRICS)
        clock.t += 2.0
    progress.close()
    lines = out.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in lines] == [
        "[train] step 1/10 (10%)",
        "[train] step 4/10 (40%)",
        "[train] step 8/10 (80%)",
        "[train] step 10/10 (100%)",
    ]
    assert lines[2] == (
        "[train] step 8/10 (80%) | loss 0.6931 | rewards/margins 0.0123 | kl 0.5000 "
        "| lr 1.00e-05 | 2.00 s/step | eta 0:00:04"
    )
    assert "grad_norm" not in out.getvalue()  # only the configured keys
    assert "\r" not in out.getvalue()


def test_resumed_run_counts_from_initial_step() -> None:
    out = io.StringIO()
    progress = ProgressReporter(
        max_steps=100, rank0=True, initial_step=40, print_every=10, stream=out, clock=_FakeClock()
    )
    progress.update(41, {"loss": 1.0})
    progress.update(45, {"loss": 1.0})
    progress.update(50, {"loss": 1.0})
    assert [line.split(" | ")[0] for line in out.getvalue().splitlines()] == [
        "[train] step 41/100 (41%)",
        "[train] step 50/100 (50%)",
    ]


def test_validation_prints_one_line_on_rank_0() -> None:
    out, quiet = io.StringIO(), io.StringIO()
    val = {"loss": 0.5017, "rewards/margins": -0.0047, "kl": 0.0, "logps/chosen": -9.0}
    ProgressReporter(max_steps=30, rank0=True, stream=out).validation(10, val)
    ProgressReporter(max_steps=30, rank0=False, stream=quiet).validation(10, val)
    assert out.getvalue() == "[val] step 10 | loss 0.5017 | rewards/margins -0.0047 | kl 0.0000\n"
    assert quiet.getvalue() == ""


def test_other_ranks_print_nothing() -> None:
    out = _TTY()
    progress = ProgressReporter(max_steps=5, rank0=False, print_every=1, stream=out)
    for step in range(1, 6):
        progress.update(step, METRICS)
    progress.write("hello")
    progress.close()
    assert out.getvalue() == ""


def test_tty_shows_a_tqdm_bar_with_metrics() -> None:
    out = _TTY()
    progress = ProgressReporter(max_steps=4, rank0=True, stream=out)
    assert progress._bar is not None
    for step in range(1, 5):
        progress.update(step, METRICS)
    progress.write("checkpoint saved")
    progress.close()
    text = out.getvalue()
    assert "4/4" in text
    assert "loss=0.6931" in text and "lr=1.00e-05" in text
    assert "checkpoint saved" in text


def test_format_value_and_validation() -> None:
    assert format_value("lr", 3e-4) == "3.00e-04"
    assert format_value("loss", 0.5) == "0.5000"
    assert format_value("kl", 2e-5) == "2.00e-05"
    assert format_value("kl", 0.0) == "0.0000"
    with pytest.raises(ValueError, match="print_every"):
        ProgressReporter(max_steps=1, rank0=True, print_every=0, stream=io.StringIO())
