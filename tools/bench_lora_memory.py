#!/usr/bin/env python
"""LoRA vs full fine-tuning: peak live tensor bytes (what a GPU would hold) and the reference
pass's time, at `tools/bench_kto.py`'s preset.

    python tools/bench_lora_memory.py [--steps 2] [--rank 16] [--targets all] [--threads N]
        [--no-trace] [hydra overrides ...]

Runs the trainer (`run.run_alignment`) on `bench_kto.py`'s configuration (``--preset longtail``:
8 layers × hidden 512 on long-tailed data, global batch 16, micro-batch 4, fp32; the same bench
defaults) twice, each in its own process: full fine-tuning (reference `cpu_swap`, the default)
and LoRA (``model.peft.peft_scheme=lora``, rank ``--rank`` on ``--targets``, reference
`adapters_off`, the default under LoRA). Hydra overrides apply to both sides.

On CPU, max RSS is dominated by the libraries, so memory is measured as a GPU allocator's
``max_memory_allocated`` would report it: the running total of torch's allocations over the
whole run (`planning.measure.AllocationTrace`: model build, data, every step), at its maximum,
minus what is host memory on a GPU too (`cpu_swap`'s two weight copies, pinned there). Both
sides' figures include the same host-side data tensors (a few MiB; they make the ratio
conservative). The memory plan's model state (`planning.model_state`) is printed beside it, per
model parameter.

The reference pass's cost is the wall and process CPU time of the reference's `log_probs` calls
(samples + KL rows) per step, from a timer wrapped around them for this process only, next to
the step time of `metrics.jsonl` (CPU time is what other load on a shared machine disturbs
least). With the trace on, the profiler slows every op; ``--no-trace`` times without it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_kto

SIDES = ("full", "lora")


def _side_overrides(side: str, rank: int, targets: str) -> list[str]:
    if side == "full":
        return []
    return [
        "model.peft.peft_scheme=lora",
        f"model.peft.lora_tuning.adapter_dim={rank}",
        f"model.peft.lora_tuning.target_modules=[{targets}]",
    ]


def _timed_references(per_step: list[tuple[float, float]]) -> None:
    """Wrap every reference strategy's `log_probs` with a (wall, process CPU) timer (this
    process only)."""
    from megatron_kto.models import reference
    from megatron_kto.peft.reference import AdaptersOffReference

    classes = [AdaptersOffReference, reference.CPUSwapReference, reference.SeparateReference]
    for cls in classes:
        original = cls.log_probs

        def timed(self, batch, forward, _original=original):
            start, cpu = time.perf_counter(), time.process_time()
            out = _original(self, batch, forward)
            per_step.append((time.perf_counter() - start, time.process_time() - cpu))
            return out

        cls.log_probs = timed


def _held_references(held: list) -> None:
    """Keep each `CPUSwapReference` built, to count its host copies after the run."""
    from megatron_kto.models.reference import CPUSwapReference

    original = CPUSwapReference.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        held.append(self)

    CPUSwapReference.__init__ = init


def worker(args: argparse.Namespace) -> dict:
    """One side in this process: its traced run, timings and planned model state."""
    import torch

    from megatron_kto.entry import compose_run_config
    from megatron_kto.planning.measure import AllocationTrace, host_bytes
    from megatron_kto.planning.memory import run_inputs, worst_rank
    from megatron_kto.planning.model_state import model_state
    from megatron_kto.run import run_alignment

    if args.threads:
        torch.set_num_threads(args.threads)
    log_dir = tempfile.mkdtemp(prefix="bench_lora_memory_")
    overrides = [
        *bench_kto.BENCH_DEFAULTS,
        *bench_kto.preset_overrides("longtail"),
        f"exp_manager.explicit_log_dir={log_dir}",
        *_side_overrides(args.worker, args.rank, args.targets),
        *args.overrides,
        f"trainer.kto.max_steps={args.steps}",
        "trainer.log_every_n_steps=1",
    ]
    prepared = compose_run_config("gpt_kto", overrides, "kto", config_dir=bench_kto.CONF_DIR)
    cfg, arch = prepared.cfg, prepared.architecture
    reference_times: list[tuple[float, float]] = []
    swaps: list = []
    _timed_references(reference_times)
    _held_references(swaps)
    if args.trace:
        with AllocationTrace() as trace, trace.window():
            run_alignment(cfg, "kto")
        host = sum(host_bytes(r, {}) for r in swaps)
        peak = trace.peak - host
    else:
        run_alignment(cfg, "kto")
        peak = host = None
    rows = [json.loads(line) for line in (Path(log_dir) / "metrics.jsonl").open()]
    train = [r for r in rows if r["split"] == "train"]
    dims, x, strategy, lora = run_inputs(cfg, arch, 1, "cuda")
    state = model_state(arch, dims, lora=lora)
    total_params = model_state(arch, dims).parameters
    plan = worst_rank(arch, dims, x, strategy, lora=lora)
    calls = len(reference_times) // max(1, len(train))
    return {
        "side": args.worker,
        "reference": strategy,
        "peak_tensor_bytes": peak,
        "host_excluded_bytes": host,
        "step_times": [r["step_time"] for r in train],
        "samples_per_sec": [r.get("samples_per_sec") for r in train],
        "reference_seconds_per_step": [
            sum(w for w, _ in reference_times[i * calls : (i + 1) * calls])
            for i in range(len(train))
        ],
        "reference_cpu_seconds_per_step": [
            sum(c for _, c in reference_times[i * calls : (i + 1) * calls])
            for i in range(len(train))
        ],
        "parameters": total_params,
        "trainable": state.parameters - total_params if lora else total_params,
        "model_state_bytes": state.weights + state.gradients + state.optimizer,
        "planned_peak_longest_micro_batch": plan.peak,
    }


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def report(results: dict[str, dict], trace: bool) -> list[str]:
    """Markdown rows: one per side, then the LoRA/full ratios."""
    mib = 2**20
    lines = [
        "| side | reference | trainable / base params | model state (plan) MiB | bytes/param "
        "| peak tensor MiB | step s (median) | reference pass s/step, wall / CPU (median) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for side, r in results.items():
        # Steps after the first: the first carries one-time work (caches, optimizer state).
        steps = r["step_times"][1:] or r["step_times"]
        refs = r["reference_seconds_per_step"][1:] or r["reference_seconds_per_step"]
        cpu = r["reference_cpu_seconds_per_step"][1:] or r["reference_cpu_seconds_per_step"]
        peak = f"{r['peak_tensor_bytes'] / mib:.1f}" if trace else "-"
        lines.append(
            f"| {side} | {r['reference']} | {r['trainable']:,} / {r['parameters']:,} | "
            f"{r['model_state_bytes'] / mib:.1f} | "
            f"{r['model_state_bytes'] / r['parameters']:.2f} | {peak} | {_median(steps):.2f} | "
            f"{_median(refs):.2f} / {_median(cpu):.2f} |"
        )
    full, lora = results["full"], results["lora"]
    if trace:
        ratio = lora["peak_tensor_bytes"] / full["peak_tensor_bytes"]
        lines.append(f"LoRA / full peak tensor bytes: {ratio:.3f} (aim <= 0.5)")
    saved = (full["model_state_bytes"] - lora["model_state_bytes"]) / full["parameters"]
    lines.append(f"model state saved per model parameter: {saved:.2f} bytes")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("overrides", nargs="*", help="hydra overrides for both sides")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per side")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--targets", default="all", help="LoRA target modules (comma-separated)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--trace", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.result.write_text(json.dumps(worker(args)))
        return 0
    results = {}
    for side in SIDES:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            cmd = [sys.executable, __file__, *(argv or sys.argv[1:]), "--worker", side,
                   "--result", str(out)]  # fmt: skip
            proc = subprocess.run(cmd, cwd=bench_kto.REPO, text=True, capture_output=True)
            if proc.returncode != 0:
                sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
                print(f"error: the {side} side failed", file=sys.stderr)
                return 1
            results[side] = json.loads(out.read_text())
    print("\n".join(report(results, args.trace)))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
