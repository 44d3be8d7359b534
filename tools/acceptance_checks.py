#!/usr/bin/env python
"""The checks of `tools/gpu_acceptance.sh`: every user path, run as a user runs it.

    python tools/acceptance_checks.py [--cpu] [--checks a,b,...] [--work DIR] [--steps N]

Each check launches the real entry scripts and tools in subprocesses and prints one
`PASS` / `FAIL <why>` / `SKIP <reason>` line with the figures from the run's metrics.jsonl;
then a summary, and exit code 1 if any check failed. Without CUDA every check is `SKIP no CUDA`
unless `--cpu` is given: then the same checks run on the CPU with tiny settings (TE and TP=2
skipped), as CI exercises them. Every command's log is kept under `--work`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
KTO = REPO / "examples" / "train_gpt_kto.py"
TOOLS = REPO / "tools"
TOKENIZER = REPO / "examples" / "data" / "tokenizer" / "tiny_sp.model"
TRAIN = REPO / "examples" / "data" / "tiny_kto" / "train.jsonl"
VALIDATION = REPO / "examples" / "data" / "tiny_kto" / "validation.jsonl"


class CheckFailed(Exception):
    """A check's one-line reason for FAIL."""


class Skip(Exception):
    """A check's one-line reason for SKIP."""


@dataclass
class Context:
    """What the machine has and where the checks write."""

    work: Path
    cuda: bool
    gpus: int
    transformer_engine: bool
    steps: int
    timeout: float
    runs: dict[str, Path] = field(default_factory=dict)
    """Run directories of passed checks, for the checks that build on them."""


