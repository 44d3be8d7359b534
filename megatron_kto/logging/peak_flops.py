"""The peak FLOP/s an MFU figure is divided by, and where it came from.

MFU only means something against a peak the run cannot exceed. Three sources qualify, in this
order of preference:

* **stated**: `trainer.peak_flops_per_device` (the user's datasheet figure, or a cluster's);
* **datasheet**: a known GPU's dense peak for the run's dtype (`throughput.datasheet_peak_flops`);
* **measured**: the best rate of the model's *own* matrix multiplications — the linear layers'
  shapes at the rows of one micro-batch, in the run's dtype — each timed `trials` times after a
  warm-up, the fastest trial of the fastest shape kept. Every model GEMM of a step runs at one of
  these shapes, so (up to timing noise) it cannot run faster than this; attention scores and
  elementwise work run below GEMM speed. MFU against it is thus ≤ 1 by construction, unlike
  against a one-off square matmul, which can be slower than the model's own shapes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_kto.logging.throughput import _synchronize, peak_flops_per_device

#: Fewest timed trials per shape: one trial is a sample, not a best case.
MIN_TRIALS = 5


@dataclass(frozen=True)
class GemmShape:
    """One matrix multiplication: [rows × inner] @ [inner × cols]."""

    name: str
    rows: int
    inner: int
    cols: int

    @property
    def flops(self) -> int:
        """2 FLOPs per multiply-add."""
        return 2 * self.rows * self.inner * self.cols


@dataclass(frozen=True)
class PeakFlops:
    """A peak FLOP/s of one device and a one-line statement of its source."""

    flops: float
    source: str


def model_gemm_shapes(
    arch: Any, padded_vocab: int, rows: int, tensor_parallel: int = 1
) -> list[GemmShape]:
    """The linear layers' GEMMs of a `GPTArchitecture` on one rank, for `rows` tokens.

    Per layer: QKV projection h → (n + 2g)·d, output projection n·d → h, MLP h → f (2f for
    SwiGLU's fused gate and up projections) and f → h; once: the output layer h → V. Column-
    parallel layers split their output columns over `tensor_parallel` ranks, row-parallel ones
    their inner dimension (megatron-core's TP layout). Shapes that coincide are listed once.
    """
    heads = arch.num_attention_heads
    d = arch.kv_channels or arch.hidden_size // heads
    g = arch.num_query_groups or heads
    h, f, tp = arch.hidden_size, arch.ffn_hidden_size, tensor_parallel
    up = 2 * f if arch.activation in ("swiglu", "geglu", "quick_geglu") else f
    shapes = [
        GemmShape("linear_qkv", rows, h, (heads + 2 * g) * d // tp),
        GemmShape("linear_proj", rows, heads * d // tp, h),
        GemmShape("linear_fc1", rows, h, up // tp),
        GemmShape("linear_fc2", rows, f // tp, h),
        GemmShape("output_layer", rows, h, padded_vocab // tp),
    ]
    unique: dict[tuple[int, int, int], GemmShape] = {}
    for s in shapes:
        unique.setdefault((s.rows, s.inner, s.cols), s)
    return list(unique.values())


def best_of_trials(
    run_once: Callable[[], None],
    trials: int,
    warmup: int,
    clock: Callable[[], float] = time.perf_counter,
    sync: Callable[[], None] = lambda: None,
) -> float:
    """The shortest of `trials` timed calls of `run_once`, after `warmup` untimed ones (seconds).

    Raises:
        ValueError: fewer than `MIN_TRIALS` trials.
    """
    if trials < MIN_TRIALS:
        raise ValueError(f"need at least {MIN_TRIALS} timed trials, got {trials}")
    for _ in range(warmup):
        run_once()
    best = float("inf")
    for _ in range(trials):
        sync()
        start = clock()
        run_once()
        sync()
        best = min(best, clock() - start)
    return max(best, 1e-12)


def measure_gemm_peak(
    device: torch.device | str,
    dtype: torch.dtype,
    shapes: list[GemmShape],
    trials: int = MIN_TRIALS,
    warmup: int = 2,
) -> tuple[float, GemmShape]:
    """Best FLOP/s over `shapes` (each the best of `trials`) and the shape that reached it."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(0)
    best_rate, best_shape = 0.0, shapes[0]
    for shape in shapes:
        a = torch.randn(shape.rows, shape.inner, device=device, dtype=dtype, generator=gen)
        b = torch.randn(shape.inner, shape.cols, device=device, dtype=dtype, generator=gen)
        out = torch.empty(shape.rows, shape.cols, device=device, dtype=dtype)
        seconds = best_of_trials(
            lambda a=a, b=b, out=out: torch.matmul(a, b, out=out),
            trials,
            warmup,
            sync=lambda: _synchronize(device),
        )
        rate = shape.flops / seconds
        if rate > best_rate:
            best_rate, best_shape = rate, shape
    return best_rate, best_shape


def resolve_peak(
    stated: float | None,
    device: torch.device | str,
    dtype: torch.dtype,
    shapes: list[GemmShape],
    trials: int = MIN_TRIALS,
) -> PeakFlops:
    """The peak to report MFU against: stated, else datasheet, else measured at `shapes`."""
    dtype_name = str(dtype).removeprefix("torch.")
    if stated:
        return PeakFlops(float(stated), "stated (trainer.peak_flops_per_device)")
    datasheet = peak_flops_per_device(device, dtype)
    if datasheet:
        name = torch.cuda.get_device_name(torch.device(device))
        return PeakFlops(datasheet, f"datasheet ({name}, {dtype_name})")
    rate, shape = measure_gemm_peak(device, dtype, shapes, trials)
    return PeakFlops(
        rate,
        f"measured: best of {trials} trials over the model's {len(shapes)} GEMM shapes "
        f"({dtype_name}), reached by {shape.name} {shape.rows}x{shape.inner}x{shape.cols}",
    )
