"""Runtime errors the entry points catch (no torch import: read before a config is validated)."""

from __future__ import annotations


class PeerLost(RuntimeError):
    """A collective failed because another rank's process is gone. The message is the one line
    to print (`runtime.peers.peer_lost`); `reporter` is True on the one rank that prints it."""

    def __init__(self, message: str, reporter: bool) -> None:
        super().__init__(message)
        self.reporter = reporter
