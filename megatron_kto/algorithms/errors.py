"""Training-loop errors meant for the user (no torch import: `entry.user_error_types` reads
them before anything heavy is loaded)."""

from __future__ import annotations


class NonFiniteError(RuntimeError):
    """A step's loss, log-probs, rewards or gradient norm were NaN/Inf under
    `trainer.non_finite=stop`; the message names the step, the quantities, the rows and the
    last good checkpoint. Every rank raises it at the same step."""


class OutputWriteFailed(RuntimeError):
    """Rank 0 could not write the run's metrics (metrics.jsonl, TensorBoard); every rank raises
    it at the same step. `path` and `error` are rank 0's (None elsewhere)."""

    def __init__(self, path: object = None, error: BaseException | None = None) -> None:
        super().__init__(f"{path}: {error}")
        self.path = path
        self.error = error


class OutputError(RuntimeError):
    """An output of the run (metrics, TensorBoard) could not be written; the message names the
    path, the cause, the free space and the checkpoint still good."""
