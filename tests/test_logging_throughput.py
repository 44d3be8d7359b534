"""FLOPs-per-token formula, MFU arithmetic and the peak-FLOPs probe."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from megatron_kto.logging import (
    ThroughputMeter,
    architecture_flops,
    dpo_pass_tokens,
    gpt_flops_per_token,
    kto_pass_tokens,
    measure_peak_flops,
)

TINY = dict(
    num_layers=2,
    hidden=8,
    ffn_hidden=16,
    num_heads=2,
    num_query_groups=1,
    kv_channels=4,
    vocab=10,
    seq_len=5,
)


def test_flops_hand_count_gelu() -> None:
    """L = 2, h = 8, f = 16, n = 2 heads, g = 1 group, d = 4, V = 10, s = 5, plain MLP.

    per layer: QKV 2·8·(2 + 2·1)·4 = 256; out proj 2·(2·4)·8 = 128;
               scores + A·V 4·2·4·5 = 160; MLP 2·2·8·16 = 512  → 1056
    2 layers → 2112; logits 2·8·10 = 160 → 2272
    """
    assert gpt_flops_per_token(**TINY, swiglu=False) == 2272


def test_flops_hand_count_swiglu() -> None:
    """Same shape with SwiGLU: MLP 3·2·8·16 = 768 → per layer 1312, ×2 = 2624, + 160 = 2784."""
    assert gpt_flops_per_token(**TINY, swiglu=True) == 2784


@pytest.mark.parametrize("swiglu", [False, True])
def test_flops_equal_two_per_matmul_parameter_plus_attention(swiglu: bool) -> None:
    """Independent count: 2 × the weights of the model's Linear layers + 4·n·d·s per layer."""
    h, f, n, g, d, v, s = 8, 16, 2, 1, 4, 10, 5
    layer = nn.ModuleList(
        [
            nn.Linear(h, (n + 2 * g) * d, bias=False),  # fused QKV
            nn.Linear(n * d, h, bias=False),  # attention output
            nn.Linear(h, (2 if swiglu else 1) * f, bias=False),  # fc1 (gate + up for SwiGLU)
            nn.Linear(f, h, bias=False),  # fc2
        ]
    )
    per_layer_params = sum(p.numel() for p in layer.parameters())
    head_params = nn.Linear(h, v, bias=False).weight.numel()
    expected = 2 * (2 * per_layer_params + head_params) + 2 * (4 * n * d * s)
    assert gpt_flops_per_token(**TINY, swiglu=swiglu) == expected


def test_model_flops_count_each_row_at_its_own_length() -> None:
    """The TINY shape, rows of 5 and 2 tokens: per position 4·2·4 = 32 per layer × 2 layers = 64;
    per token 2272 − 64·5 (attention at s = 5) = 1952; the 5-token row costs 5·1952 + 64·25 =
    11360 (= 5 × `gpt_flops_per_token` at s = 5), the 2-token row 2·1952 + 64·4 = 4160."""
    arch = SimpleNamespace(
        num_layers=2, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2,
        num_query_groups=1, kv_channels=4, activation="gelu",
    )  # fmt: skip
    flops = architecture_flops(arch, padded_vocab=10)
    assert (flops.per_token, flops.per_position) == (1952, 64)
    assert flops.rows(torch.tensor([5])) == 5 * gpt_flops_per_token(**TINY, swiglu=False)
    assert flops.rows(torch.tensor([5, 2])) == 11360 + 4160


def test_mfu_arithmetic() -> None:
    """1e9 FLOPs/token; 3000 forward-only tokens, 1000 fwd+bwd tokens, 2 s step, 4 devices
    at 1e12 FLOP/s each:
    step FLOPs = 1e9 · (3000 + 3·1000) = 6e12 → 3e12 FLOP/s → MFU = 3e12 / 4e12 = 0.75;
    tokens/s = 1000 / 2 = 500.
    """
    meter = ThroughputMeter(flops_per_token=1e9, peak_flops_per_device=1e12, world_size=4)
    stats = meter.measure(train_tokens=1000, step_time_s=2.0, forward_only_tokens=3000)
    assert stats.tokens_per_sec == pytest.approx(500.0)
    assert stats.model_flops_per_sec == pytest.approx(3e12)
    assert stats.mfu == pytest.approx(0.75)


