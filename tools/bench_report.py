"""The figures and console report of `tools/bench_kto.py`: per-step values summarised (median,
mean) per side, and the table, header and notes it prints. Standard library only (see the note
on max-RSS in `bench_kto.py`)."""

from __future__ import annotations

import statistics
from typing import Any

#: Per-step figures each side reports.
FIGURES = ("step_time", "samples_per_sec", "tokens_per_sec", "mfu", "cpu_time")


def summarize(values: list[float]) -> dict[str, float]:
    """Median and mean of per-step values (empty input gives NaNs)."""
    if not values:
        return {"median": float("nan"), "mean": float("nan")}
    return {"median": statistics.median(values), "mean": statistics.fmean(values)}


def combine_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's summary over one or more runs: their timed steps pooled, the highest peak.

    Each run is ``{"steps": [per-step figures], "peak_memory_gb": ..., <metadata>}``; the
    metadata of the first run is kept.
    """
    steps = [step for run in runs for step in run["steps"]]
    figures = {k: summarize([s[k] for s in steps if s.get(k) is not None]) for k in FIGURES}
    return {
        **{k: v for k, v in runs[0].items() if k != "steps"},
        "timed_steps": len(steps),
        **figures,
        "tokens_per_step": summarize([s["tokens"] for s in steps]),
        "peak_memory_gb": max(run["peak_memory_gb"] for run in runs),
        "run_medians": [summarize([s["samples_per_sec"] for s in r["steps"]]) for r in runs],
        "runs": runs,
    }


def _fmt(value: float | None, digits: int = 2) -> str:
    if value is None or value != value:  # None or NaN
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def render_table(report: dict[str, Any]) -> str:
    """The human-readable report."""
    ours, trl = report["ours"], report.get("trl")
    name = f"TRL {trl.get('trainer', 'KTOTrainer')}" if trl else ""
    sides = [("megatron_kto", ours)] + ([(name, trl)] if trl else [])
    header = f"{'':26}" + "".join(f"{name:>24}" for name, _ in sides)
    if trl:
        header += f"{'ours/TRL':>12}"
    rows = [
        ("samples/s", "samples_per_sec", 2, True),
        ("tokens/s", "tokens_per_sec", 1, True),
        ("MFU (%)", "mfu", 3, True),
        ("step time (s)", "step_time", 4, False),
        ("CPU time/step (s)", "cpu_time", 4, False),
    ]
    lines = [header, "-" * len(header)]
    for label, key, digits, higher_better in rows:
        scale = 100.0 if key == "mfu" else 1.0
        line = f"{label:26}"
        for _, side in sides:
            s = side[key]
            line += (
                f"{_fmt(s['median'] * scale, digits) + ' / ' + _fmt(s['mean'] * scale, digits):>24}"
            )
        if trl:
            a, b = ours[key]["median"], trl[key]["median"]
            ratio = (a / b if higher_better else b / a) if a and b else float("nan")
            line += f"{_fmt(ratio, 2) + 'x':>12}"
        lines.append(line)
    line = f"{'tokens/step':26}"
    for _, side in sides:
        t = side["tokens_per_step"]
        line += f"{_fmt(t['median'], 0) + ' / ' + _fmt(t['mean'], 1):>24}"
    lines.append(line)
    line = f"{'peak memory (GiB)':26}"
    for _, side in sides:
        line += f"{_fmt(side['peak_memory_gb'], 3):>24}"
    lines.append(line)
    if len(ours["run_medians"]) > 1:
        line = f"{'samples/s, median per run':26}"
        for _, side in sides:
            line += f"{', '.join(_fmt(m['median'], 1) for m in side['run_medians']):>24}"
        lines.append(line)
    footer = (
        "median / mean over the timed steps; CPU time is the process's own (all threads), the "
        "figure other load on the machine disturbs least"
    )
    if trl:
        footer += "; ours/TRL is the ratio of medians (for times: TRL's over ours)"
    lines.append(f"({footer})")
    return "\n".join(lines)


def _experts(arch: dict[str, Any]) -> str:
    """The MoE part of the model line ('' when dense)."""
    if not arch.get("num_moe_experts"):
        return ""
    return (
        f"; MoE: {arch['num_moe_experts']} experts of ffn "
        f"{arch.get('moe_ffn_hidden_size') or arch['ffn_hidden_size']}, top-"
        f"{arch['moe_router_topk']}, aux loss coef {arch['moe_aux_loss_coeff']}"
    )


def _lora_line(spec: dict[str, Any], trl: dict[str, Any] | None) -> list[str]:
    """The header's LoRA line (none without LoRA): the adapters both sides train."""
    lora = spec.get("lora")
    if not lora:
        return []
    line = (
        f"  LoRA: rank {lora['r']}, alpha {lora['lora_alpha']:g}, dropout "
        f"{lora['lora_dropout']:g}, on {', '.join(lora['target_modules'])}; "
        f"{lora['adapter_parameters']:,} adapter parameters; reference: adapters off"
    )
    if trl and trl.get("lora"):
        line += (
            f" (TRL: KTOTrainer + peft, {trl['trainable_parameters']:,} trainable, "
            f"reference {trl['lora']['reference']})"
        )
    return [line]


