#!/usr/bin/env python
"""Benchmark KTO training steps: samples/s, tokens/s, MFU and peak memory, side by side with TRL.

    python tools/bench_kto.py [--preset longtail|longtail_moe|longtail_hybrid|example] [--warmup 5] [--steps 20]
        [--repeat 1] [--threads N] [--trl | --no-trl] [--lora RANK [--lora-targets all]]
        [--json OUT] [hydra overrides ...]

What runs by default (``--preset longtail``) is the compute-dominated case on realistic data:
a Llama-style model of 8 layers × hidden 512 (ffn 1536, 8 query / 4 KV heads, the bundled
tokenizer's vocabulary) on a KTO set with long-tailed lengths and 2:1 desirable:undesirable
labels (``tools/make_bench_data.py`` defaults, generated once, seeded, into the temporary
directory), global batch 16, micro-batch 4. ``--preset longtail_moe`` gives every layer a
mixture-of-experts MLP (8 experts of width 768, top-2, router load-balancing loss 0.01; TRL's
side is a ``MixtralForCausalLM`` of that shape). ``--preset longtail_hybrid`` trains a tiny Qwen3.5
(three gated DeltaNet layers and one gated attention layer, ``bench_presets.HYBRID_CONFIG``) that
both sides load from one Hugging Face directory. ``--preset example`` runs ``conf/gpt_kto.yaml``
as it is. Hydra overrides given on the command line come after the preset's and win.

Our side is the real training path (``megatron_kto.run.run_alignment`` on the composed config)
for ``warmup + steps`` optimizer steps; the per-step figures it writes to ``metrics.jsonl`` are
summarised (median, mean) over the timed steps. The bench adds overrides before yours: a
temporary log directory, no checkpoints / TensorBoard / validation, ``model.data.shuffle=false``
(both sides see the same batches); it always sets ``trainer.kto.max_steps`` and
``trainer.log_every_n_steps``.

The TRL side (``--trl``; by default whenever ``trl`` is importable and the bench runs as one
process) trains ``trl.KTOTrainer`` on a ``transformers`` ``LlamaForCausalLM`` of the same shape,
randomly initialised, on the same rows tokenised by the same tokenizer, with the same β, λ_D/λ_U,
schedule, Adam settings, clip, batch size (one micro-batch) and ``max_length``; each step is timed
from the end of the previous one, data loading included, as on our side (``tools/trl_baseline.py``).
With ``--objective cpo|simpo|orpo`` (a DPO-family run on the preset's rows as pairs) the TRL
side is TRL's experimental ``CPOTrainer`` / ``ORPOTrainer`` on the same model and pairs, in the
same micro-batches (``tools/bench_trl.py``); other objectives run our side only.

LoRA (``--lora RANK``, or the ``model.peft.*`` overrides themselves): our side trains adapters of
that rank on ``--lora-targets`` (default ``all``) with the adapters switched off as the reference;
the TRL side hands ``KTOTrainer`` the same base model and ``peft_config=LoraConfig(...)`` with the
same rank, alpha, dropout, Hugging Face projections and layers (``lora_spec``) and no
``ref_model``, so TRL's reference is that model with its adapters disabled. The report holds both
sides' settings and adapter parameter counts (ours from the config, TRL's read back from the
trainer), and TRL's batch size as the trainer holds it.

Both sides count work the same way: tokens are the unpadded input positions of the sample and
KL rows (length − 1 per row), and MFU counts reference forward (samples + KL) + policy forward
(KL) + policy forward+backward (samples), each row's attention at its own length
(``ModelFlops``), against one peak FLOP/s per device, whose source the header states
(``megatron_kto.logging.peak_flops``): ``trainer.peak_flops_per_device`` if given, else a known
GPU's datasheet figure, else the best of 5 timed runs of each of the model's own GEMM shapes
(rows of one micro-batch), so that MFU <= 1. TRL 1.x, like us, computes the KL rows' policy
log-probs without autograd: the ratio measures the implementations, not algorithmic work.

Each side runs in its own Python process so that peak memory (max RSS on CPU, libraries
included; peak allocated on CUDA) and thread pools are its own. On a shared machine pin
``--threads``, use ``--repeat`` (sides alternate; every run uses the first run's peak) and
compare medians.

Several ranks (our side only; rank 0 prints, and its peak memory is rank 0's):

    torchrun --nproc_per_node 2 tools/bench_kto.py --steps 20 model.global_batch_size=16
"""

from __future__ import annotations

