"""The configuration error every check raises (its message starts with the key)."""

from __future__ import annotations


class ConfigError(ValueError):
    """An impossible or inconsistent configuration; the message starts with the key."""


def need(condition: bool, key: str, message: str) -> None:
    """Raise `ConfigError("<key>: <message>")` unless `condition` holds."""
    if not condition:
        raise ConfigError(f"{key}: {message}")
