"""Training-loop errors meant for the user (no torch import: `entry.user_error_types` reads
them before anything heavy is loaded)."""

from __future__ import annotations


class NonFiniteError(RuntimeError):
    """A step's loss, log-probs, rewards or gradient norm were NaN/Inf under
    `trainer.non_finite=stop`; the message names the step, the quantities, the rows and the
    last good checkpoint. Every rank raises it at the same step."""