# Only the standard library at module level: a child's max-RSS counter starts from its
# parent's (Linux keeps it across fork/exec), so the parent must stay small for the workers'
# peak-memory figures to be their own; hence the report code in tools/bench_report.py rather
# than megatron_kto.logging (which imports torch). The TRL side is tools/trl_baseline.py.
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_presets import BENCH_DEFAULTS, bench_defaults, preset_overrides  # noqa: F401
from bench_report import FIGURES, combine_runs, render_header, render_notes, render_table
from bench_spec import lora_spec, preference_spec, trl_spec  # noqa: F401
from bench_trl import TRL_PREFERENCE

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"


def _set_threads(threads: int | None) -> int:
    import torch

    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


# --- our side ----------------------------------------------------------------------------------
def _compose(config_name: str, overrides: list[str]) -> Any:
    # As the trainer composes it: the bundled example unless data or a checkpoint is given,
    # the architecture and tokenizer resolved.
    from megatron_kto.entry import compose_run_config

    algorithm = "dpo" if "dpo" in config_name else "kto"
    return compose_run_config(config_name, overrides, algorithm, config_dir=CONF_DIR).cfg


def _default_log_dir() -> str:
    """A fresh temporary run directory; under torchrun one name for all ranks of the job."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        job = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT", "0")
        return str(Path(tempfile.gettempdir()) / f"bench_kto_{job}")
    return tempfile.mkdtemp(prefix="bench_kto_")


def _mark_cpu_time_per_step() -> dict[int, float]:
    """Record this process's CPU time between consecutive train-step logs.

    The trainer logs wall time only. CPU time is the figure that other processes on a shared
    machine disturb least, so the bench wraps `MetricsLogger.log` (called once per step with
    ``log_every_n_steps=1``) for the life of this worker process. The span between two logs is
    step end to step end, as the TRL side's timer measures; the first step has none.
    """
    from megatron_kto.logging.metrics_logger import MetricsLogger

    marks: dict[int, float] = {}
    last: list[float] = []
    log = MetricsLogger.log

    def timed_log(self, split, step, *rest, **kwargs):
        if split == "train":
            now = time.process_time()
            if last:
                marks[step] = now - last[0]
            last[:] = [now]
        return log(self, split, step, *rest, **kwargs)

    MetricsLogger.log = timed_log  # type: ignore[method-assign]
    return marks


def lora_overrides(rank: int | None, targets: str) -> list[str]:
    """`--lora RANK --lora-targets T`'s overrides (before the user's own)."""
    if rank is None:
        return []
    return [
        "model.peft.peft_scheme=lora",
        f"model.peft.lora_tuning.adapter_dim={rank}",
        f"model.peft.lora_tuning.target_modules=[{targets}]",
    ]


def run_ours(args: argparse.Namespace) -> dict[str, Any] | None:
    """Run our trainer in this process; returns the run's figures on rank 0, None elsewhere."""
    threads = _set_threads(args.threads)
    import torch

    from megatron_kto.config.architecture import GPTArchitecture
    from megatron_kto.config.machine import canonical_precision
    from megatron_kto.logging.peak_flops import model_gemm_shapes, resolve_peak
    from megatron_kto.run import run_alignment
    from megatron_kto.runtime.precision import precision_dtype

    log_dir = args.log_dir or _default_log_dir()
    algorithm = "dpo" if args.objective else "kto"
    overrides = [
        *bench_defaults(algorithm),
        *preset_overrides(args.preset, algorithm),
        *lora_overrides(args.lora, args.lora_targets),
        f"exp_manager.explicit_log_dir={log_dir}",
        *([f"model.dpo.loss_type={args.objective}"] if args.objective else []),
        *args.overrides,
        f"trainer.{algorithm}.max_steps={args.warmup + args.steps}",
        "trainer.log_every_n_steps=1",
    ]
    cfg = _compose("gpt_dpo" if args.objective else args.config_name, overrides)
    spec = trl_spec(cfg) if algorithm == "kto" else preference_spec(cfg)
    # Decided here rather than inside the run so that both sides use one and the same peak.
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else "cpu"
    dtype = precision_dtype(canonical_precision(spec["precision"]))
    peak = resolve_peak(
        cfg.trainer.peak_flops_per_device, device, dtype,
        model_gemm_shapes(
            GPTArchitecture.from_dict(spec["architecture"]), spec["padded_vocab"],
            rows=spec["micro_batch_size"] * spec["max_length"],
            tensor_parallel=cfg.model.tensor_model_parallel_size,
        ),
    )  # fmt: skip
    cfg.trainer.peak_flops_per_device = peak.flops
    cpu_marks = _mark_cpu_time_per_step()
    run_alignment(cfg, algorithm)
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    rows = [json.loads(line) for line in (Path(log_dir) / "metrics.jsonl").open()]
    if not args.log_dir:  # a temporary run directory: nothing in it is needed any more
        shutil.rmtree(log_dir, ignore_errors=True)
    train = [r for r in rows if r["split"] == "train" and r["step"] > args.warmup]
    steps = [
        {
            "step": r["step"],
            **{k: r.get(k) for k in FIGURES},
            "tokens": round(r["tokens_per_sec"] * r["step_time"]),
            "cpu_time": cpu_marks.get(r["step"]),
            "loss": r.get("loss"),
        }
        for r in train
    ]
    return {
        "steps": steps,
        "peak_memory_gb": max(r["peak_memory_gb"] for r in train),
        "threads": threads,
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "peak_flops_per_device": peak.flops,
        "peak_flops_source": peak.source,
        "log_dir": args.log_dir,
        "spec": spec,
    }


