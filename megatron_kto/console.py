"""Keep a normal start-up's console to what the user needs: our lines, not third-party noise.

Called by our entry points only (examples/*.py via `config.entry.run_entry_point`, tools/*.py),
never on import of the library, and each filter names one message or one logger: nothing
else a dependency says is hidden, and a user embedding megatron_kto sees everything.
"""

from __future__ import annotations

import logging
import warnings

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


def quiet_third_party() -> None:
    """Install the filters above (idempotent). Call it first thing in an entry point."""
    for message, category in NOISY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
