"""The memory plan's arithmetic against independent references, and `tools/plan_layout.py`.

* Parameter counts: `transformers`' own models built from the same config (tiny Llama with
  GQA, tiny Qwen2 with QKV biases and tied embeddings) and the published Llama-3-8B count
  (8,030,261,248, README), not our formulas.
* The DDP buffer layout under the distributed optimizer, worked out by hand in the docstring.
* The layout tool: an 8B-shaped config on 8 x 80 GB fits and recommends a layout whose memory
  really is below the GPU's; on 1 x 24 GB full fine-tuning is reported as not fitting
  (exit code 1); a tiny model fits anywhere.
* The tool plans the embedding the run builds: its vocabulary padded as the run pads a Hugging
  Face model (`hf_dir.padded_vocab`), and only TP sizes that split those rows.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_kto.conversion.hf_config import architecture_from_hf
from megatron_kto.conversion.hf_dir import model_architecture
from megatron_kto.planning.layout import Cluster, candidates
from megatron_kto.planning.model_state import (
    LoRAShape,
    ParallelDims,
    Param,
    ddp_buffer,
    model_state,
    shard_elements,
    total_parameters,
)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}


def _tiny_hf(tmp_path: Path, family: str) -> tuple[Path, int]:
    """A tiny HF config saved by `transformers`, and its model's parameter count."""
    import torch
    import transformers

    common = dict(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=1024,
        max_position_embeddings=256,
    )
    if family == "llama":
        config = transformers.LlamaConfig(**common)
        model_cls = transformers.LlamaForCausalLM
    else:
        config = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        model_cls = transformers.Qwen2ForCausalLM
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = model_cls(config)
    return tmp_path, sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_parameter_count_equals_transformers(tmp_path, family):
    path, expected = _tiny_hf(tmp_path, family)
    arch = architecture_from_hf(json.loads((path / "config.json").read_text()))
    # Our vocabulary is padded (to a multiple of 128): count the unpadded model to compare.
    arch.padded_vocab_size = arch.vocab_size
    assert total_parameters(arch) == expected
    # Every rank's share adds up: TP shards, replicated norms counted once per TP rank.
    for tp, pp in [(2, 1), (1, 2), (2, 2)]:
        dims = ParallelDims(tp=tp, pp=pp)
        per_tp_rank = sum(model_state(arch, dims, r).parameters for r in range(pp))
        replicated = (2 * arch.num_layers + 1) * arch.hidden_size
        tied_copy = arch.vocab_size * arch.hidden_size // tp if pp > 1 and family == "qwen2" else 0
        assert (per_tp_rank - replicated) * tp + replicated == expected + tied_copy * tp


def test_llama3_8b_parameter_count():
    arch = architecture_from_hf(LLAMA3_8B)
    assert total_parameters(arch) == 8_030_261_248  # published; vocabulary 128256 = 1002 x 128


def test_distributed_optimizer_buffer_layout_by_hand():
    """Params [a=100, b=30, c=200] (model order) go into the buffer reversed: c at 0..200,
    b starts at the next multiple of 64 (256) and ends at 286, a at 320..420. One bucket, padded
    to lcm(DP=3, 128) = 384: 420 -> 768. DP shards of 256: rank 0 [0, 256) owns all of c (200);
    rank 1 [256, 512) owns b (30) and a (100); rank 2 owns only padding."""
    params = [Param("a", 100), Param("b", 30), Param("c", 200)]
    dims = ParallelDims(dp=3, distributed_optimizer=True)
    buffer = ddp_buffer(params, dims, pp_rank=0, chunk_index=0)
    assert buffer.numel == 768
    assert buffer.param_ranges == ((0, 200, 0), (256, 286, 0), (320, 420, 0))
    assert [shard_elements(buffer, 3, r) for r in range(3)] == [
        [200, 0, 0],
        [0, 30, 100],
        [0, 0, 0],
    ]
    # Without the distributed optimizer: no padding at all.
    plain = ddp_buffer(params, ParallelDims(dp=3), 0, 0)
    assert plain.numel == 330


def test_bf16_model_state_bytes_per_parameter():
    """bf16 + Adam without sharding: 2 (weights) + 4 (fp32 grads) + 12 (moments, main weights)."""
    arch = architecture_from_hf(LLAMA3_8B)
    state = model_state(arch, ParallelDims(precision="bf16"))
    n = state.parameters
    assert (state.weights, state.gradients, state.optimizer) == (2 * n, 4 * n, 12 * n)


def _first_row(out: subprocess.CompletedProcess) -> list[str]:
    """The cells of the tool's first (recommended) table row."""
    first = next(
        line for line in out.stdout.splitlines() if line.startswith("| ") and "TP" not in line
    )
    return [c.strip() for c in first.strip("|").split("|")]


