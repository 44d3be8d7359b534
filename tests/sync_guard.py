"""Count host<->device synchronisations in a block of code — on CPU, where there is no device.

On CUDA, reading a tensor's value on the host (`.item()`, `.tolist()`, `.cpu()`, `float(t)`,
`if t:` ...) waits for every kernel queued before it, and building a device tensor from Python
data (`torch.tensor(3, device=dev)`) copies from pageable memory, which also blocks. A loss path
that does either once per micro-batch stalls the GPU once per micro-batch. None of that shows on
CPU as a delay, so `HostSyncGuard` records the calls instead: patch, run, count.

What it sees: the Tensor methods and torch functions in `_TENSOR_METHODS` / `_TORCH_FUNCTIONS`,
and host->device moves (`Tensor.cuda()`, `Tensor.to(device, non_blocking=True)`), called from
anywhere below the guarded block (including megatron-core code the block calls).
What it cannot see: implicit synchronisations inside single ops (e.g. boolean-mask indexing,
whose output shape depends on the data), and a blocking `Tensor.to(device)` of a host tensor
(on CPU the same call as a device tensor's no-op); avoid those by review.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

# Each of these returns host data computed from device data (or, for __bool__ & co., branches on
# it), i.e. waits for the device.
_TENSOR_METHODS = (
    "item",
    "tolist",
    "cpu",
    "numpy",
    "__float__",
    "__int__",
    "__bool__",
    "__index__",
    "nonzero",
)
# Device tensors from Python data (a blocking host->device copy), and data-dependent shapes.
_TORCH_FUNCTIONS = ("tensor", "as_tensor", "nonzero", "unique", "masked_select")
# Host->device copies: `Tensor.cuda()`, and `Tensor.to(..., non_blocking=True)` naming a device.
# A non-blocking move means something only between host and device: the hot loop's device
# tensors never need one, and from pageable host memory (a cached host-built index, say) the
# copy blocks the host anyway. A plain `.to(device)` is not recorded: on CPU the guard cannot
# tell a host tensor's copy from a device tensor's no-op.


@dataclass
class SyncCall:
    """One recorded call."""

    name: str
    where: str
    """'file:line function' of the innermost caller outside torch."""
    stack: list[str] = field(repr=False, default_factory=list)


def _is_python_data(value: Any) -> bool:
    return not isinstance(value, torch.Tensor)


def _from_python_data(args: tuple, kwargs: dict) -> bool:
    """Whether a `torch.tensor` / `torch.as_tensor` call builds a device tensor from host data."""
    return bool(args) and _is_python_data(args[0]) and kwargs.get("device") is not None


def _is_device(value: Any) -> bool:
    return isinstance(value, (torch.device, str, int)) and not isinstance(value, bool)


def _moves_to_a_device(args: tuple, kwargs: dict) -> bool:
    """Whether a `Tensor.to` call (`args[0]` the tensor) is a non-blocking move to a named
    device: `to(device=..., non_blocking=True)` or positionally `to(device, dtype, True)`."""
    positional = args[1:]
    device_first = bool(positional) and _is_device(positional[0])
    if kwargs.get("device") is None and not device_first:
        return False
    # Positionally: `to(device, dtype, non_blocking, copy)`.
    default = device_first and len(positional) > 2 and positional[2]
    return kwargs.get("non_blocking", default) is True


class HostSyncGuard:
    """Context manager recording synchronising calls made while it is active.

    Args:
        ignore: substrings of the caller location to leave out (a documented exception, e.g. a
            call the test does on purpose).
    """

    def __init__(self, ignore: tuple[str, ...] = ()) -> None:
        self.calls: list[SyncCall] = []
        self._ignore = ignore
        self._saved: list[tuple[Any, str, Any]] = []
        self._depth = 0

    def _record(self, name: str) -> None:
        stack = traceback.extract_stack()[:-2]
        frames = [
            f for f in stack if "/torch/" not in f.filename and not f.filename.endswith(__file__)
        ]
        where = f"{frames[-1].filename}:{frames[-1].lineno} {frames[-1].name}" if frames else "?"
        if any(part in where for part in self._ignore):
            return
        self.calls.append(SyncCall(name, where, [f"{f.filename}:{f.lineno}" for f in frames]))

    def _wrap(self, owner: Any, name: str, when: Callable[[tuple, dict], bool] | None) -> None:
        original = getattr(owner, name)
        guard = self

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            # Re-entrant calls (e.g. torch.tensor calling __index__) count once.
            if guard._depth == 0 and (when is None or when(args, kwargs)):
                guard._record(f"{getattr(owner, '__name__', owner)}.{name}")
            guard._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                guard._depth -= 1

        self._saved.append((owner, name, original))
        setattr(owner, name, wrapper)

    def __enter__(self) -> HostSyncGuard:
        for name in _TENSOR_METHODS:
            self._wrap(torch.Tensor, name, None)
        for name in _TORCH_FUNCTIONS:
            self._wrap(torch, name, _from_python_data if name in ("tensor", "as_tensor") else None)
        self._wrap(torch.Tensor, "to", _moves_to_a_device)
        self._wrap(torch.Tensor, "cuda", None)
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def report(self) -> str:
        """One line per recorded call."""
        return "\n".join(f"{c.name} at {c.where}" for c in self.calls)
