"""What the user reads on the console: our lines, not third-party noise; errors in one line.

`quiet_third_party` is called by our entry points only (examples/*.py via
`entry.run_entry_point`, tools/*.py), never on import of the library, and each filter names one
message or one logger: nothing else a dependency says is hidden, and a user embedding
megatron_kto sees everything. `one_line` and `error_summary` are the one place an exception is
shortened for a message (standard library only, so any room may use them).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from typing import NoReturn

#: (message regex, category): warnings about our dependencies' own internals that a user of
#: this package cannot act on.
NOISY_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    # megatron-core on import, when Transformer Engine / Apex are absent (the expected CPU set-up;
    # it falls back to its own modules).
    (r".*(Transformer Engine|Apex).*not installed.*", UserWarning),
    # torch.distributed.checkpoint deprecations hit by megatron-core 0.16's own loader/saver.
    (r"`load_state_dict` is deprecated and will be removed", FutureWarning),
    (r"`save_state_dict` is deprecated and will be removed", FutureWarning),
    # ... and its planner, on every load of megatron-core's ShardedTensor-based checkpoints.
    (r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning),
    # torch.distributed collectives megatron-core's distributed optimizer calls by their old names.
    (
        r"`torch.distributed.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
        FutureWarning,
    ),
    # Hydra, for a config without `_self_` in its defaults list (every NeMo-Aligner config):
    # Hydra then applies the file after its defaults, which is what those configs intend.
    (r"In '.*': Defaults list is missing `_self_`", UserWarning),
)

#: Loggers whose INFO lines are import-time banners ("Detected Megatron Core, using
#: Megatron-FSDP with Megatron.", "Using Megatron-FSDP without Transformer Engine."): Hydra's
#: stdout logging config shows INFO, and this package does not use Megatron-FSDP.
NOISY_LOGGERS: tuple[str, ...] = ("megatron.core.distributed.fsdp.src.megatron_fsdp",)

#: (logger, message prefix): error lines a dependency logs for a failure that our code catches
#: and reports itself in one line — megatron-core's checkpoint writer logs each worker's write
#: error ("Local process 0 encountered an error: [Errno 28] No space left on device", and
#: torch's "unexpected pos" for the same full disk) before raising it to the saving rank, which
#: names the checkpoint, the space and the checkpoint still good (`checkpointing.manager`).
REPORTED_BY_US: tuple[tuple[str, str], ...] = (
    ("megatron.core.dist_checkpointing.strategies.filesystem_async", "Local process "),
)


class _DropPrefix(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def quiet_third_party() -> None:
    """Install the filters above (idempotent). Call it first thing in an entry point."""
    for message, category in NOISY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for name, prefix in REPORTED_BY_US:
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropPrefix) and f.prefix == prefix for f in log.filters):
            log.addFilter(_DropPrefix(prefix))


#: How long a rank other than 0 waits before exiting on a user error. Every rank finds the
#: same error, but only rank 0 prints it: exiting at once, another rank could make torchrun
#: terminate rank 0 before its line is out (seen on a loaded 2-core machine). Rank 0's own exit
#: ends the job sooner (torchrun then stops the others).
QUIET_RANK_GRACE_S = 10.0


def one_line(error: BaseException) -> str:
    """`error`'s message on one line (each run of whitespace one space); its type's name when
    the message is empty. For errors whose message is written for the user."""
    return " ".join(str(error).split()) or type(error).__name__


def error_summary(error: BaseException, limit: int = 240) -> str:
    """`Type: first line of the message`, at most `limit` characters (cut with "…").

    For errors from libraries (torch, safetensors), whose messages can span pages.
    """
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}".strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"


def exit_with_user_error(message: str) -> NoReturn:
    """`error: <message>` (one line) on rank 0; every rank exits with code 2.

    The rank comes from torchrun's environment, so this works before any process group exists.
    """
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    else:
        time.sleep(QUIET_RANK_GRACE_S)
    sys.exit(2)