def _run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / "plan_layout.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_8b_on_8x80gb_fits_and_recommendation_is_within_memory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    out = _run_tool("--hf-config", str(tmp_path), "--gpus", "8", "--gpu-memory", "80GB")
    assert out.returncode == 0, out.stderr
    assert "recommended: the first row" in out.stdout
    cells = _first_row(out)
    tp, pp, dp, peak = int(cells[0]), int(cells[1]), int(cells[2]), float(cells[8])
    assert tp * pp * dp == 8 and peak < 80e9 / 2**30
    # The plan of that row, recomputed independently of the tool's table, fits too.
    arch = model_architecture(LLAMA3_8B, "config.json")
    best = candidates(arch, Cluster(8, 80 * 10**9), 4096, 64)[0]
    assert best.fits and (best.dims.tp, best.dims.pp, best.dims.dp) == (tp, pp, dp)


def test_plan_pads_the_vocabulary_as_the_run_does(tmp_path):
    """A run on a Hugging Face model (direct load or converted) pads its embedding to a multiple
    of 128 x 8 rows whatever its TP; the tool padded to 128 x TP: at TP=1 it planned 32000 rows
    of a 32000-token vocabulary where the run builds 32768."""
    from plan_layout import read_model

    from megatron_kto.checkpointing.locate import read_architecture

    shape = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=4)
    config = {**LLAMA3_8B, **shape, "num_attention_heads": 12, "num_key_value_heads": 6}
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 32000}))
    plan, run = read_model(tmp_path / "config.json"), read_architecture(tmp_path)
    for tp in (1, 2, 4):
        assert plan.padded_vocab(tp) == run.padded_vocab(tp) == 32768
    # TP 3 and 6 divide the heads and query groups but not the 32768 rows: the run refuses them.
    found = candidates(plan, Cluster(6, 80 * 10**9), 512, 6)
    assert {c.dims.tp for c in found} == {1, 2}