def render_header(report: dict[str, Any]) -> str:
    ours = report["ours"]
    spec, arch = ours["spec"], ours["spec"]["architecture"]
    env = report["environment"]
    if "dpo" in spec:  # an --objective run (bench_trl.preference_spec)
        data = (
            f"  data ({report.get('preset', 'example')} preset, as pairs): global batch "
            f"{spec['global_batch_size']} pairs (micro-batch {spec['micro_batch_size']}), "
            f"max_length {spec['max_length']}, loss_type {spec['dpo']['loss_type']}, beta "
            f"{spec['dpo']['beta']}"
        )
    else:
        data = (
            f"  data ({report.get('preset', 'example')} preset): {', '.join(spec['train_files'])}; "
            f"global batch {spec['global_batch_size']} "
            f"(ours: micro-batch {spec['micro_batch_size']}, reference {spec['reference_policy']}), "
            f"max_length {spec['max_length']}, beta {spec['kto']['beta']}, lr {spec['optim']['lr']}"
        )
    return "\n".join(
        [
            "DPO-family step benchmark" if "dpo" in spec else "KTO step benchmark",
            f"  model: {arch['num_layers']} layers, hidden {arch['hidden_size']}, ffn "
            f"{arch['ffn_hidden_size']}, heads {arch['num_attention_heads']}/"
            f"{arch['num_query_groups'] or arch['num_attention_heads']} (q/kv), vocab "
            f"{spec['padded_vocab']}, precision {spec['precision']}{_experts(arch)}",
            data,
            *_lora_line(spec, report.get("trl")),
            f"  steps: {report['warmup']} warm-up + {report['steps']} timed, "
            f"{report['repeat']} run(s) per side; world size "
            f"{ours['world_size']}; intra-op threads {ours['threads']}",
            f"  MFU against {ours['peak_flops_per_device'] / 1e9:.1f} GFLOP/s per device, "
            f"{ours.get('peak_flops_source', 'source not recorded')}",
            f"  host: {env['cpu_count']} CPUs, load average {env['load_average']}; "
            "shared machines give noisy timings",
        ]
    )


def render_notes(report: dict[str, Any]) -> str:
    trl = report.get("trl")
    if not trl:
        return ""
    v = trl["versions"]
    if "dpo" in report["ours"]["spec"]:  # --objective cpo|simpo|orpo (tools/bench_trl.py)
        return "\n".join("  * " + n for n in (
            f"TRL side: {trl['trainer']} of trl {v['trl']}, transformers {v['transformers']}, "
            f"torch {v['torch']}; micro-batch {trl['micro_batch_size']} pairs, "
            f"{trl['batch_size']} a step, as ours.",
            "Same passes per step on both sides: no reference; policy forward+backward over "
            "the chosen and rejected rows. We pack the rows without padding and run the output "
            "layer on completion positions (with ORPO's TRL NLL, the chosen rows' prompt too); "
            "TRL pads each micro-batch to its longest row and computes full logits.",
        ))  # fmt: skip
    sft = report["ours"]["spec"]["kto"]["sft_loss_weight"]
    notes = [
        f"TRL side: trl {v['trl']}, transformers {v['transformers']}, torch {v['torch']}; "
        f"optimizer {trl['optim']}, attention '{trl['attn_implementation']}'.",
        "Same passes per step on both sides: reference forward over samples + KL rows, policy "
        "forward over the KL rows without autograd (TRL also wraps it in torch.no_grad), policy "
        "forward+backward over the sample rows; the ratio is implementation overhead."
        if report["ours"]["spec"]["kto"]["loss_type"] == "kto"
        else "Same passes per step on both sides: this loss ignores z0, so neither side builds "
        "or runs KL rows (reference forward and policy forward+backward over the samples).",
        "Differences: we run megatron-core's GPTModel (TE spec on CUDA with TE, else the local "
        "spec with SDPA attention) through its pipeline schedule in micro-batches (padding-free "
        "unless model.data.pack_sequences=false) and "
        + (
            "switch the adapters off for the reference; TRL runs the whole batch as one "
            "micro-batch through HF Trainer/accelerate, its reference the same peft model under "
            "disable_adapter(), and a chunked (fused) LM-head log-prob."
            if report["ours"]["spec"].get("lora")
            else "swap the reference weights in (cpu_swap) or keep a copy; TRL runs the whole "
            "batch as one micro-batch through HF Trainer/accelerate with a second model object "
            "and a chunked (fused) LM-head log-prob."
        ),
    ]
    if sft:
        notes.append(f"model.kto.sft_loss_weight={sft} has no TRL counterpart (ignored there).")
    return "\n".join("  * " + n for n in notes)
