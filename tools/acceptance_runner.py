"""What every acceptance check shares (`tools/acceptance_checks.py`): the context, launching an
entry script and reading its metrics, the checks' failure and skip exceptions."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
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
    deadline: float | None = None
    """`time.monotonic()` by which the running check must end (its budget), None: no budget."""


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
    timeout, why = ctx.timeout, f"timed out after --timeout {ctx.timeout:.0f} s"
    if ctx.deadline is not None and ctx.deadline - time.monotonic() < timeout:
        timeout, why = max(1.0, ctx.deadline - time.monotonic()), "ran over the check's budget"
    try:
        proc = subprocess.run(
            [*prefix, *map(str, args)], cwd=REPO, env=env, text=True, timeout=timeout,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        out = e.stdout or ""
        log.write_text(out.decode(errors="replace") if isinstance(out, bytes) else out)
        raise CheckFailed(f"{Path(args[0]).name}: {why} ({log})") from None
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


def worst_logp_difference(ctx: Context, hf_dir: Path, ours: list[float], max_length: int) -> float:
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


def two_ranks(ctx: Context, what: str) -> int:
    """2: the processes a multi-rank check runs (2 GPUs, or 2 gloo ranks on the CPU).

    Raises:
        Skip: on CUDA with fewer than 2 GPUs.
    """
    if ctx.cuda and ctx.gpus < 2:
        raise Skip(f"{what} needs 2 GPUs; this machine has {ctx.gpus}")
    return 2


def backend_overrides(ctx: Context) -> tuple[list[str], str]:
    """Overrides for Transformer Engine's layer spec when it imports (bf16), else the local spec
    with SDPA (bf16 on CUDA, fp32 on the CPU); and the words for it."""
    if ctx.transformer_engine:
        return ["model.attention_backend=te", "trainer.precision=bf16"], "TE spec"
    precision = "bf16" if ctx.cuda else "32"
    return ["model.attention_backend=sdpa", f"trainer.precision={precision}"], "local spec (SDPA)"
