"""The one exception type of the checkpointing package."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing, partial or does not match the model."""
