"""Smoke test of tools/bench_kto.py: it runs (1 warm-up + 1 timed step) and reports figures
(its summaries and table: tools/bench_report.py).

Nothing here asserts on speed: the figures only have to be positive and finite.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "tools" / "bench_kto.py"
HAS_TRL = importlib.util.find_spec("trl") is not None

sys.path.insert(0, str(REPO / "tools"))
import bench_report  # noqa: E402


def _positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def _bench(out, *args: str) -> subprocess.CompletedProcess:
    """One timed step of the example preset at global batch 4 (micro-batch 2), as a user runs
    the script, writing its JSON report to `out`; the run must succeed."""
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--warmup=1", "--steps=1", "--threads=1",
         "--preset=example", f"--json={out}", *args,
         "model.global_batch_size=4", "model.micro_batch_size=2"],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


@pytest.mark.e2e
def test_bench_runs_and_reports_positive_figures(tmp_path):
    """One run of the script as a user runs it; with TRL installed the TRL side runs as well
    (one invocation covers both sides: each side is a fresh process and start-up dominates)."""
    out = tmp_path / "bench.json"
    proc = _bench(out, "--trl" if HAS_TRL else "--no-trl")
    assert "samples/s" in proc.stdout and "peak memory (GiB)" in proc.stdout
    # No peak stated and no GPU datasheet on this machine: the header says it was measured at
    # the model's own GEMM shapes, and MFU against it cannot exceed 1.
    assert "MFU against" in proc.stdout and "measured: best of 5 trials over the model's" in (
        proc.stdout
    ), proc.stdout
    report = json.loads(out.read_text())
    sides = ["ours", "trl"] if HAS_TRL else ["ours"]
    for side in sides:
        figures = report[side]
        assert figures["timed_steps"] == 1
        for key in ("samples_per_sec", "tokens_per_sec", "mfu", "step_time"):
            assert _positive(figures[key]["median"]), (side, key, figures[key])
            assert _positive(figures[key]["mean"]), (side, key, figures[key])
        assert _positive(figures["peak_memory_gb"])
        assert figures["mfu"]["median"] <= 1.0, (side, figures["mfu"])
    assert report["ours"]["peak_flops_source"].startswith("measured")
    if HAS_TRL:
        assert "ours/TRL" in proc.stdout
        assert _positive(report["speedup_ours_over_trl"]["samples_per_sec"])
        # Same rows in the same batches, tokenised alike: both sides see the same tokens.
        assert report["ours"]["tokens_per_step"] == report["trl"]["tokens_per_step"]


@pytest.mark.e2e
def test_objective_mode_runs_a_dpo_family_loss(tmp_path):
    """`--objective orpo`: the DPO entry with that loss type, its own header; with TRL installed
    TRL's ORPOTrainer runs the same pairs (`tools/bench_trl.py`), tokenised alike."""
    out = tmp_path / "bench.json"
    proc = _bench(out, "--objective=orpo", "--trl" if HAS_TRL else "--no-trl")
    assert "DPO-family step benchmark" in proc.stdout and "loss_type orpo" in proc.stdout
    report = json.loads(out.read_text())
    assert report["ours"]["spec"]["dpo"]["loss_type"] == "orpo"
    assert _positive(report["ours"]["samples_per_sec"]["median"])
    if HAS_TRL:
        assert "TRL ORPOTrainer" in proc.stdout and report["trl"]["trainer"] == "ORPOTrainer"
        assert report["trl"]["micro_batch_size"] == 2 and report["trl"]["batch_size"] == 4
        assert _positive(report["trl"]["samples_per_sec"]["median"])
        assert report["ours"]["tokens_per_step"] == report["trl"]["tokens_per_step"]


def test_objective_without_a_trl_trainer_refuses_trl_in_one_line():
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--objective=sigmoid", "--trl"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: --trl mirrors KTO and cpo, simpo, orpo runs only; leave it out with "
        "--objective sigmoid"
    )


@pytest.mark.e2e
@pytest.mark.skipif(not HAS_TRL or importlib.util.find_spec("peft") is None, reason="trl+peft")
def test_lora_mode_trains_the_same_adapters_on_both_sides(tmp_path):
    """`--lora`: TRL's KTOTrainer + peft trains adapters of the same rank on the same Hugging
    Face projections of the same layers (q/k/v and down_proj of layer 2 of 2), on the same
    batch, with the adapters-off reference; both sides' adapter parameter counts agree."""
    out = tmp_path / "bench.json"
    proc = _bench(
        out,
        "--trl",
        "--lora=4",
        "--lora-targets=attention_qkv,down_proj",
        "model.peft.lora_tuning.layer_selection=[2]",
    )
    report = json.loads(out.read_text())
    ours, trl = report["ours"], report["trl"]
    lora = ours["spec"]["lora"]
    assert ours["spec"]["reference_policy"] == "adapters_off"
    assert lora["target_modules"] == ["down_proj", "k_proj", "q_proj", "v_proj"]
    assert (lora["r"], lora["layers_to_transform"]) == (4, [1])
    assert trl["lora"] == {
        **{k: lora[k] for k in ("r", "lora_alpha", "lora_dropout", "target_modules")},
        "layers_to_transform": [1],
        "reference": "adapters disabled",
    }
    # tiny preset: hidden 64, 4 heads / 2 groups of 16, ffn 128; rank 4 on one layer.
    assert lora["adapter_parameters"] == 4 * ((64 + 64) + 2 * (64 + 32) + (128 + 64))
    assert trl["trainable_parameters"] == lora["adapter_parameters"]
    assert trl["batch_size"] == ours["spec"]["global_batch_size"] == 4
    assert ours["tokens_per_step"] == trl["tokens_per_step"]
    for side in (ours, trl):
        assert _positive(side["samples_per_sec"]["median"]) and _positive(side["peak_memory_gb"])
    assert "LoRA: rank 4" in proc.stdout and "reference adapters disabled" in proc.stdout