def test_8b_on_one_24gb_gpu_does_not_fit(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    out = _run_tool("--hf-config", str(tmp_path), "--gpus", "1", "--gpu-memory", "24GB")
    assert out.returncode == 1
    assert "does not fit" in out.stdout
    # Weights, gradients and Adam state alone are 16 bytes per parameter: > 120 GiB.
    needed = float(out.stdout.split("needs at least ")[1].split(" GiB")[0])
    assert needed > 16 * 8.03e9 / 2**30


def test_tiny_model_fits_and_bad_arguments_exit_2(tmp_path):
    path, _ = _tiny_hf(tmp_path, "llama")
    out = _run_tool("--hf-config", str(path), "--gpus", "2", "--gpu-memory", "8GB", "--seq", "128")
    assert out.returncode == 0, out.stderr
    bad = _run_tool("--hf-config", str(path), "--gpus", "2", "--gpu-memory", "lots")
    assert bad.returncode == 2 and bad.stderr.startswith("error: --gpu-memory")


def test_startup_table_warns_only_when_the_device_is_too_small():
    from megatron_kto.entry import compose_run_config
    from megatron_kto.planning.memory import format_plan, run_inputs, worst_rank

    prepared = compose_run_config("gpt_kto", ["model.micro_batch_size=2"], world_size=1)
    dims, x, strategy, lora = run_inputs(prepared.cfg, prepared.architecture, 1, "cuda")
    plan = worst_rank(prepared.architecture, dims, x, strategy, lora=lora)
    assert x.tokens == 2 * prepared.cfg.model.data.max_length  # the longest micro-batch
    small = format_plan(plan, dims, x, plan.peak - 1, "GPU", strategy)
    large = format_plan(plan, dims, x, plan.peak, "GPU", strategy)
    assert small[-1].startswith("warning: GPU:") and "EXCEEDS" in small[-1]
    assert large[-1].startswith("  GPU:") and large[-1].endswith("fits")
    assert len(large) == 4 and "reference 0 B (cpu_swap, +" in large[1]


def _llama3_8b_lora_parameters(rank: int) -> int:
    """LoRA parameters of Llama-3-8B on every projection, from its published shapes: r·(in + out)
    per projection (q 4096→4096, k/v 4096→1024, o 4096→4096, gate/up 4096→14336, down back)."""
    per_layer = (
        (4096 + 4096) + 2 * (4096 + 1024) + (4096 + 4096) + 2 * (4096 + 14336) + (14336 + 4096)
    )
    return 32 * rank * per_layer


def test_lora_model_state_counts_only_adapters_as_trained():
    """bf16 LoRA without sharding: 2 bytes per (base + adapter) weight, 4 + 12 more per adapter."""
    arch = architecture_from_hf(LLAMA3_8B)
    base = model_state(arch, ParallelDims(precision="bf16")).parameters
    lora = model_state(arch, ParallelDims(precision="bf16"), lora=LoRAShape(16, ("all",)))
    adapters = _llama3_8b_lora_parameters(16)
    assert lora.parameters == base + adapters
    assert (lora.weights, lora.gradients, lora.optimizer) == (
        2 * (base + adapters),
        4 * adapters,
        12 * adapters,
    )


def test_8b_lora_on_one_24gb_gpu_fits(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    args = ("--hf-config", str(tmp_path), "--gpus", "1", "--gpu-memory", "24GB")
    out = _run_tool(*args, "--lora-rank", "16")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "recommended: the first row" in out.stdout and "adapters_off" in out.stdout
    peak = float(_first_row(out)[8])
    # Above the bf16 base weights alone (2 bytes per parameter), below the usable 24 GB.
    assert 2 * 8.03e9 / 2**30 < peak < (0.92 * 24e9 - 1.5 * 2**30) / 2**30
    bad = _run_tool(*args, "--lora-rank", "16", "--lora-targets", "nope")
    assert bad.returncode == 2 and bad.stderr.startswith("error: --lora-targets")


def test_context_parallel_plans_a_rank_holding_a_part_of_every_row():
    """CP=2 on 4 ranks: each rank's micro-batch is half of every row (ceil), the data is split
    over DP = 2 (4 micro-batches of 2 out of 16), and gradients/optimizer shards over DP x CP."""
    from megatron_kto.entry import compose_run_config
    from megatron_kto.planning.memory import run_inputs

    overrides = [
        "model.micro_batch_size=2",
        "model.global_batch_size=16",
        "model.data.max_length=9",
    ]
    prepared = compose_run_config(
        "gpt_kto", [*overrides, "model.context_parallel_size=2"], world_size=4
    )
    dims, x, _, _ = run_inputs(prepared.cfg, prepared.architecture, 4, "cuda")
    assert (x.seq_len, x.tokens, x.forward_tokens, x.micro_batches) == (5, 10, 10, 4)
    assert dims.dp == 4


def test_moe_model_plans_its_experts(tmp_path):
    """Qwen3-30B-A3B (30.5B parameters, published) on 8 x 80 GB: whatever the layout, every
    parameter's bf16 weight and fp32 gradient and its 12 bytes of Adam state live on some rank
    (nothing replicated counted), so the busiest GPU holds at least 18 x 30.5e9 / 8 bytes — a
    plan that treated the model as dense (its 6144-wide dense MLP, ~4.5B parameters) could not
    reach that. The recommendation names its EP and ETP; LoRA on its experts is refused."""
    from test_plan_moe import QWEN3_30B_A3B

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    args = ("--hf-config", str(tmp_path), "--gpus", "8", "--gpu-memory", "80GB")
    out = _run_tool(*args)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "128 experts of 768 (top-8)" in out.stdout and "| EP | ETP |" in out.stdout
    cells = _first_row(out)
    tp, pp, dp, peak = int(cells[0]), int(cells[1]), int(cells[2]), float(cells[8])
    ep, etp = int(cells[11]), int(cells[12])
    assert tp * pp * dp == 8 and 128 % ep == 0 and (tp * dp) % (ep * etp) == 0
    assert 18 * 30.5e9 / 8 / 2**30 <= peak <= (0.92 * 80e9 - 1.5 * 2**30) / 2**30
    bad = _run_tool(*args, "--lora-rank", "8", "--lora-targets", "all")
    lines = bad.stderr.splitlines()
    assert bad.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: --lora-targets")
    assert "experts take no adapters" in lines[0]


def test_gpt_oss_20b_lora_fits_one_80gb_gpu(tmp_path):
    """GPT-OSS-20B (its published config.json fields, MXFP4 quantization_config included) with
    LoRA rank 16 on 1 x 80 GB: the tool plans adapters on the attention, the recommendation fits,
    and its peak holds at least the bf16 base weights (20.9e9 x 2 bytes: the experts dequantised,
    not MXFP4's 4.25 bits)."""
    from test_plan_moe import GPT_OSS

    config = {
        **GPT_OSS,
        "num_hidden_layers": 24,
        "num_local_experts": 32,
        "quantization_config": {"quant_method": "mxfp4"},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = ("--hf-config", str(tmp_path), "--gpus", "1", "--gpu-memory", "80GB")
    out = _run_tool(*args, "--lora-rank", "16")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "32 experts of 2880 (top-4)" in out.stdout and "LoRA rank 16 on attention" in out.stdout
    peak = float(_first_row(out)[8])
    assert 2 * 20.9e9 / 2**30 < peak <= (0.92 * 80e9 - 1.5 * 2**30) / 2**30
