#!/usr/bin/env python
"""The checks of `tools/gpu_acceptance.sh`: every user path, run as a user runs it.

    python tools/acceptance_checks.py [--cpu] [--checks a,b,...] [--work DIR] [--steps N]

Each check launches the real entry scripts and tools in subprocesses and prints one
`PASS` / `FAIL <why>` / `SKIP <reason>` line with its wall time and the figures from the run's
metrics.jsonl; then a summary with the total time, and exit code 1 if any check failed. Without
CUDA every check is `SKIP no CUDA` unless `--cpu` is given: then the same checks run on the CPU
with tiny settings (TE and TP=2 skipped; the 2-rank checks — distributed optimizer at DP=2,
MoE at PP=2, CP=2, PP=2 — over gloo), as CI exercises them. On one GPU the checks that need two
print `SKIP ... needs 2 GPUs`. Every command's log is kept under `--work`.

On CUDA each check has a time budget (`BUDGETS`, GPU seconds at the default 20 steps, from
measured H200 figures): the one-GPU checks without TE sum to 555 s, so the script ends within
10 minutes on one GPU whatever hangs; TE's two checks add 125 s, the four 2-GPU checks 240 s.
A check that uses up its budget is stopped and FAILs.
`--budget-scale` stretches the budgets (0: none).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from acceptance_moe import moe, moe_pp
from acceptance_runner import (
    KTO,
    REPO,
    TOKENIZER,
    TOOLS,
    TRAIN,
    VALIDATION,
    CheckFailed,
    Context,
    Skip,
    backend_overrides,
    check_resumed,
    figures,
    format_figures,
    launch,
    read_metrics,
    train,
    two_ranks,
    worst_logp_difference,
)  # fmt: skip

# The checks' shared pieces (Context, launch, CheckFailed, ...) are this module's too.
__all__ = ["BUDGETS", "CHECKS", "CheckFailed", "Context", "Skip", "check_resumed", "figures",
           "format_figures", "launch", "main", "read_metrics", "run_checks", "summary_exit_code",
           "train"]  # fmt: skip


# --- the checks: each returns its figures line (or "") and raises CheckFailed / Skip ----------
def quickstart(ctx: Context) -> str:
    return train(ctx, "quickstart", ["trainer.precision=32"], saves=2)


def bf16_packing(ctx: Context) -> str:
    tp = 2 if ctx.gpus >= 2 else 1
    overrides = ["trainer.precision=bf16", "model.data.pack_sequences=true"]
    overrides.append(f"model.tensor_model_parallel_size={tp}")
    return f"TP={tp}: " + train(ctx, "bf16_packing", overrides, nproc=tp)


def attention_sdpa(ctx: Context) -> str:
    """The SDPA backend; on CUDA in bf16, whose step-1 gradient norm must match the fp32 quick
    start's on the same initial weights (GRAD_NORM_TOLERANCE): cuDNN's attention kernel once
    made it 64x too large there while the forward pass was right."""
    # bf16 where it is fast (CUDA); fp32 on the CPU, where bf16 is ~10x slower.
    overrides = ["model.attention_backend=sdpa", f"trainer.precision={'bf16' if ctx.cuda else 32}"]
    figures_line = train(ctx, "attention_sdpa", overrides)
    if "quickstart" not in ctx.runs:
        return figures_line + "; no fp32 quick start to compare gradients with"
    ours = read_metrics(ctx.runs["attention_sdpa"])[0]["grad_norm"]
    fp32 = read_metrics(ctx.runs["quickstart"])[0]["grad_norm"]
    gap = abs(ours - fp32) / fp32
    if not gap <= GRAD_NORM_TOLERANCE:
        raise CheckFailed(
            f"step-1 gradient norm {ours:.4g} vs the fp32 quick start's {fp32:.4g} on the same "
            f"weights (relative gap {gap:.2g} > {GRAD_NORM_TOLERANCE}): the gradients are wrong"
        )
    return f"step-1 gradient norm {ours:.4g} vs fp32's {fp32:.4g}; {figures_line}"


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
    worst = worst_logp_difference(ctx, root / "export", ours, max_length)
    tolerance = 1e-3 if ctx.cuda else 1e-4
    if not ours or worst > tolerance:
        raise CheckFailed(f"exported model's log-probs differ from ours: rel {worst:.2e}")
    ctx.runs["conversion"] = run_dir
    return f"{len(ours)} examples, largest relative log-prob difference {worst:.1e}"


def lora(ctx: Context) -> str:
    """LoRA rank 8 on every projection of the bundled example, the adapters-off reference: step
    1's policy is the reference (B starts at 0), so its loss is 0.5 and z0 is 0 exactly."""
    overrides, spec = backend_overrides(ctx)
    lora_args = [
        "model.peft.peft_scheme=lora", "model.peft.lora_tuning.adapter_dim=8",
        "model.peft.lora_tuning.target_modules=[all]",
    ]  # fmt: skip
    figures_line = train(ctx, "lora", [*overrides, *lora_args])
    log = (ctx.work / "lora.log").read_text()
    trainable = [ln for ln in log.splitlines() if ln.startswith("LoRA: ")]
    if not trainable or "adapters off" not in trainable[0]:
        raise CheckFailed("the run did not report 'LoRA: ... reference = ... (adapters off)'")
    first = read_metrics(ctx.work / "lora")[0]
    if abs(first["loss"] - 0.5) > 1e-6 or first["kl"] != 0:
        raise CheckFailed(f"step 1 is not the reference: loss {first['loss']}, kl {first['kl']}")
    count = trainable[0].split(";")[0].removeprefix("LoRA: ")
    return f"{spec}; {count}; step 1 loss 0.5, kl 0; {figures_line}"


