#!/usr/bin/env python
"""Where a KTO step's time goes: our training run under the PyTorch profiler, by phase and by op.

    python tools/profile_kto.py [--preset longtail|example] [--steps 2] [--threads N]
        [--rows 25] [--trace OUT.json] [hydra overrides ...]

Runs the same configuration as `tools/bench_kto.py` (same preset, the same bench defaults: no
checkpoints, no validation, unshuffled data) for ``--steps`` optimizer steps in this process,
with `torch.profiler` recording host (CPU) activity — and CUDA kernels when a GPU is present.
The phases of a step are marked with `record_function` ranges around the library's own entry
points, so the report splits the step's time into

* ``kto/reference``: the reference pass over samples + KL rows (``cpu_swap``: the weight swaps
  are inside it, as ``kto/swap``),
* ``kto/kl_policy``: the policy's forward-only pass over the KL rows (z₀),
* ``kto/train``: the forward+backward schedule over the samples,
* ``kto/train_step``: ``kto/train`` plus megatron-core's optimizer step and the step's
  bookkeeping (the difference is the optimizer's share),

and prints the ops with the largest self time (``--rows``). Start-up (model build, data cache)
is profiled too but is outside the phases. ``--trace`` writes a Chrome trace.

The marks wrap methods on their classes for this process only: this is a measuring tool, and
the library carries no profiler code.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_kto  # noqa: E402  (the bench's composition: same preset and defaults)

#: (module, class, method, phase name).
PHASES = [
    ("megatron_kto.models.kto_model", "MegatronGPTKTOModel", "get_ref_policy_logprobs", "kto/reference"),
    ("megatron_kto.models.reference", "CPUSwapReference", "swapped", "kto/swap"),
    ("megatron_kto.models.kto_model", "MegatronGPTKTOModel", "kl_reference_point", "kto/kl_policy"),
    ("megatron_kto.models.kto_model", "MegatronGPTKTOModel", "get_loss_and_metric_sums", "kto/train"),
    ("megatron_kto.algorithms.dpo", "DPOTrainer", "train_single_step", "kto/train_step"),
]  # fmt: skip


def _mark(module: str, cls: str, method: str, name: str) -> None:
    """Wrap `cls.method` in a profiler range (a context manager method stays one)."""
    import importlib

    import torch

    owner = getattr(importlib.import_module(module), cls)
    original = getattr(owner, method)
    if name == "kto/swap":  # `swapped` is a context manager: time what it does on entry and exit

        @contextlib.contextmanager
        def wrapped(self, *args, **kwargs):
            with torch.profiler.record_function(f"{name}/in"):
                cm = original(self, *args, **kwargs)
                value = cm.__enter__()
            try:
                yield value
            finally:
                with torch.profiler.record_function(f"{name}/out"):
                    cm.__exit__(*sys.exc_info())

    else:

        @functools.wraps(original)
        def wrapped(self, *args, **kwargs):
            with torch.profiler.record_function(name):
                return original(self, *args, **kwargs)

    setattr(owner, method, wrapped)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=("longtail", "example"), default="longtail")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps (default 2)")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads")
    parser.add_argument("--rows", type=int, default=25, help="ops to list (default 25)")
    parser.add_argument("--trace", type=Path, default=None, help="write a Chrome trace here")
    parser.add_argument("overrides", nargs="*", help="hydra overrides")
    args = parser.parse_args(argv)

    import torch

    from megatron_kto.run import run_alignment

    if args.threads:
        torch.set_num_threads(args.threads)
    log_dir = bench_kto._default_log_dir()
    cfg = bench_kto._compose(
        "gpt_kto",
        [
            *bench_kto.BENCH_DEFAULTS,
            *bench_kto.preset_overrides(args.preset),
            f"exp_manager.explicit_log_dir={log_dir}",
            *args.overrides,
            f"trainer.kto.max_steps={args.steps}",
            "trainer.log_every_n_steps=1",
        ],
    )
    for phase in PHASES:
        _mark(*phase)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        run_alignment(cfg, "kto")
    events = prof.key_averages()
    by_name = {e.key: e for e in events}
    print(f"\nphases over {args.steps} steps (host wall time inside each range):")
    for *_, name in PHASES:
        keys = [name] if name != "kto/swap" else [f"{name}/in", f"{name}/out"]
        total = sum(by_name[k].cpu_time_total for k in keys if k in by_name) / 1e6
        calls = sum(by_name[k].count for k in keys if k in by_name)
        print(f"  {name:<15} {total:9.2f} s  ({calls} calls)")
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(events.table(sort_by=sort, row_limit=args.rows))
    if args.trace:
        prof.export_chrome_trace(str(args.trace))
    return 0


if __name__ == "__main__":
    sys.exit(main())