def launch(ctx: Context, name: str, args: list[str], nproc: int = 1) -> str:
    """Run a script from the repository root; its output goes to `<work>/<name>.log`.

    Returns:
        The output (stdout and stderr together).

    Raises:
        CheckFailed: non-zero exit or timeout, with the last error-looking line.
    """
    prefix = [sys.executable]
    if nproc > 1:
        prefix += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if not ctx.cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""  # --cpu on a GPU machine: the CPU path for real
    log = ctx.work / f"{name}.log"
    try:
        proc = subprocess.run(
            [*prefix, *map(str, args)], cwd=REPO, env=env, text=True, timeout=ctx.timeout,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        log.write_text(str(e.stdout or ""))
        raise CheckFailed(f"{Path(args[0]).name}: timed out ({log})") from None
    log.write_text(proc.stdout)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
        errors = [ln for ln in lines if "error" in ln.lower()] or lines or ["(no output)"]
        raise CheckFailed(f"exit {proc.returncode}: {errors[-1].strip()[:200]} ({log})")
    return proc.stdout


def read_metrics(run_dir: Path, split: str = "train") -> list[dict[str, Any]]:
    """The `split` rows of a run's metrics.jsonl, in file order."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise CheckFailed(f"{path}: not written")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("split") == split]


def figures(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Median tokens/s and MFU (when the run reported one) and the highest peak memory; the
    first row is left out of the medians when there are others (start-up, compilation)."""
    timed = rows[1:] or rows
    out: dict[str, float] = {}
    for key in ("tokens_per_sec", "mfu"):
        values = [r[key] for r in timed if r.get(key) is not None]
        if values:
            out[key] = statistics.median(values)
    memory = [r["peak_memory_gb"] for r in rows if r.get("peak_memory_gb") is not None]
    if memory:
        out["peak_memory_gb"] = max(memory)
    return out


def format_figures(values: dict[str, float]) -> str:
    parts = []
    if "tokens_per_sec" in values:
        parts.append(f"tokens/s {values['tokens_per_sec']:,.0f}")
    parts.append(f"MFU {values['mfu']:.1%}" if "mfu" in values else "MFU - (no known peak)")
    if "peak_memory_gb" in values:
        parts.append(f"peak memory {values['peak_memory_gb']:.2f} GiB")
    return ", ".join(parts)


def check_trained(rows: list[dict[str, Any]], last_step: int) -> None:
    """A run trained to `last_step` with finite losses, each step logged once, in order."""
    steps = [r["step"] for r in rows]
    if not steps or steps[-1] != last_step:
        raise CheckFailed(f"metrics end at step {steps[-1] if steps else None}, not {last_step}")
    if steps != sorted(set(steps)):
        raise CheckFailed(f"steps logged out of order or twice: {steps}")
    bad = [r["step"] for r in rows if not math.isfinite(r.get("loss", math.nan))]
    if bad:
        raise CheckFailed(f"non-finite loss at steps {bad}")


def check_resumed(output: str, rows: list[dict[str, Any]], first: int, total: int) -> None:
    """The rerun resumed from step `first` (it said so), trained on to `total`, and the steps
    after the checkpoint continue its sample count."""
    if f"resumed from step {first}" not in output:
        raise CheckFailed(f"the rerun did not report 'resumed from step {first}'")
    check_trained(rows, total)
    by_step = {r["step"]: r for r in rows}
    if first not in by_step or first + 1 not in by_step:
        raise CheckFailed(f"steps {first} and {first + 1} must both be logged")
    per_step = by_step[first]["consumed_samples"] / first
    if by_step[first + 1]["consumed_samples"] != round(per_step * (first + 1)):
        raise CheckFailed("consumed_samples restarted instead of continuing from the checkpoint")


def train(ctx: Context, name: str, overrides: list[str], nproc: int = 1, saves: int = 1) -> str:
    """A bundled-example KTO run of `ctx.steps` steps with `saves` checkpoints, the last at its
    end; returns its figures line."""
    run_dir = ctx.work / name
    args = [
        KTO,
        f"exp_manager.explicit_log_dir={run_dir}",
        f"trainer.kto.max_steps={ctx.steps}",
        f"trainer.kto.save_interval={max(1, ctx.steps // saves)}",
        f"trainer.kto.val_check_interval={ctx.steps}",
        *overrides,
    ]
    launch(ctx, name, args, nproc)
    check_trained(read_metrics(run_dir), ctx.steps)
    ctx.runs[name] = run_dir
    return format_figures(figures(read_metrics(run_dir)))


# --- the checks: each returns its figures line (or "") and raises CheckFailed / Skip ----------
def quickstart(ctx: Context) -> str:
    return train(ctx, "quickstart", ["trainer.precision=32"], saves=2)


def bf16_packing(ctx: Context) -> str:
    tp = 2 if ctx.gpus >= 2 else 1
    overrides = ["trainer.precision=bf16", "model.data.pack_sequences=true"]
    overrides.append(f"model.tensor_model_parallel_size={tp}")
    return f"TP={tp}: " + train(ctx, "bf16_packing", overrides, nproc=tp)


def attention_sdpa(ctx: Context) -> str:
    # bf16 where it is fast (CUDA); fp32 on the CPU, where bf16 is ~10x slower.
    overrides = ["model.attention_backend=sdpa", f"trainer.precision={'bf16' if ctx.cuda else 32}"]
    return train(ctx, "attention_sdpa", overrides)


def attention_te(ctx: Context) -> str:
    if not ctx.transformer_engine:
        raise Skip("transformer_engine does not import" if ctx.cuda else "TE needs CUDA")
    return train(ctx, "attention_te", ["model.attention_backend=te", "trainer.precision=bf16"])


def te_local_checkpoint(ctx: Context) -> str:
    """A TE-spec run's checkpoint resumes in the local spec (SDPA) and the other way round."""
    if not ctx.transformer_engine:
        raise Skip("needs Transformer Engine on CUDA")
    if "attention_te" not in ctx.runs or "attention_sdpa" not in ctx.runs:
        raise Skip("needs the attention_te and attention_sdpa runs to have passed")
    total = 2 * ctx.steps
    for source, backend in (("attention_te", "sdpa"), ("attention_sdpa", "te")):
        run_dir = ctx.runs[source]
        output = launch(ctx, f"{source}_resumed_{backend}", [
            KTO, f"exp_manager.explicit_log_dir={run_dir}", f"trainer.kto.max_steps={total}",
            f"trainer.kto.save_interval={ctx.steps}", f"trainer.kto.val_check_interval={total}",
            f"model.attention_backend={backend}", "trainer.precision=bf16",
        ])  # fmt: skip
        check_resumed(output, read_metrics(run_dir), ctx.steps, total)
    return "TE -> local and local -> TE resumes continued"


def conversion(ctx: Context) -> str:
    """HF Llama -> import -> KTO steps -> export -> transformers; the exported model's
    completion log-probs equal our engine's on the trained checkpoint (the eval tool's)."""
    if importlib.util.find_spec("transformers") is None:
        raise Skip("transformers is not installed")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from megatron_kto.data.tokenizers import load_tokenizer

    hf_logging.disable_progress_bar()
    root, max_length = ctx.work / "conversion", 64
    tok = load_tokenizer("sentencepiece", str(TOKENIZER))
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=tok.vocab_size, max_position_embeddings=128,
        initializer_range=0.1,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(root / "hf")
    convert = TOOLS / "convert_checkpoint.py"
    launch(ctx, "conversion_import", [convert, "import", "--hf-dir", root / "hf",
                                      "--out", root / "mcore"])  # fmt: skip
    run_dir = root / "run"
    launch(ctx, "conversion_train", [
        KTO, f"pretrained_checkpoint.restore_from_path={root / 'mcore'}",
        f"model.data.data_prefix.train=[{TRAIN}]", "model.data.data_prefix.validation=[]",
        "model.tokenizer.library=sentencepiece", f"model.tokenizer.model={TOKENIZER}",
        "trainer.precision=32", f"exp_manager.explicit_log_dir={run_dir}",
        "trainer.kto.max_steps=2", "model.global_batch_size=8", "model.micro_batch_size=2",
        f"model.data.max_length={max_length}",
    ])  # fmt: skip
    launch(ctx, "conversion_export", [convert, "export", "--ckpt", run_dir,
                                      "--out", root / "export"])  # fmt: skip
    per_example = root / "eval.jsonl"
    launch(ctx, "conversion_eval", [
        TOOLS / "eval_kto_rewards.py", "--policy", run_dir / "checkpoints", "--data", VALIDATION,
        "--max-length", max_length, "--per-example", per_example, "--no-cache",
    ])  # fmt: skip
    ours = [json.loads(line)["policy_logps"] for line in per_example.read_text().splitlines()]
    worst = _worst_logp_difference(ctx, root / "export", ours, max_length)
    tolerance = 1e-3 if ctx.cuda else 1e-4
    if not ours or worst > tolerance:
        raise CheckFailed(f"exported model's log-probs differ from ours: rel {worst:.2e}")
    ctx.runs["conversion"] = run_dir
    return f"{len(ours)} examples, largest relative log-prob difference {worst:.1e}"


def _worst_logp_difference(ctx: Context, hf_dir: Path, ours: list[float], max_length: int) -> float:
    """Largest relative difference between `ours` (the eval tool's per-example policy log-probs
    on the validation set) and the completion log-probs `transformers` computes in fp32 with
    the model in `hf_dir`."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_kto.data.dataset import build_kto_dataset
    from megatron_kto.data.tokenizers import load_tokenizer

    tok = load_tokenizer("sentencepiece", str(TOKENIZER))
    device = "cuda" if ctx.cuda else "cpu"
    model = AutoModelForCausalLM.from_pretrained(hf_dir).float().to(device).eval()
    dataset, _ = build_kto_dataset([str(VALIDATION)], tok, max_length, use_cache=False)
    worst = 0.0
    with torch.no_grad():
        for i, expected in enumerate(ours):
            prompt, completion = list(dataset[i]["prompt_ids"]), list(dataset[i]["completion_ids"])
            tokens = torch.tensor([prompt + completion], device=device)
            logp = torch.log_softmax(model(tokens).logits[0, :-1].double(), dim=-1)
            got = logp.gather(-1, tokens[0, 1:, None])[len(prompt) - 1 :].sum().item()
            worst = max(worst, abs(got - expected) / max(abs(expected), 1e-6))
    return worst


def moe(ctx: Context) -> str:
    """A tiny Qwen3-MoE trained straight from its Hugging Face directory (bf16 on CUDA: TE's
    grouped experts when TE imports, else megatron's local experts; EP=2 when 2 GPUs exist),
    writing hf/; the eval tool then loads the checkpoint in the local spec in fp32 (SequentialMLP
    experts: a TE-grouped checkpoint crosses layouts) and its log-probs equal `transformers`' on
    the written hf/."""
    if importlib.util.find_spec("transformers") is None:
        raise Skip("transformers is not installed")
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.utils import logging as hf_logging

    from megatron_kto.data.tokenizers import load_tokenizer

    hf_logging.disable_progress_bar()
    root, max_length = ctx.work / "moe", 64
    ep = 2 if ctx.gpus >= 2 else 1
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
        num_experts_per_tok=2, vocab_size=load_tokenizer("sentencepiece", str(TOKENIZER)).vocab_size,
        max_position_embeddings=128, initializer_range=0.1, router_aux_loss_coef=0.01,
    )  # fmt: skip
    Qwen3MoeForCausalLM(config).save_pretrained(root / "hf")
    run_dir = root / "run"
    launch(ctx, "moe_train", [
        KTO, f"pretrained_checkpoint.restore_from_path={root / 'hf'}",
        f"model.data.data_prefix.train=[{TRAIN}]", "model.data.data_prefix.validation=[]",
        "model.tokenizer.library=sentencepiece", f"model.tokenizer.model={TOKENIZER}",
        f"trainer.precision={'bf16' if ctx.cuda else 32}", f"exp_manager.explicit_log_dir={run_dir}",
        f"trainer.kto.max_steps={ctx.steps}", "model.global_batch_size=8",
        "model.micro_batch_size=2", f"model.data.max_length={max_length}",
        f"model.expert_model_parallel_size={ep}", "exp_manager.save_hf=true",
    ], nproc=ep)  # fmt: skip
    rows = read_metrics(run_dir)
    check_trained(rows, ctx.steps)
    if not all(math.isfinite(r.get("aux_loss", math.nan)) for r in rows):
        raise CheckFailed("aux_loss not logged (finite) at every step")
    per_example = root / "eval.jsonl"
    launch(ctx, "moe_eval", [
        TOOLS / "eval_kto_rewards.py", "--policy", run_dir / "checkpoints", "--data", VALIDATION,
        "--max-length", max_length, "--per-example", per_example, "--no-cache",
        "--precision", "32", "--attention-backend", "sdpa",
    ])  # fmt: skip
    ours = [json.loads(line)["policy_logps"] for line in per_example.read_text().splitlines()]
    worst = _worst_logp_difference(ctx, run_dir / "hf", ours, max_length)
    tolerance = 1e-3 if ctx.cuda else 1e-4
    if not ours or worst > tolerance:
        raise CheckFailed(f"hf/ log-probs differ from the eval tool's: rel {worst:.2e}")
    experts = "TE grouped" if ctx.transformer_engine else "local"
    return (
        f"EP={ep}, {experts} experts; {format_figures(figures(rows))}; eval (local spec, fp32) "
        f"= transformers on hf/ to {worst:.1e}"
    )


def eval_tool(ctx: Context) -> str:
    """The eval tool on the run trained from a pretrained checkpoint (its reference), else on
    the quick start's last checkpoint against its first (a run from scratch has no reference)."""
    if "conversion" in ctx.runs:
        policy, reference = ctx.runs["conversion"] / "checkpoints", []
        label = "conversion run vs the imported model"
    elif "quickstart" in ctx.runs:
        policy, first = ctx.runs["quickstart"] / "checkpoints", f"step_{max(1, ctx.steps // 2)}"
        reference, label = ["--reference", policy / first], f"quickstart vs its {first}"
    else:
        raise Skip("needs the conversion or the quickstart run to have passed")
    variants = [("eval", [])]
    if "--precision" in launch(ctx, "eval_help", [TOOLS / "eval_kto_rewards.py", "--help"]):
        variants.append(("eval_bf16", ["--precision", "bf16"]))
    results = [label]
    for name, extra in variants:
        out = ctx.work / f"{name}.json"
        launch(ctx, name, [TOOLS / "eval_kto_rewards.py", "--policy", policy, *reference,
                           "--data", VALIDATION, "--json", out, "--no-cache", *extra])  # fmt: skip
        auc = json.loads(out.read_text()).get("auc")
        results.append(f"{name}: AUC {auc:.3f}" if isinstance(auc, float) else name)
    if len(variants) == 1:
        results.append("this eval tool has no --precision")
    return "; ".join(results)


def resume(ctx: Context) -> str:
    if "quickstart" not in ctx.runs:
        raise Skip("needs the quickstart run to have passed")
    run_dir, total = ctx.runs["quickstart"], 2 * ctx.steps
    output = launch(ctx, "resume", [
        KTO, "trainer.precision=32", f"exp_manager.explicit_log_dir={run_dir}",
        f"trainer.kto.max_steps={total}", f"trainer.kto.save_interval={ctx.steps}",
        f"trainer.kto.val_check_interval={total}",
    ])  # fmt: skip
    check_resumed(output, read_metrics(run_dir), ctx.steps, total)
    return f"resumed at step {ctx.steps}, continued to {total}"


def bench_trl(ctx: Context) -> str:
    if importlib.util.find_spec("trl") is None:
        raise Skip("trl is not installed")
    out = ctx.work / "bench.json"
    launch(ctx, "bench_trl", [TOOLS / "bench_kto.py", "--preset", "example", "--warmup", "2",
                              "--steps", str(ctx.steps), "--trl", "--json", out])  # fmt: skip
    report = json.loads(out.read_text())
    parts = [f"{side} tokens/s {report[side]['tokens_per_sec']['median']:,.0f} "
             f"MFU {report[side]['mfu']['median']:.1%}" for side in ("ours", "trl")]  # fmt: skip
    speedup = report.get("speedup_ours_over_trl", {}).get("tokens_per_sec")
    peak = report["ours"].get("peak_flops_source", "?")
    return "; ".join(parts) + (f"; ours/TRL {speedup:.2f}x" if speedup else "") + f"; peak {peak}"


CHECKS: dict[str, Callable[[Context], str]] = {
    "quickstart": quickstart,
    "bf16_packing": bf16_packing,
    "attention_sdpa": attention_sdpa,
    "attention_te": attention_te,
    "te_local_checkpoint": te_local_checkpoint,
    "conversion": conversion,
    "moe": moe,
    "eval": eval_tool,
    "resume": resume,
    "bench_trl": bench_trl,
}


def run_checks(ctx: Context, names: list[str], gpu_required: bool) -> list[tuple[str, str, str]]:
    """Run the named checks in order; prints and returns (name, status, detail) per check."""
    results = []
    for name in names:
        start = time.perf_counter()
        try:
            if gpu_required:
                raise Skip("no CUDA (use --cpu to run the checks on the CPU)")
            status, detail = "PASS", CHECKS[name](ctx)
        except Skip as e:
            status, detail = "SKIP", str(e)
        except CheckFailed as e:
            status, detail = "FAIL", str(e)
        except Exception as e:  # a bug in a check or an import: report it, run the others
            status, detail = "FAIL", f"{type(e).__name__}: {e}"
        took = f" ({time.perf_counter() - start:.0f} s)" if status != "SKIP" else ""
        print(f"{status} {name}{took}" + (f": {detail}" if detail else ""), flush=True)
        results.append((name, status, detail))
    return results


def summary_exit_code(results: list[tuple[str, str, str]]) -> int:
    """Print the summary line; 1 if any check failed, else 0."""
    counts = {
        s: sum(1 for _, status, _ in results if status == s) for s in ("PASS", "FAIL", "SKIP")
    }
    print("summary: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return 1 if counts["FAIL"] else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run on the CPU with tiny settings")
    parser.add_argument("--checks", default=",".join(CHECKS), help="comma-separated subset")
    parser.add_argument("--work", type=Path, help="logs and runs (default: a temporary dir)")
    parser.add_argument("--steps", type=int, help="steps per run (default 20 GPU, 2 CPU)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per command")
    args = parser.parse_args(argv)
    names = [n for n in args.checks.split(",") if n]
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        print(f"error: --checks: unknown {unknown}; known: {list(CHECKS)}", file=sys.stderr)
        return 2
    import torch

    cuda = torch.cuda.is_available() and not args.cpu
    te = cuda and subprocess.run(
        [sys.executable, "-c", "import transformer_engine.pytorch"], capture_output=True
    ).returncode == 0  # fmt: skip
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu_acceptance_"))
    work.mkdir(parents=True, exist_ok=True)
    ctx = Context(work, cuda, torch.cuda.device_count() if cuda else 0, te,
                  args.steps or (20 if cuda else 2), args.timeout)  # fmt: skip
    where = f"{ctx.gpus} GPU(s) ({torch.cuda.get_device_name(0)})" if cuda else "CPU"
    print(f"acceptance checks on {where}; TE {'yes' if te else 'no'}; logs in {work}")
    gpu_required = not cuda and not args.cpu
    return summary_exit_code(run_checks(ctx, names, gpu_required))


if __name__ == "__main__":
    sys.exit(main())