def test_step_token_structure() -> None:
    """KTO, 100 sample tokens, 120 KL tokens: ref fwd 220 + policy KL fwd 120 = 340 forward-only,
    100 fwd+bwd; without a reference forward: 120. DPO: 300 pair tokens → (300, 300)."""
    assert kto_pass_tokens(100, 120) == (340, 100)
    assert kto_pass_tokens(100, 120, reference_forward=False) == (120, 100)
    assert dpo_pass_tokens(300) == (300, 300)
    assert dpo_pass_tokens(300, reference_forward=False) == (0, 300)


def test_meter_validation() -> None:
    with pytest.raises(ValueError, match="peak_flops_per_device"):
        ThroughputMeter(1.0, 0.0, 1)
    with pytest.raises(ValueError, match="step_time_s"):
        ThroughputMeter(1.0, 1.0, 1).measure(train_tokens=1, step_time_s=0.0)


def test_measure_peak_flops_cpu_is_quick_and_positive() -> None:
    start = time.perf_counter()
    peak = measure_peak_flops("cpu", torch.float32, min_time_s=0.1)
    assert time.perf_counter() - start < 5.0
    assert peak > 1e6  # any CPU does far more than a megaflop per second


def test_mfu_peak_is_known_only_from_a_datasheet_or_the_config():
    """MFU must never read above 1: on a CPU there is no peak to trust (a timed matmul on a
    shared machine is not an upper bound), so none is reported; GPUs use datasheet figures in
    the run's dtype (dense, no sparsity), TF32 when fp32 matmuls use it."""
    from megatron_kto.logging.throughput import datasheet_peak_flops, peak_flops_per_device

    assert peak_flops_per_device("cpu", torch.float32) is None
    assert peak_flops_per_device("cpu", torch.bfloat16) is None
    h100 = "NVIDIA H100 80GB HBM3"
    assert datasheet_peak_flops(h100, torch.bfloat16, tf32=False) == pytest.approx(989.4e12)
    assert datasheet_peak_flops(h100, torch.float16, tf32=False) == pytest.approx(989.4e12)
    assert datasheet_peak_flops(h100, torch.float32, tf32=True) == pytest.approx(494.7e12)
    assert datasheet_peak_flops(h100, torch.float32, tf32=False) == pytest.approx(66.9e12)
    assert datasheet_peak_flops("NVIDIA H100 PCIe", torch.bfloat16, False) == pytest.approx(
        756.5e12
    )
    assert datasheet_peak_flops("NVIDIA A100-SXM4-80GB", torch.bfloat16, False) == 312e12
    assert datasheet_peak_flops("NVIDIA L40S", torch.bfloat16, False) == pytest.approx(362.1e12)
    assert datasheet_peak_flops("NVIDIA L4", torch.bfloat16, False) == 121e12
    assert datasheet_peak_flops("NVIDIA GeForce GTX 1080", torch.float32, False) is None


def _moe_configs() -> dict[str, object]:
    """Tiny Qwen3-MoE with a dense layer (no shared expert) and Qwen2-MoE (gated shared expert,
    a dense layer), hidden sizes chosen so every term differs."""
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=96, hidden_size=32, intermediate_size=80, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=24,
        num_experts=6, num_experts_per_tok=2, mlp_only_layers=[1],
    )  # fmt: skip
    return {
        "qwen3_moe": Qwen3MoeConfig(head_dim=16, **common),
        "qwen2_moe": Qwen2MoeConfig(shared_expert_intermediate_size=40, **common),
    }


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_moe_flops_equal_what_transformers_multiplies(name: str) -> None:
    """Independent count: torch's FlopCounterMode over a `transformers` MoE forward (eager
    attention, which multiplies the full score matrices as `per_position` counts them; eager
    experts, each multiplying only the tokens routed to it — the counter does not see
    `grouped_mm`) equals `ModelFlops.rows` of the row."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    from megatron_kto.conversion.hf_config import architecture_from_hf

    config = _moe_configs()[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    length = 7
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(torch.randint(0, config.vocab_size, (1, length)))
    arch = architecture_from_hf(config.to_dict(), where=name)
    flops = architecture_flops(arch, padded_vocab=config.vocab_size)
    assert flops.rows(torch.tensor([length])) == counter.get_total_flops()
    dense = architecture_flops(SimpleNamespace(**{**vars(arch), "num_moe_experts": None}), 96)
    assert flops.per_token != dense.per_token  # the MoE layers count differently
