"""The configuration error every check raises (its message starts with the key)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any


class ConfigError(ValueError):
    """An impossible or inconsistent configuration; the message starts with the key."""


def need(condition: bool, key: str, message: str) -> None:
    """Raise `ConfigError("<key>: <message>")` unless `condition` holds."""
    if not condition:
        raise ConfigError(f"{key}: {message}")


def need_one_of(value: Any, key: str, choices: tuple[str, ...]) -> None:
    """`need` for a key that takes one of `choices`."""
    need(value in choices, key, f"must be one of {list(choices)}, got {value!r}")


def suggestion(key: str, known: Iterable[str]) -> str:
    """` (did you mean 'x'?)` for the known key closest to a mistyped `key`, else ''."""
    close = difflib.get_close_matches(key, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
