"""The peak FLOP/s MFU is reported against (`megatron_kto.logging.peak_flops`): which GEMM
shapes a stated architecture has, the best-of-N timing rule, and the order of sources."""

from __future__ import annotations

import pytest
import torch

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.logging.peak_flops import (
    MIN_TRIALS,
    GemmShape,
    best_of_trials,
    model_gemm_shapes,
    resolve_peak,
)


def _shapes(shapes: list[GemmShape]) -> dict[str, tuple[int, int, int]]:
    return {s.name: (s.rows, s.inner, s.cols) for s in shapes}


def test_gemm_shapes_of_a_llama_style_block() -> None:
    """hidden 512, ffn 1536, 8 heads of 64, 4 KV groups, SwiGLU, vocab 32000, 4096 rows:
    QKV 512 -> (8 + 2*4)*64 = 1024; proj 8*64 = 512 -> 512; fc1 512 -> 2*1536 = 3072 (gate and
    up fused); fc2 1536 -> 512; output 512 -> 32000."""
    arch = GPTArchitecture(
        hidden_size=512, ffn_hidden_size=1536, num_attention_heads=8, num_query_groups=4
    )
    assert _shapes(model_gemm_shapes(arch, 32000, rows=4096)) == {
        "linear_qkv": (4096, 512, 1024),
        "linear_proj": (4096, 512, 512),
        "linear_fc1": (4096, 512, 3072),
        "linear_fc2": (4096, 1536, 512),
        "output_layer": (4096, 512, 32000),
    }
    # TP=2: column-parallel layers halve their outputs, row-parallel ones their inputs.
    assert _shapes(model_gemm_shapes(arch, 32000, rows=4096, tensor_parallel=2)) == {
        "linear_qkv": (4096, 512, 512),
        "linear_proj": (4096, 256, 512),
        "linear_fc1": (4096, 512, 1536),
        "linear_fc2": (4096, 768, 512),
        "output_layer": (4096, 512, 16000),
    }


def test_gemm_shapes_are_listed_once_and_count_two_flops_per_multiply_add() -> None:
    """GeLU MHA with ffn = hidden = 64, kv_channels 32 x 2 heads: proj (64 -> 64), fc1 and fc2
    are one shape; QKV is 64 -> 3*64."""
    arch = GPTArchitecture(
        hidden_size=64, ffn_hidden_size=64, num_attention_heads=2, activation="gelu"
    )
    shapes = model_gemm_shapes(arch, 128, rows=10)
    assert _shapes(shapes) == {
        "linear_qkv": (10, 64, 192),
        "linear_proj": (10, 64, 64),
        "output_layer": (10, 64, 128),
    }
    assert shapes[0].flops == 2 * 10 * 64 * 192


class _ScriptedClock:
    """A clock whose consecutive start/stop pairs are `durations` apart."""

    def __init__(self, durations: list[float]) -> None:
        self.times = [t for i, d in enumerate(durations) for t in (10.0 * i, 10.0 * i + d)]

    def __call__(self) -> float:
        return self.times.pop(0)


def test_best_of_trials_keeps_the_fastest_timed_trial_after_untimed_warm_up() -> None:
    calls = []
    seconds = best_of_trials(
        lambda: calls.append(1), trials=6, warmup=3, clock=_ScriptedClock([5, 3, 4, 0.5, 2, 7])
    )
    assert seconds == 0.5
    assert len(calls) == 3 + 6  # warm-up calls are run but not timed (the clock ran out else)


def test_best_of_trials_refuses_too_few_trials() -> None:
    with pytest.raises(ValueError, match=f"at least {MIN_TRIALS}"):
        best_of_trials(lambda: None, trials=MIN_TRIALS - 1, warmup=1)


def test_a_stated_peak_wins_and_is_not_measured() -> None:
    # No shapes to measure: resolving would fail if it measured anything.
    peak = resolve_peak(3.5e14, "cpu", torch.float32, shapes=[])
    assert peak.flops == 3.5e14
    assert peak.source == "stated (trainer.peak_flops_per_device)"


def test_without_a_stated_or_datasheet_peak_the_model_shapes_are_measured() -> None:
    arch = GPTArchitecture(hidden_size=64, ffn_hidden_size=128, num_attention_heads=4)
    shapes = model_gemm_shapes(arch, 384, rows=64)
    peak = resolve_peak(None, "cpu", torch.float32, shapes)
    assert peak.flops > 0
    assert peak.source.startswith("measured: best of 5 trials over the model's 5 GEMM shapes")
    assert any(f"{s.name} {s.rows}x{s.inner}x{s.cols}" in peak.source for s in shapes)
