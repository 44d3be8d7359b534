"""The MoE acceptance checks (`tools/acceptance_checks.py`): a tiny Qwen3-MoE from `transformers`
trained through the entry script, at EP=2 on two GPUs, and at PP=2."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

from acceptance_runner import (
    KTO,
    TOKENIZER,
    TOOLS,
    TRAIN,
    VALIDATION,
    CheckFailed,
    Context,
    Skip,
    check_trained,
    figures,
    format_figures,
    launch,
    read_metrics,
    two_ranks,
    worst_logp_difference,
)  # fmt: skip


def moe(ctx: Context) -> str:
    """A tiny Qwen3-MoE trained straight from its Hugging Face directory (bf16 on CUDA: TE's
    grouped experts when TE imports, else megatron's local experts; EP=2 when 2 GPUs exist),
    writing hf/; the eval tool then loads the checkpoint in the local spec in fp32 (SequentialMLP
    experts: a TE-grouped checkpoint crosses layouts) and its log-probs equal `transformers`' on
    the written hf/."""
    root, max_length = ctx.work / "moe", 64
    ep = 2 if ctx.gpus >= 2 else 1
    run_dir = root / "run"
    launch(ctx, "moe_train", [
        *_moe_run_args(ctx, _tiny_moe_hf(ctx), run_dir, max_length),
        f"model.expert_model_parallel_size={ep}", "exp_manager.save_hf=true",
    ], nproc=ep)  # fmt: skip
    rows = _check_aux_loss(read_metrics(run_dir), ctx.steps)
    per_example = root / "eval.jsonl"
    launch(ctx, "moe_eval", [
        TOOLS / "eval_kto_rewards.py", "--policy", run_dir / "checkpoints", "--data", VALIDATION,
        "--max-length", max_length, "--per-example", per_example, "--no-cache",
        "--precision", "32", "--attention-backend", "sdpa",
    ])  # fmt: skip
    ours = [json.loads(line)["policy_logps"] for line in per_example.read_text().splitlines()]
    worst = worst_logp_difference(ctx, run_dir / "hf", ours, max_length)
    tolerance = 1e-3 if ctx.cuda else 1e-4
    if not ours or worst > tolerance:
        raise CheckFailed(f"hf/ log-probs differ from the eval tool's: rel {worst:.2e}")
    experts = "TE grouped" if ctx.transformer_engine else "local"
    return (
        f"EP={ep}, {experts} experts; {format_figures(figures(rows))}; eval (local spec, fp32) "
        f"= transformers on hf/ to {worst:.1e}"
    )


def _tiny_moe_hf(ctx: Context) -> Path:
    """A tiny random Qwen3-MoE's Hugging Face directory (4 experts, top-2, router load-balancing
    loss 0.01) with the bundled tokenizer's vocabulary, written once under `<work>/moe/hf`."""
    hf_dir = ctx.work / "moe" / "hf"
    if (hf_dir / "config.json").exists():
        return hf_dir
    if importlib.util.find_spec("transformers") is None:
        raise Skip("transformers is not installed")
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.utils import logging as hf_logging

    from megatron_kto.data.tokenizers import load_tokenizer

    hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
        num_experts_per_tok=2, vocab_size=load_tokenizer("sentencepiece", str(TOKENIZER)).vocab_size,
        max_position_embeddings=128, initializer_range=0.1, router_aux_loss_coef=0.01,
    )  # fmt: skip
    Qwen3MoeForCausalLM(config).save_pretrained(hf_dir)
    return hf_dir


def _moe_run_args(ctx: Context, hf_dir: Path, run_dir: Path, max_length: int = 64) -> list:
    """The entry script and overrides of a KTO run of `ctx.steps` steps from `hf_dir` (bf16 on
    CUDA, fp32 on the CPU), global batch 8 in micro-batches of 2."""
    return [
        KTO, f"pretrained_checkpoint.restore_from_path={hf_dir}",
        f"model.data.data_prefix.train=[{TRAIN}]", "model.data.data_prefix.validation=[]",
        "model.tokenizer.library=sentencepiece", f"model.tokenizer.model={TOKENIZER}",
        f"trainer.precision={'bf16' if ctx.cuda else 32}", f"exp_manager.explicit_log_dir={run_dir}",
        f"trainer.kto.max_steps={ctx.steps}", "model.global_batch_size=8",
        "model.micro_batch_size=2", f"model.data.max_length={max_length}",
    ]  # fmt: skip


def _check_aux_loss(rows: list[dict[str, Any]], steps: int) -> list[dict[str, Any]]:
    """An MoE run trained to `steps` and logged a finite, positive router aux loss each step."""
    check_trained(rows, steps)
    if not all(math.isfinite(r.get("aux_loss", math.nan)) and r["aux_loss"] > 0 for r in rows):
        raise CheckFailed("aux_loss not logged (finite, > 0) at every step")
    return rows


def moe_pp(ctx: Context) -> str:
    """The tiny Qwen3-MoE at PP=2 (one layer per stage) with the router load-balancing loss on:
    its statistics are shared between the stages, the logged aux loss is the whole model's."""
    ranks = two_ranks(ctx, "PP=2")
    run_dir = ctx.work / "moe_pp"
    launch(ctx, "moe_pp", [
        *_moe_run_args(ctx, _tiny_moe_hf(ctx), run_dir), "model.pipeline_model_parallel_size=2",
    ], nproc=ranks)  # fmt: skip
    rows = _check_aux_loss(read_metrics(run_dir), ctx.steps)
    experts = "TE grouped" if ctx.transformer_engine else "local"
    return f"PP=2, {experts} experts, aux loss {rows[-1]['aux_loss']:.4f}; {format_figures(figures(rows))}"
