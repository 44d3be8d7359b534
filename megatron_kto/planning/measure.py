"""Measure what the plan predicts: model-state bytes of real tensors (any device), and the
peak of live allocations during a step (CPU; on CUDA read `torch.cuda.max_memory_allocated`).

**Model state** (`model_state_bytes`) walks the objects the trainer built — the parameters of
every chunk, megatron DDP's gradient buffers, the optimizer's state and main parameters — and
adds up the bytes of their distinct storages (a view of a buffer counts once, as the buffer).

**Peak** (`AllocationTrace`) records every allocation and free of torch's CPU allocator with
`torch.profiler` (`profile_memory=True`: the allocator reports each one with its size), from
before the model is built; the running total of allocated − freed bytes is then the bytes of
live torch tensors at every moment, and its maximum inside a marked block (one training step)
is the step's peak. That is what the CUDA caching allocator's `max_memory_allocated()` reads on a
GPU: bytes of live tensors — not the allocator's cached-but-free blocks, not the CUDA context,
cuBLAS workspaces or NCCL's own buffers. On CPU there is no such counter, and RSS would count the
Python heap, freed-but-cached pages and shared libraries. Subtracting the tensors that live in
host memory on a GPU too (`host_bytes`: a `cpu_swap` reference's copies, the host batch) gives
the device peak:

    peak = max over the step of (all live tensor bytes) − host-resident tensor bytes.

What differs between the CPU run measured and a GPU run: kernels may allocate different scratch
tensors (e.g. CPU flash attention vs TE's); on CPU megatron keeps each pipeline stage's output
until its backward (`deallocate_pipeline_outputs` is CUDA-only); gloo's reduce-scatter and
all-gather stage full-size copies through torch's allocator (NCCL's do not), and after its
sequence-parallel collectives the running total holds a few MiB that no Python object does.
The plan models the second and third for CPU runs (`activations.ActivationInputs`
`keep_pipeline_outputs`, `gloo`); the last is why the tests leave sequence parallelism out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _distinct_bytes(tensors: Iterable[torch.Tensor], exclude: set[int]) -> tuple[int, set[int]]:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or not torch.is_tensor(t) or t.numel() == 0:
            continue
        ptr, nbytes = _storage(t)
        if ptr not in exclude:
            seen[ptr] = nbytes
    return sum(seen.values()), set(seen)


@dataclass(frozen=True)
class MeasuredState:
    """Bytes of real tensors, by what they hold (see `model_state.ModelState`)."""

    weights: int
    gradients: int
    optimizer: int
    reference: int = 0
    """A `separate` reference model's parameters."""

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.reference


def _torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    out = []
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(o, "optimizer", None)
        if inner is not None:
            out.append(inner)
    return out


def model_state_bytes(chunks: list[torch.nn.Module], optimizer, reference_chunks=None):
    """`MeasuredState` of the chunks (DDP-wrapped), their megatron optimizer and, optionally, a
    separate reference model's chunks."""
    params = [p for c in chunks for p in c.parameters()]
    weights, wptrs = _distinct_bytes(params, set())
    grads, gptrs = _distinct_bytes((getattr(p, "main_grad", None) for p in params), wptrs)
    state: list[torch.Tensor] = []
    for opt in _torch_optimizers(optimizer):
        for group in opt.param_groups:
            state.extend(group["params"])
        for entry in opt.state.values():
            state.extend(v for v in entry.values() if torch.is_tensor(v))
    optim, _ = _distinct_bytes(state, wptrs | gptrs)
    ref = 0
    if reference_chunks:
        ref, _ = _distinct_bytes((p for c in reference_chunks for p in c.parameters()), set())
    return MeasuredState(weights, grads, optim, ref)


def host_bytes(reference, batch: dict) -> int:
    """Bytes that live in host memory on a GPU too: a `cpu_swap` reference's copies (pinned
    there) and the host batch the data loader made."""
    from megatron_kto.models.reference import CPUSwapReference

    tensors = [v for v in batch.values() if torch.is_tensor(v)]
    if isinstance(reference, CPUSwapReference):
        tensors += [*reference._ref, *reference._backup]
    total, _ = _distinct_bytes(tensors, set())
    return total


WINDOW = "memplan::window"


class AllocationTrace:
    """Every allocation and free of torch's CPU allocator from `__enter__` on; `window()` marks
    a block whose peak is wanted (see the module docstring), once or several times.

    Tracing from before the model is built means the running total at a window's start is
    everything then alive (model state, megatron's persistent buffers, caches), not only what
    the caller knows to count. After `__exit__`: `windows` holds (running total at the start,
    its maximum inside) per window in order; `at_start` and `peak` are the first window's;
    `smallest_rise` is the least (maximum − start) over the windows.

    The profiler records the allocator's events only on threads it traces: a tensor allocated
    here but freed on another thread (gloo's worker drops a collective's staging copy there when
    it, not the caller, holds the last reference — a scheduling race, common under load) stays
    in the running total for good. Such drift shifts a window's start and maximum alike; a rise
    is only wrong when the lost free falls inside that window, which repeating the step twice
    and taking the smallest rise guards against.
    """

    def __init__(self) -> None:
        self.windows: list[tuple[int, int]] = []

    @property
    def at_start(self) -> int:
        return self.windows[0][0]

    @property
    def peak(self) -> int:
        return self.windows[0][1]

    @property
    def smallest_rise(self) -> int:
        return min(peak - start for start, peak in self.windows)

    def __enter__(self) -> AllocationTrace:
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def window(self):
        """Context manager marking a measured block."""
        return torch.profiler.record_function(WINDOW)

    def __exit__(self, *exc) -> None:
        self._prof.__exit__(*exc)
        events = self._prof.profiler.kineto_results.events()
        spans = sorted((e.start_ns(), e.end_ns()) for e in events if e.name() == WINDOW)
        if not spans:
            raise RuntimeError(f"no {WINDOW} block was traced")
        memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
        running = 0
        windows = [[None, 0] for _ in spans]
        for when, nbytes in memory:
            for w, (lo, _hi) in enumerate(spans):
                if when >= lo and windows[w][0] is None:
                    windows[w] = [running, running]
            running += nbytes
            for w, (lo, hi) in enumerate(spans):
                if lo <= when <= hi:
                    windows[w][1] = max(windows[w][1], running)
        for w in windows:
            if w[0] is None:  # no allocation at or after the window's start
                w[0] = w[1] = running
        self.windows = [(start, peak) for start, peak in windows]