def test_table_without_trl_has_no_ratio_column():
    step = {"step_time": 0.5, "samples_per_sec": 8.0, "tokens_per_sec": 100.0, "mfu": 0.01}
    ours = bench_report.combine_runs(
        [{"steps": [{**step, "tokens": 50}, {**step, "tokens": 70}], "peak_memory_gb": 0.4}]
    )
    table = bench_report.render_table({"ours": ours})
    assert "ours/TRL" not in table and "TRL KTOTrainer" not in table
    assert "8.00 / 8.00" in table  # samples/s median / mean
    assert "60 / 60.0" in table  # tokens/step median / mean


def test_combine_runs_pools_steps_and_keeps_highest_peak():
    def run(seconds: list[float], peak: float) -> dict:
        steps = [
            {"step_time": t, "samples_per_sec": 4 / t, "tokens_per_sec": 40 / t, "mfu": 0.1 / t}
            for t in seconds
        ]
        return {"steps": [{**s, "tokens": 40} for s in steps], "peak_memory_gb": peak, "x": peak}

    combined = bench_report.combine_runs([run([1.0, 2.0], 0.5), run([4.0], 0.7)])
    assert combined["timed_steps"] == 3
    assert combined["step_time"] == {"median": 2.0, "mean": 7.0 / 3}
    assert combined["peak_memory_gb"] == 0.7
    assert combined["x"] == 0.5  # metadata from the first run
    assert [m["median"] for m in combined["run_medians"]] == [3.0, 1.0]


def test_summarize_median_and_mean():
    assert bench_report.summarize([1.0, 2.0, 6.0]) == {"median": 2.0, "mean": 3.0}
    assert all(math.isnan(v) for v in bench_report.summarize([]).values())


def test_make_bench_data_is_long_tailed_seeded_and_capped():
    """The generated set tokenises to the drawn lengths: long tail (p99 far above p50), capped
    rows, the requested class ratio, and the same rows for the same seed."""
    import make_bench_data

    from megatron_kto.data.tokenizers import load_tokenizer

    tok = load_tokenizer("sentencepiece", str(make_bench_data.DEFAULT_TOKENIZER))
    rows = make_bench_data.make_rows(tok, 300, seed=3, max_length=512, desirable=(2, 1))
    again = make_bench_data.make_rows(tok, 300, seed=3, max_length=512, desirable=(2, 1))
    assert rows == again
    assert rows != make_bench_data.make_rows(tok, 300, seed=4, max_length=512)
    stats = make_bench_data.length_stats(tok, rows)
    assert (stats["desirable"], stats["undesirable"]) == (200, 100)
    assert 120 <= stats["prompt"]["p50"] <= 180 and 200 <= stats["completion"]["p50"] <= 300
    assert stats["prompt"]["max"] <= 256 and stats["row"]["max"] <= 512
    # Uncapped, the log-normal tail shows (sigma 0.7: p99 ≈ 5 x median).
    wide = make_bench_data.length_stats(tok, make_bench_data.make_rows(tok, 300, max_length=8192))
    for part in ("prompt", "completion"):
        assert wide[part]["p99"] >= 3 * wide[part]["p50"], (part, wide[part])
    labels = [r["label"] for r in rows]
    assert labels[:10] != sorted(labels[:10], reverse=True) or labels[10:20] != sorted(
        labels[10:20], reverse=True
    ), "classes are shuffled, not in blocks"


@pytest.mark.skipif(not HAS_TRL, reason="trl not installed")
def test_trl_baseline_mirrors_an_moe_shape_as_mixtral():
    """`--preset longtail_moe`'s TRL side: a Mixtral of the run's experts, top-k and aux-loss
    coefficient (TRL adds it to the loss from the config); routing it cannot mirror is refused."""
    import trl_baseline
    from bench_presets import LONGTAIL_MOE

    from megatron_kto.config.architecture import GPTArchitecture

    moe = dict(o.removeprefix("model.").split("=") for o in LONGTAIL_MOE)
    arch = GPTArchitecture(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_moe_experts=int(moe["num_moe_experts"]),
        moe_router_topk=int(moe["moe_router_topk"]),
        moe_ffn_hidden_size=int(moe["moe_ffn_hidden_size"]),
        moe_aux_loss_coeff=float(moe["moe_aux_loss_coeff"]),
        encoder_seq_length=64,
    ).to_dict()
    spec = {
        "architecture": arch,
        "padded_vocab": 128,
        "seed": 0,
        "precision": "32",
        "tokenizer": {"bos_id": 1, "eos_id": 2, "pad_id": 0},
    }
    trl_baseline.check_llama_compatible(arch)
    model = trl_baseline._llama(spec)
    config = model.config
    assert config.model_type == "mixtral"
    assert (config.num_local_experts, config.num_experts_per_tok) == (8, 2)
    assert config.intermediate_size == int(moe["moe_ffn_hidden_size"])
    assert config.router_aux_loss_coef == pytest.approx(0.01)
    with pytest.raises(ValueError, match="MoE routing"):
        trl_baseline.check_llama_compatible({**arch, "moe_router_pre_softmax": True})
