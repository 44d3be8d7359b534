"""Process runtime: distributed init, megatron parallel state, seeds, device, CPU compatibility.

The names below load `runtime.distributed` (torch) on first use, so that entry points can use
torch-free helpers such as `runtime.launcher_env` before a config is validated. This lazy
re-export is for callers outside the package (tests, tools, users); modules of megatron_kto
import `runtime.distributed` by name, and no module of this package imports the package itself
(`tests/test_import_graph.py` holds both to it: no cycle through this file).
"""

from __future__ import annotations

from typing import Any

__all__ = ["Runtime", "init_runtime", "set_seed", "teardown"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from megatron_kto.runtime import distributed

        return getattr(distributed, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
