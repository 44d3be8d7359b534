"""Let the real megatron-core run on CPU (gloo) — the only module that patches megatron-core.

megatron-core 0.16 assumes CUDA in a handful of places that are otherwise device-agnostic
(see shared/MEGATRON_CPU_NOTES.md for the measurements). On a machine without CUDA we
redirect exactly those assumptions to the CPU, so our TP/PP/DP tests exercise megatron-core's
own parallel layers, schedules, DDP, optimizer and dist_checkpointing in CI.

Every patch below names the megatron-core code it serves. Nothing here runs when CUDA is
present: `apply()` is a no-op on GPU machines.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch

#: megatron-core versions these patches were written and measured against.
SUPPORTED_MEGATRON_PREFIX = "0.16."

_APPLIED = False


class CPUCompatError(RuntimeError):
    """megatron-core cannot be run on CPU with this version of the compatibility layer."""


def megatron_core_version() -> str:
    """Return the installed megatron-core version string."""
    from megatron.core import package_info

    return package_info.__version__


def check_version(version: str | None = None) -> None:
    """Refuse megatron-core versions the patches were not written for.

    Args:
        version: version to check; defaults to the installed megatron-core.

    Raises:
        CPUCompatError: if the version is outside ``SUPPORTED_MEGATRON_PREFIX``.
    """
    version = version if version is not None else megatron_core_version()
    if not version.startswith(SUPPORTED_MEGATRON_PREFIX):
        raise CPUCompatError(
            f"megatron_kto's CPU compatibility layer supports megatron-core "
            f"{SUPPORTED_MEGATRON_PREFIX}x, found {version}. Install 'megatron-core>=0.16.1,<0.17' "
            f"or run on a CUDA machine (where no patching is needed)."
        )


def _is_cuda_device(device: Any) -> bool:
    # megatron passes "cuda", torch.device("cuda"), or torch.cuda.current_device() (an int).
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _cpu_device_factory(fn: Callable) -> Callable:
    """Wrap a torch factory so that a CUDA ``device=`` argument means the CPU."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory") and not torch.cuda.is_available():
            # models/common/embeddings/rope_utils.py::get_pos_emb_on_this_cp_rank (context
            # parallelism) pins its index for a non-blocking copy; there is no pinned memory
            # without an accelerator, and nothing to overlap.
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)

    wrapper._mkto_original = fn  # type: ignore[attr-defined]
    return wrapper


# Factories called with device="cuda" / device=torch.cuda.current_device() in megatron-core 0.16.1:
# pipeline_parallel/schedules.py (total_num_tokens), p2p_communication.py (shape/recv buffers),
# transformer/utils.py::get_default_causal_mask, optimizer/optimizer.py & clip_grads.py (scalars),
# tensor_parallel/layers.py & mappings.py (gather buffers), dist_checkpointing/exchange_utils.py.
_FACTORIES = ("zeros", "ones", "empty", "tensor", "empty_like", "zeros_like", "full", "arange")


def _cpu_tensor_type(original: Callable) -> Callable:
    # optimizer/optimizer.py ~671/690, distrib_optimizer.py ~361/420 and clip_grads.py ~167 branch on
    # `param.type() == 'torch.cuda.FloatTensor'`; report CPU tensors under their CUDA names there.
    @functools.wraps(original)
    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    return type_


def _patch_rng() -> None:
    """Route megatron's CUDA RNG tracker to the CPU generator.

    `tensor_parallel.random.CudaRNGStatesTracker` stores per-stream states taken with
    `torch.cuda.get_rng_state()` after `torch.cuda.manual_seed(seed)`. Seeding must reach the
    CPU generator (a no-op would give every TP rank the same "tensor-model-parallel" stream,
    i.e. identical dropout masks), and `_set_cuda_rng_state` must really restore the state
    (otherwise `fork()` and activation-recompute RNG replay silently do nothing).
    """
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))

    def get_state(device=None, clone=False, graph_safe=False):
        state = torch.get_rng_state()
        return state.clone() if clone else state

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    # The tracker's fork() warns whenever the CPU RNG moved inside a CUDA-RNG context; on CPU the
    # two generators are the same object, so that warning fires on every dropout call.
    logging.getLogger(mrandom.__name__).setLevel(logging.ERROR)


class _CpuStream:
    """The one CPU "stream": work is already ordered, so waits and events are no-ops.

    megatron's MoE all-to-all dispatcher (`token_dispatcher.py` ~445/871) creates a side stream
    for its device-to-host copies of the split sizes and compares it with the current stream;
    every instance is the same object, so it sees no side stream and records nothing.
    """

    _instance: _CpuStream | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> _CpuStream:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def wait_stream(self, stream: Any) -> None:
        """Nothing to wait for."""

    def wait_event(self, event: Any) -> None:
        """Nothing to wait for."""

    def record_event(self, event: Any = None) -> _CpuStream:
        """An event that is already complete (this object: it has `synchronize`)."""
        return self

    def synchronize(self) -> None:
        """Already complete."""

    def query(self) -> bool:
        """Always complete."""
        return True


def _patch_streams() -> None:
    import contextlib

    torch.cuda.Stream = _CpuStream  # type: ignore[misc, assignment]
    torch.cuda.current_stream = lambda device=None: _CpuStream()
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()


