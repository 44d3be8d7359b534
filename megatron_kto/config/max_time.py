"""`trainer.max_time`, Lightning/NeMo style, in seconds (checked by `validate`, used by the
trainer's time limit; torch-free)."""

from __future__ import annotations

import datetime
import re
from typing import Any

_DHMS = re.compile(r"^\s*(\d+):(\d+):(\d+):(\d+)\s*$")


def parse_max_time(value: Any) -> float | None:
    """`trainer.max_time` in seconds, Lightning/NeMo style.

    Accepts "DD:HH:MM:SS" (e.g. "00:03:55:00"), a `datetime.timedelta`, a dict of
    `days`/`hours`/`minutes`/`seconds`, or a number of seconds; None or "" (or "null") means no
    limit.

    Raises:
        ValueError: unparseable or not positive.
    """
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "null", "none")):
        return None
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, dict):
        unknown = set(value) - {"days", "hours", "minutes", "seconds"}
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}; use days/hours/minutes/seconds")
        seconds = datetime.timedelta(**{k: float(v) for k, v in value.items()}).total_seconds()
    elif isinstance(value, bool):
        raise ValueError(f"expected 'DD:HH:MM:SS', got {value!r}")
    elif isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        m = _DHMS.match(value)
        if not m:
            raise ValueError(f"expected 'DD:HH:MM:SS' (e.g. '00:03:55:00'), got {value!r}")
        # Like Lightning, fields may overflow ("00:48:00:00" is two days).
        days, hours, minutes, secs = (int(g) for g in m.groups())
        seconds = float(((days * 24 + hours) * 60 + minutes) * 60 + secs)
    else:
        raise ValueError(f"expected 'DD:HH:MM:SS', got {type(value).__name__} {value!r}")
    if seconds <= 0:
        raise ValueError(f"must be positive, got {value!r}")
    return seconds