def distributed_optimizer(ctx: Context) -> str:
    """The distributed optimizer with both overlaps on: the gradient reduce-scatter during the
    backward pass (`model.optim.overlap_grad_sync=true`, megatron DDP's overlap_grad_reduce) and
    the parameter all-gather during the next forward (overlap_param_gather, on by default with
    the distributed optimizer); DP=2 on 2 GPUs (2 gloo ranks with --cpu), else DP=1; then a
    resume from its last checkpoint (saved after the deferred all-gather is completed)."""
    dp = 1 if ctx.cuda and ctx.gpus < 2 else 2
    overrides = [
        "model.optim.name=distributed_fused_adam", "model.optim.overlap_grad_sync=true",
        f"trainer.precision={'bf16' if ctx.cuda else 32}",
    ]  # fmt: skip
    figures_line = train(ctx, "distributed_optimizer", overrides, nproc=dp)
    run_dir, total = ctx.runs["distributed_optimizer"], ctx.steps + 1
    output = launch(ctx, "distributed_optimizer_resume", [
        KTO, f"exp_manager.explicit_log_dir={run_dir}", f"trainer.kto.max_steps={total}",
        f"trainer.kto.save_interval={total}", f"trainer.kto.val_check_interval={total}",
        *overrides,
    ], nproc=dp)  # fmt: skip
    check_resumed(output, read_metrics(run_dir), ctx.steps, total)
    return f"DP={dp}, overlapped grad reduce + param gather; resumed; {figures_line}"


def context_parallel(ctx: Context) -> str:
    """The bundled example at CP=2: every row split over two ranks."""
    ranks = two_ranks(ctx, "CP=2")
    overrides, spec = backend_overrides(ctx)
    return f"CP=2, {spec}: " + train(
        ctx, "context_parallel", [*overrides, "model.context_parallel_size=2"], nproc=ranks
    )


def pipeline(ctx: Context) -> str:
    """The bundled example at PP=2 (one layer per stage)."""
    ranks = two_ranks(ctx, "PP=2")
    overrides = [
        "model.pipeline_model_parallel_size=2",
        f"trainer.precision={'bf16' if ctx.cuda else 32}",
    ]
    return "PP=2: " + train(ctx, "pipeline", overrides, nproc=ranks)


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


def _worker_pid(run_dir: Path, rank: int) -> int | None:
    """The pid of `rank`'s worker of the run writing to `run_dir` (from /proc), or None."""
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            if f"exp_manager.explicit_log_dir={run_dir}".encode() not in cmd:
                continue
            if b"torch.distributed.run" in cmd:
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return int(entry.name)
    return None


def restart(ctx: Context) -> str:
    """`torchrun --max-restarts 1` with rank 1 killed (SIGKILL) after the first checkpoint: the
    restarted workers form their process groups again (NCCL on 2 GPUs, gloo with --cpu),
    resume from that checkpoint and finish."""
    ranks = two_ranks(ctx, "a restart of 2 ranks")
    run_dir, total, save = ctx.work / "restart", max(4, ctx.steps), max(2, ctx.steps // 2)
    log = ctx.work / "restart.log"
    args = [KTO, f"exp_manager.explicit_log_dir={run_dir}", f"trainer.kto.max_steps={total}",
            f"trainer.kto.save_interval={save}", f"trainer.kto.val_check_interval={total}"]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        **({} if ctx.cuda else {"CUDA_VISIBLE_DEVICES": ""}),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts", "1",
           f"--nproc_per_node={ranks}", *map(str, args)]  # fmt: skip
    deadline = ctx.deadline if ctx.deadline is not None else time.monotonic() + ctx.timeout
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, text=True, stdout=out, stderr=out)
        try:
            while f'"step": {save + 1},' not in _text(run_dir / "metrics.jsonl"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise CheckFailed(f"no step {save + 1} before the kill ({log})")
                time.sleep(0.1)
            pid = _worker_pid(run_dir, 1)
            if pid is None:
                raise CheckFailed("rank 1's process not found")
            os.kill(pid, 9)
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise CheckFailed(f"ran over the check's budget after the kill ({log})") from None
        finally:
            if proc.poll() is None:
                proc.kill()
    output = log.read_text()
    if code != 0:
        raise CheckFailed(f"torchrun exited {code} after the restart ({log})")
    check_resumed(output, read_metrics(run_dir), save, total)
    return (
        f"rank 1 killed after step {save + 1}; restarted, resumed at step {save}, finished {total}"
    )


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


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
    "restart": restart,
    "lora": lora,
    "distributed_optimizer": distributed_optimizer,
    "moe_pp": moe_pp,
    "context_parallel": context_parallel,
    "pipeline": pipeline,
    "bench_trl": bench_trl,
}

