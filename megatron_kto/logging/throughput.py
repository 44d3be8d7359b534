"""Tokens/s and model FLOPs utilisation (MFU) for KTO / DPO steps.

Conventions (those of the PaLM paper, appendix B, and of Megatron-LM's MFU):

* Model FLOPs count the matmuls of the model only (2 FLOPs per multiply-add); layer norms,
  softmax, activations, biases and the embedding lookup are ignored.
* Attention scores are counted for the full s × s score matrix, not the causal half.
* A backward pass costs twice its forward, so forward+backward ≈ 3× forward. Activation
  recomputation is *not* counted (that would be hardware FLOPs utilisation, HFU).
* MFU = achieved model FLOP/s ÷ (peak FLOP/s per device × number of devices).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import Any

import torch

FWD_BWD_MULTIPLIER = 3.0  # forward (1×) + backward (2×)


def gpt_flops_per_token(
    num_layers: int,
    hidden: int,
    ffn_hidden: int,
    num_heads: int,
    num_query_groups: int,
    kv_channels: int,
    vocab: int,
    seq_len: int,
    swiglu: bool,
) -> int:
    """Forward-pass model FLOPs per token of a GPT / Llama decoder.

    With h = hidden, f = ffn_hidden, n = num_heads, g = num_query_groups (GQA; g = n for plain
    multi-head attention), d = kv_channels (head dim), s = seq_len, V = vocab, per layer:

    * QKV projection   h → (n + 2g)·d        2·h·(n + 2g)·d
    * output projection n·d → h              2·n·d·h
    * attention scores QKᵀ, then A·V          2·n·d·s + 2·n·d·s = 4·n·d·s
    * MLP h → f → h (SwiGLU: two h → f)      2·2·h·f, or 3·2·h·f with SwiGLU

    plus the output layer (logits) 2·h·V once. That is 2 × (matmul parameters) + attention.

    Returns:
        FLOPs for one token's forward pass (an int; multiply by 3 for forward+backward).
    """
    qkv = 2 * hidden * (num_heads + 2 * num_query_groups) * kv_channels
    out_proj = 2 * num_heads * kv_channels * hidden
    mlp = (3 if swiglu else 2) * 2 * hidden * ffn_hidden
    logits = 2 * hidden * vocab
    attention = attention_flops_per_position(num_layers, num_heads, kv_channels) * seq_len
    return num_layers * (qkv + out_proj + mlp) + attention + logits


def attention_flops_per_position(num_layers: int, num_heads: int, kv_channels: int) -> int:
    """Attention-score FLOPs of one token's forward pass per position of its sequence:
    4·n·d per layer (QKᵀ and A·V; the `attention` term of `gpt_flops_per_token` is this × s)."""
    return num_layers * 4 * num_heads * kv_channels


@dataclass(frozen=True)
class ModelFlops:
    """Forward model FLOPs of rows of any length: a token costs `per_token` (projections, MLP,
    output layer) plus `per_position` for every position of its own row (attention scores).

    A row of length l thus costs per_token·l + per_position·l² — the work of the model on that
    row, whatever padding or packing the run uses (the convention of `gpt_flops_per_token`, with
    the row's own length as s, rather than the configured maximum).
    """

    per_token: float
    per_position: float

    def rows(self, lengths: torch.Tensor) -> float:
        """Forward FLOPs of rows of `lengths` (a [rows] integer tensor on the host)."""
        lengths = lengths.double()
        return float(self.per_token * lengths.sum() + self.per_position * (lengths**2).sum())


def moe_flops_per_token(arch: Any) -> float:
    """What a mixture-of-experts model's forward FLOPs per token differ by from the dense count
    (a dense MLP of `ffn_hidden_size` in every layer): each MoE layer runs its router (2·h·E),
    the k experts a token is routed to and the shared expert (2·h·f·(3 for SwiGLU, else 2)
    each) and the shared expert's gate (2·h) instead. 0 for a dense model."""
    experts = getattr(arch, "num_moe_experts", None)
    if not experts:
        return 0.0
    h = arch.hidden_size
    per_hidden = (
        2 * h * (3 if arch.activation in ("swiglu", "geglu", "quick_geglu") else 2)
    )  # MLP FLOPs per f
    moe = arch.moe_router_topk * per_hidden * (arch.moe_ffn_hidden_size or arch.ffn_hidden_size)
    moe += 2 * h * experts + per_hidden * (arch.moe_shared_expert_intermediate_size or 0)
    moe += 2 * h if arch.moe_shared_expert_gate else 0
    layers = sum(arch.is_moe_layer(i) for i in range(arch.num_layers))
    return float(layers * (moe - per_hidden * arch.ffn_hidden_size))


def mla_flops(arch: Any) -> tuple[float, float]:
    """What multi-latent attention (DeepSeek-V3) changes in the dense counts: (per token, per
    position). Its projections — q (h → n·qh, or h → q_lora → n·qh), kv down (h → kv_lora +
    rope), kv up (kv_lora → n·(nope + v)), output (n·v → h) — replace QKV and the output
    projection; scores and A·V cost 2·n·qh + 2·n·v per position instead of 4·n·d. (0, 0) for
    any other attention."""
    if not getattr(arch, "multi_latent_attention", False):
        return 0.0, 0.0
    h, n = arch.hidden_size, arch.num_attention_heads
    d, g = arch.kv_channels or h // n, arch.num_query_groups or n
    qh, v = arch.qk_nope_head_dim + arch.qk_rope_head_dim, arch.v_head_dim
    q = h * n * qh if arch.q_lora_rank is None else arch.q_lora_rank * (h + n * qh)
    kv = h * (arch.kv_lora_rank + arch.qk_rope_head_dim)
    kv += arch.kv_lora_rank * n * (arch.qk_nope_head_dim + v)
    mla = 2 * (q + kv + n * v * h)
    dense = 2 * h * (n + 2 * g) * d + 2 * n * d * h
    per_position = 2 * n * (qh + v) - 4 * n * d
    return float(arch.num_layers * (mla - dense)), float(arch.num_layers * per_position)


def architecture_flops(arch: Any, padded_vocab: int) -> ModelFlops:
    """`ModelFlops` of a `config.architecture.GPTArchitecture` with its padded vocabulary (terms
    as in `gpt_flops_per_token`; an MoE layer's MLP as `moe_flops_per_token` says: the FLOPs a
    token really uses, not those of every expert)."""
    heads = arch.num_attention_heads
    kv_channels = arch.kv_channels or arch.hidden_size // heads
    per_token = gpt_flops_per_token(
        num_layers=arch.num_layers,
        hidden=arch.hidden_size,
        ffn_hidden=arch.ffn_hidden_size,
        num_heads=heads,
        num_query_groups=arch.num_query_groups or heads,
        kv_channels=kv_channels,
        vocab=padded_vocab,
        seq_len=0,
        swiglu=arch.activation in ("swiglu", "geglu", "quick_geglu"),
    )
    mla_token, mla_position = mla_flops(arch)
    return ModelFlops(
        per_token=float(per_token) + moe_flops_per_token(arch) + mla_token,
        per_position=float(attention_flops_per_position(arch.num_layers, heads, kv_channels))
        + mla_position,
    )


def kto_pass_tokens(
    sample_tokens: float, kl_tokens: float, reference_forward: bool = True
) -> tuple[float, float]:
    """(forward-only tokens, forward+backward tokens) of one KTO step — or, given the rows'
    forward FLOPs (`ModelFlops.rows`) instead of their tokens, the same split of FLOPs.

    A step runs the reference model forward on the sample and KL rows (unless the reference
    log-probs were precomputed), the policy forward-only on the KL rows, and the policy
    forward+backward on the sample rows (DESIGN.md section 1, "Efficiency").
    """
    forward_only = kl_tokens + (sample_tokens + kl_tokens if reference_forward else 0)
    return forward_only, sample_tokens


def dpo_pass_tokens(
    pair_tokens: float, reference_forward: bool = True, policy_forward: bool = False
) -> tuple[float, float]:
    """(forward-only tokens, forward+backward tokens) of one DPO step (or FLOPs, as for
    `kto_pass_tokens`): reference forward on the chosen and rejected rows (unless precomputed),
    a forward-only policy pass on them first for a loss that sorts over the global batch
    (`policy_forward`), policy forward+backward on the same rows."""
    forward_only = (pair_tokens if reference_forward else 0) + (
        pair_tokens if policy_forward else 0
    )
    return forward_only, pair_tokens


@dataclass(frozen=True)
class ThroughputStats:
    """One step's throughput.

    Attributes:
        tokens_per_sec: forward+backward (training) tokens per second, all devices together.
        model_flops_per_sec: achieved model FLOP/s, all devices together.
        mfu: model FLOPs utilisation in [0, 1] (can exceed 1 only if the peak is understated).
    """

    tokens_per_sec: float
    model_flops_per_sec: float
    mfu: float


class ThroughputMeter:
    """Turns a step's token counts and wall time into tokens/s and MFU.

    Token counts are global (summed over data-parallel ranks) and should be the positions the
    model actually ran (padded sequence lengths included) for the MFU to reflect the work done.

    Args:
        flops_per_token: forward FLOPs per token, e.g. from :func:`gpt_flops_per_token`.
        peak_flops_per_device: peak FLOP/s of one device in the training dtype (from config,
            or :func:`measure_peak_flops`).
        world_size: number of devices (TP × PP × DP).
    """

    def __init__(
        self, flops_per_token: float, peak_flops_per_device: float, world_size: int
    ) -> None:
        if peak_flops_per_device <= 0 or world_size < 1:
            raise ValueError(
                f"need peak_flops_per_device > 0 and world_size >= 1, got "
                f"{peak_flops_per_device} and {world_size}"
            )
        self.flops_per_token = float(flops_per_token)
        self.peak_flops_per_device = float(peak_flops_per_device)
        self.world_size = world_size

    def step_flops(self, forward_only_tokens: int, train_tokens: int) -> float:
        """Model FLOPs of one step: fwd-only tokens × 1 + fwd+bwd tokens × 3, × FLOPs/token."""
        passes = forward_only_tokens + FWD_BWD_MULTIPLIER * train_tokens
        return self.flops_per_token * passes

    def measure(
        self, train_tokens: int, step_time_s: float, forward_only_tokens: int = 0
    ) -> ThroughputStats:
        """Throughput of a step that took ``step_time_s`` seconds of wall time.

        Raises:
            ValueError: if ``step_time_s`` is not positive.
        """
        if not step_time_s > 0:
            raise ValueError(f"step_time_s must be > 0, got {step_time_s}")
        flops_per_sec = self.step_flops(forward_only_tokens, train_tokens) / step_time_s
        return ThroughputStats(
            tokens_per_sec=train_tokens / step_time_s,
            model_flops_per_sec=flops_per_sec,
            mfu=flops_per_sec / (self.peak_flops_per_device * self.world_size),
        )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize()


def measure_peak_flops(
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    size: int | None = None,
    min_time_s: float = 0.2,
) -> float:
    """Measured dense-matmul FLOP/s of one device: a one-off timed square matmul loop.

    This is the *achievable* peak (below the vendor's datasheet number), so MFU against it
    reads higher; pass the datasheet peak in the config when comparing with published MFU.

    Args:
        device: the device to measure (the caller's; nothing is picked here).
        dtype: matmul dtype (the training dtype).
        size: matrix side; default 256 on CPU (fast, small), 8192 on accelerators.
        min_time_s: approximate duration of the timed loop (plus a short warm-up).

    Returns:
        FLOP/s (2·size³ per matmul).
    """
    device = torch.device(device)
    if size is None:
        size = 256 if device.type == "cpu" else 8192
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=g)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=g)
    out = torch.empty(size, size, device=device, dtype=dtype)

    def run(iters: int) -> float:
        _synchronize(device)
        start = time.perf_counter()
        for _ in range(iters):
            torch.matmul(a, b, out=out)
        _synchronize(device)
        return time.perf_counter() - start

    # Warm-up (kernel selection, allocator, thread pools), then calibrate a chunk of ~1/8 of
    # the budget and keep the fastest chunk: a peak is a best case, and on a shared machine
    # the average is dragged down by whatever else runs.
    run(2)
    per_iter = max(run(2) / 2, 1e-9)
    chunk = max(1, math.ceil(min_time_s / 8 / per_iter))
    best = math.inf
    spent = 0.0
    while spent < min_time_s:
        elapsed = run(chunk)
        spent += elapsed
        best = min(best, elapsed / chunk)
    return 2.0 * size**3 / max(best, 1e-12)


