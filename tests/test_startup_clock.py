"""The start-up line: each phase's wall time, from the process's own start."""

from __future__ import annotations

import re
import time

from megatron_kto.logging.startup import StartupClock


def test_the_line_names_each_phase_and_sums_them():
    clock = StartupClock()
    time.sleep(0.2)
    clock.lap("data")
    clock.lap("model")
    line = clock.line()
    match = re.fullmatch(
        r"start-up (\d+\.\d) s: imports (\d+\.\d) s, data (\d+\.\d) s, model (\d+\.\d) s", line
    )
    assert match, line
    total, imports, data, model = (float(g) for g in match.groups())
    assert data >= 0.2 and model < 0.1
    # The pytest process started well before this test: imports counts from the process start.
    assert imports > 0.5
    assert abs(total - (imports + data + model)) <= 0.15