#: Seconds each check may take on CUDA (its commands are stopped when it runs out: FAIL). From
#: one H200 (2026-11-27, no TE): a tiny training process costs ~21 s before its second step —
#: ~15 s of imports and set-up (the run's `start-up` line says which) and ~5 s of kernel
#: compilation in step 1 — then 0.15-0.2 s per step; budgets are that per process plus ~50%.
#: The checks that run on one GPU without TE sum to 555 s (one call of the lent machine's 10
#: minutes); attention_te and te_local_checkpoint add 125 s where TE imports; moe_pp,
#: context_parallel, pipeline and restart need 2 GPUs (SKIP on one) and add 240 s there.
BUDGETS: dict[str, float] = {
    "quickstart": 45,
    "bf16_packing": 40,
    "attention_sdpa": 40,
    "attention_te": 45,
    "te_local_checkpoint": 80,
    "conversion": 90,
    "moe": 70,
    "eval": 50,
    "resume": 35,
    "restart": 80,
    "lora": 40,
    "distributed_optimizer": 70,
    "moe_pp": 60,
    "context_parallel": 50,
    "pipeline": 50,
    "bench_trl": 75,
}

#: Largest relative gap between a bf16 run's step-1 gradient norm and the fp32 quick start's on
#: the same initial weights (measured on an H200: 0.2681 vs 0.2684, 0.1%).
GRAD_NORM_TOLERANCE = 0.05


def run_checks(
    ctx: Context, names: list[str], gpu_required: bool, budget_scale: float = 0.0
) -> list[tuple[str, str, str]]:
    """Run the named checks in order; prints and returns (name, status, detail) per check.

    Each line gives the check's wall time; with `budget_scale` > 0 a check's commands are
    stopped once it has used `budget_scale` x its `BUDGETS` entry (FAIL), and the line gives
    that budget too.
    """
    results = []
    for name in names:
        start = time.monotonic()
        budget = BUDGETS.get(name, 60.0) * budget_scale
        ctx.deadline = start + budget if budget > 0 else None
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
        took = ""
        if status != "SKIP":
            took = f" ({time.monotonic() - start:.0f} s" + (
                f" of {budget:.0f} s)" if budget else ")"
            )
        print(f"{status} {name}{took}" + (f": {detail}" if detail else ""), flush=True)
        results.append((name, status, detail))
    ctx.deadline = None
    return results


def summary_exit_code(results: list[tuple[str, str, str]], seconds: float | None = None) -> int:
    """Print the summary line (with the total wall time when given); 1 if any check failed."""
    counts = {
        s: sum(1 for _, status, _ in results if status == s) for s in ("PASS", "FAIL", "SKIP")
    }
    took = f" in {seconds:.0f} s" if seconds is not None else ""
    print("summary: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + took)
    return 1 if counts["FAIL"] else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run on the CPU with tiny settings")
    parser.add_argument("--checks", default=",".join(CHECKS), help="comma-separated subset")
    parser.add_argument("--work", type=Path, help="logs and runs (default: a temporary dir)")
    parser.add_argument("--steps", type=int, help="steps per run (default 20 GPU, 2 CPU)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per command")
    parser.add_argument(
        "--budget-scale", type=float, default=None,
        help="multiply each check's time budget (BUDGETS) by this; 0: no budgets "
        "(default 1 on CUDA with the default --steps, else 0)",
    )  # fmt: skip
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
    # Budgets are GPU seconds at the default step count; a CPU's time depends on its load.
    scale = args.budget_scale
    if scale is None:
        scale = 1.0 if cuda and args.steps is None else 0.0
    budget = sum(BUDGETS.get(n, 60.0) for n in names) * scale
    print(
        f"acceptance checks on {where}; TE {'yes' if te else 'no'}; logs in {work}; "
        + (f"time budget {budget:.0f} s in all" if scale else "no time budgets")
    )
    gpu_required = not cuda and not args.cpu
    start = time.monotonic()
    results = run_checks(ctx, names, gpu_required, scale)
    return summary_exit_code(results, time.monotonic() - start)


if __name__ == "__main__":
    sys.exit(main())