# --- TRL side ----------------------------------------------------------------------------------
def run_trl(
    spec: dict[str, Any], peak_flops: float, warmup: int, steps: int, threads: int | None
) -> dict[str, Any]:
    """Time TRL's KTOTrainer (CPOTrainer / ORPOTrainer for an `--objective` run, `bench_trl`) on
    the run `spec` describes; per-step figures as on our side."""
    from bench_trl import run_trl_preference
    from trl_baseline import trl_figures

    threads = _set_threads(threads)
    if "dpo" in spec:  # --objective cpo|simpo|orpo: CPOTrainer / ORPOTrainer
        return {**run_trl_preference(spec, peak_flops, warmup, steps), "threads": threads}
    return {**trl_figures(spec, peak_flops, warmup, steps), "threads": threads}


# --- orchestration -----------------------------------------------------------------------------
def _worker(args: argparse.Namespace, argv: list[str], side: str, extra: list[str]) -> dict:
    """Run one side in a fresh Python process; returns its summary (exits on failure)."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        env = dict(os.environ)
        if args.threads:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)
        cmd = [sys.executable, __file__, *argv, "--worker", side, "--result", str(result), *extra]
        proc = subprocess.run(
            cmd, env=env, cwd=REPO, text=True, capture_output=not args.verbose
        )  # fmt: skip
        if proc.returncode != 0:
            if not args.verbose:
                sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
            print(f"error: the {side} side failed (exit code {proc.returncode})", file=sys.stderr)
            sys.exit(proc.returncode if proc.returncode > 0 else 1)
        return json.loads(result.read_text())


def _environment() -> dict[str, Any]:
    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "?"
    return {"cpu_count": os.cpu_count(), "load_average": load, "python": sys.version.split()[0]}


def _trl_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("trl") is not None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Hydra overrides (key=value) configure our side, e.g. model.global_batch_size=32.",
    )
    parser.add_argument(
        "--preset",
        choices=("longtail", "longtail_moe", "longtail_hybrid", "example"),
        default="longtail",
        help="longtail (default): 8x512 model on long-tailed data; longtail_moe: the same with "
        "8 experts, top-2 (TRL: Mixtral); longtail_hybrid: a tiny Qwen3.5 (gated DeltaNet) "
        "from one HF directory on both sides; example: conf as it is",
    )
    parser.add_argument(
        "--lora",
        type=int,
        default=None,
        metavar="RANK",
        help="LoRA of this rank on both sides (reference: the adapters switched off; TRL: "
        "KTOTrainer + peft with the same LoraConfig); same as the model.peft.* overrides",
    )
    parser.add_argument(
        "--lora-targets",
        default="all",
        help="with --lora: model.peft.lora_tuning.target_modules, comma-separated NeMo or "
        "Hugging Face names (default all)",
    )
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    parser.add_argument(
        "--trl",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run TRL's KTOTrainer (default: when trl is installed and not under torchrun)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run each side this many times, alternating, and pool the timed steps (default 1)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="intra-op threads per process (default: torch's)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the figures to this file")
    parser.add_argument(
        "--config-name", default="gpt_kto", help="config in conf/ (default gpt_kto)"
    )
    parser.add_argument(
        "--log-dir", default=None, help="keep our run's directory here (default: a temporary one)"
    )
    parser.add_argument(
        "--objective",
        help="a DPO-family model.dpo.loss_type (sigmoid, simpo, orpo, ...): train it on the "
        "preset's rows as pairs (8 pairs a step, 2 a micro-batch) from the DPO entry; TRL's "
        "CPOTrainer / ORPOTrainer mirror cpo, simpo and orpo (tools/bench_trl.py)",
    )
    parser.add_argument("--verbose", action="store_true", help="show the workers' output")
    parser.add_argument("--worker", choices=("ours", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="hydra overrides for our side")
    return parser


def _publish(report: dict[str, Any], json_path: Path | None) -> None:
    print(render_header(report))
    print()
    print(render_table(report))
    notes = render_notes(report)
    if notes:
        print(notes)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"figures written to {json_path}")


def _run_ours_reporting_user_errors(args: argparse.Namespace) -> dict[str, Any] | None:
    """`run_ours`, with a config or data mistake reported in one `error:` line (exit 2), as
    the entry scripts report it."""
    from hydra.errors import HydraException

    from megatron_kto.config.keys import composition_error_line
    from megatron_kto.data.errors import DataFormatError
    from megatron_kto.run import USER_ERRORS

    try:
        return run_ours(args)
    except HydraException as e:
        message = composition_error_line(e)
    except (*USER_ERRORS, DataFormatError) as e:
        message = str(e)
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def _run_worker(args: argparse.Namespace) -> int:
    if args.worker == "ours":
        result = _run_ours_reporting_user_errors(args)
    else:
        ours = json.loads(args.spec.read_text())
        try:
            result = run_trl(
                ours["spec"], ours["peak_flops_per_device"], args.warmup, args.steps, args.threads
            )
        except ValueError as e:  # a model or data the TRL baseline cannot mirror
            print(f"error: {e}; run with --no-trl", file=sys.stderr)
            return 2
    args.result.write_text(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    from megatron_kto.console import quiet_third_party

    quiet_third_party()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_intermixed_args(argv)
    if args.warmup < 0 or args.steps < 1 or args.repeat < 1:
        print("error: need --warmup >= 0, --steps >= 1 and --repeat >= 1", file=sys.stderr)
        return 2
    if args.worker:
        return _run_worker(args)

    report: dict[str, Any] = {
        "warmup": args.warmup,
        "steps": args.steps,
        "repeat": args.repeat,
        "preset": args.preset,
        "overrides": args.overrides,
        "environment": _environment(),
    }
    if "WORLD_SIZE" in os.environ:  # launched by torchrun: our side only, in this process
        if args.trl or args.repeat > 1:
            print("note: --trl and --repeat apply only without torchrun; ignored", file=sys.stderr)
        ours = _run_ours_reporting_user_errors(args)
        if ours is not None:
            report["ours"] = combine_runs([ours])
            _publish(report, args.json)
        return 0

    if args.objective not in (None, *TRL_PREFERENCE) and args.trl:
        print(f"error: --trl mirrors KTO and {', '.join(TRL_PREFERENCE)} runs only; leave it "
              f"out with --objective {args.objective}", file=sys.stderr)  # fmt: skip
        return 2
    mirrored = args.objective in (None, *TRL_PREFERENCE)
    want_trl = mirrored and (args.trl if args.trl is not None else _trl_available())
    runs: dict[str, list[dict[str, Any]]] = {"ours": [], "trl": []}
    for _ in range(args.repeat):  # alternate the sides so both meet the same load drift
        extra = []
        if runs["ours"]:  # one peak FLOP/s for every run: the first run's
            extra = [f"trainer.peak_flops_per_device={runs['ours'][0]['peak_flops_per_device']}"]
        ours = _worker(args, [*argv, *extra], "ours", [])
        runs["ours"].append(ours)
        if want_trl:
            with tempfile.TemporaryDirectory() as tmp:
                spec_path = Path(tmp) / "spec.json"
                spec_path.write_text(json.dumps(ours))
                runs["trl"].append(_worker(args, argv, "trl", ["--spec", str(spec_path)]))
    report["ours"] = combine_runs(runs["ours"])
    if runs["trl"]:
        report["trl"] = combine_runs(runs["trl"])
        ours, trl = report["ours"], report["trl"]
        # Speed-up of ours over TRL, from medians: rates ours/TRL, times TRL/ours.
        report["speedup_ours_over_trl"] = {
            k: (ours[k]["median"] / trl[k]["median"] if "per_sec" in k or k == "mfu" else
                trl[k]["median"] / ours[k]["median"])
            for k in FIGURES
            if ours[k]["median"] and trl[k]["median"]
        }  # fmt: skip
    _publish(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