#: Dense (no sparsity) peak TFLOP/s from NVIDIA's datasheets, per GPU: (name pattern, bf16/fp16,
#: tf32, fp32). The first matching pattern wins (H100 NVL / PCIe before the SXM default).
GPU_PEAK_TFLOPS: tuple[tuple[str, float, float, float], ...] = (
    (r"H100.*NVL", 835.5, 417.5, 60.0),
    (r"H100.*PCIe", 756.5, 378.0, 51.2),
    (r"H100", 989.4, 494.7, 66.9),
    (r"H200", 989.4, 494.7, 66.9),
    (r"A100", 312.0, 156.0, 19.5),
    (r"L40S", 362.1, 183.0, 91.6),
    (r"\bL4\b", 121.0, 60.0, 30.3),
)


def datasheet_peak_flops(device_name: str, dtype: torch.dtype, tf32: bool) -> float | None:
    """A GPU's datasheet dense peak FLOP/s for matmuls in `dtype`, or None if not in the table.

    Args:
        device_name: `torch.cuda.get_device_name()`, e.g. "NVIDIA H100 80GB HBM3".
        dtype: the training dtype (bf16/fp16 share the tensor-core peak).
        tf32: fp32 matmuls run on TF32 tensor cores (torch's allow_tf32).
    """
    for pattern, half, tf32_peak, fp32 in GPU_PEAK_TFLOPS:
        if re.search(pattern, device_name):
            if dtype in (torch.bfloat16, torch.float16):
                return half * 1e12
            return (tf32_peak if tf32 else fp32) * 1e12
    return None


def peak_flops_per_device(device: torch.device | str, dtype: torch.dtype) -> float | None:
    """The peak FLOP/s that MFU is reported against, or None where it is not known.

    Known means a GPU's datasheet figure for the run's dtype (`datasheet_peak_flops`). A CPU
    has none we can trust: a timed matmul (`measure_peak_flops`) is not an upper bound on a
    machine whose cores other processes share, so an MFU against it can read above 1. Pass
    `trainer.peak_flops_per_device` to report MFU there.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    tf32 = torch.backends.cuda.matmul.allow_tf32
    return datasheet_peak_flops(torch.cuda.get_device_name(device), dtype, tf32)
