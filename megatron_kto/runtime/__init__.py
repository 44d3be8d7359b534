"""Process runtime: distributed init, megatron parallel state, seeds, device, CPU compatibility.

The names below load `runtime.distributed` (torch) on first use, so that entry points can use
torch-free helpers such as `runtime.launcher_env` before a config is validated.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Runtime", "init_runtime", "set_seed", "teardown"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from megatron_kto.runtime import distributed

        return getattr(distributed, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