def _patch_all_to_all() -> None:
    """Split sizes as Python ints for `all_to_all_single`.

    On GPU megatron's all-to-all dispatcher moves its split sizes to host numpy arrays
    (`moe_utils.maybe_move_tensor_to_cpu(..., as_numpy=True)` acts only on CUDA tensors); on the
    CPU they stay tensors, which torch's `all_to_all_single` binding rejects (TypeError).
    """
    import torch.distributed as dist

    original = dist.all_to_all_single

    @functools.wraps(original)
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, **kw):
        def as_list(sizes):
            return None if sizes is None else [int(s) for s in sizes]

        return original(
            output, input, as_list(output_split_sizes), as_list(input_split_sizes), **kw
        )

    dist.all_to_all_single = all_to_all_single


def _patch_uneven_collectives() -> None:
    """Uneven `all_gather` / `reduce_scatter` lists, which gloo rejects ("invalid tensor size").

    megatron's MoE token dispatcher with TP > 1 (sequence parallel) gathers and reduce-scatters
    a different number of routed tokens per TP rank (`tensor_parallel.mappings`
    `_gather_along_first_dim` / `_reduce_scatter_along_first_dim` with split sizes); NCCL takes
    uneven lists. Here: all-gather rows padded to the longest and cut back; reduce-scatter as an
    all-reduce of the concatenation, keeping this rank's part. Even lists take gloo's own path.
    """
    import torch.distributed as dist

    all_gather, reduce_scatter = dist.all_gather, dist.reduce_scatter

    @functools.wraps(all_gather)
    def uneven_all_gather(tensor_list, tensor, group=None, async_op=False):
        if all(t.shape == tensor.shape for t in tensor_list):
            return all_gather(tensor_list, tensor, group=group, async_op=async_op)
        longest = max(t.shape[0] for t in tensor_list)
        padded = tensor.new_zeros(longest, *tensor.shape[1:])
        padded[: tensor.shape[0]] = tensor
        parts = [torch.empty_like(padded) for _ in tensor_list]
        all_gather(parts, padded, group=group)
        for out, part in zip(tensor_list, parts, strict=True):
            out.copy_(part[: out.shape[0]])
        return None

    @functools.wraps(reduce_scatter)
    def uneven_reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if all(t.shape == output.shape for t in input_list):
            return reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)
        whole = torch.cat(list(input_list))
        dist.all_reduce(whole, op=op, group=group)
        rank = dist.get_rank(group)
        start = sum(t.shape[0] for t in input_list[:rank])
        output.copy_(whole[start : start + output.shape[0]])
        return None

    dist.all_gather = uneven_all_gather
    dist.reduce_scatter = uneven_reduce_scatter


def apply(force: bool = False) -> bool:
    """Apply the CPU redirections once per process, when CUDA is unavailable.

    Args:
        force: apply even if CUDA is available (tests only).

    Returns:
        True if the patches are (now) active.
    """
    global _APPLIED
    if _APPLIED:
        return True
    if torch.cuda.is_available() and not force:
        return False
    check_version()

    # torch's device context managers (`with torch.device("meta"):`, used e.g. by transformers'
    # from_pretrained) recognise factories by identity in a set built once, lazily, from the
    # `torch.*` attributes. Built after the patch it would hold our wrappers, while the mode is
    # handed the builtins our wrappers call, so those factories would silently ignore the context
    # (transformers then loaded RoPE buffers as uninitialised memory). Build it from the builtins.
    from torch.utils import _device

    _device._device_constructors()
    for name in _FACTORIES:
        setattr(torch, name, _cpu_device_factory(getattr(torch, name)))
    # p2p_communication.py ~190-321, layers.py, mappings.py, distrib_optimizer.py ~791 etc. pass
    # torch.cuda.current_device() as a device, and rotary_pos_embedding.py ~162 moves inv_freq
    # `.to(device=torch.cuda.current_device())`: answer with the CPU device itself.
    torch.cuda.current_device = lambda: torch.device("cpu")
    # p2p_communication.py ~242/398 (batch_p2p_sync) and filesystem_async.py ~230.
    torch.cuda.synchronize = lambda device=None: None
    # language_module.py ~244 (tied embeddings with PP>1), distrib_optimizer.py ~1089,
    # optimizer.py ~375/380 (state reload): `.cuda()` on a CPU tensor means "stay on the CPU".
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.Tensor.type = _cpu_tensor_type(torch.Tensor.type)
    _patch_rng()
    _patch_streams()
    _patch_all_to_all()
    _patch_uneven_collectives()
    # megatron.core.jit.jit_fuser is torch.compile: ~17 s of C++ compilation per process on CPU
    # for a few fused elementwise ops. Run them eagerly.
    from torch import _dynamo

    _dynamo.config.disable = True
    # tensor_parallel/layers.py ~730/738 advises CUDA_DEVICE_MAX_CONNECTIONS=1 when it builds TP>1
    # linear layers (async grad all-reduce, sequence parallelism); it concerns CUDA streams and
    # means nothing here.
    warnings.filterwarnings(
        "ignore",
        message="When using (async grad allreduce|sequence parallelism) it is recommended to set "
        "the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
        category=UserWarning,
    )
    _APPLIED = True
    return True


def is_applied() -> bool:
    """Whether `apply()` has patched this process."""
    return _APPLIED
