#!/usr/bin/env python
"""Core attention of one packed micro-batch: per-row SDPA calls vs one block-diagonal mask.

    python tools/bench_packed_attention.py [--rows 4,16] [--repeat 5] [--threads 2]

Packed rows must not attend to each other. Two ways to do that with
`torch.nn.functional.scaled_dot_product_attention` on a packed [1, heads, L, d] micro-batch:

* ``per-row``: one causal SDPA call per row (what `models.attention.SDPAttention` does): Σ lᵢ²
  scores, the fused kernel (no mask);
* ``block mask``: one call over all L positions with an additive [L, L] block-diagonal causal
  mask: L² scores, and the mask itself (L² floats);

and, for scale, the padded batch the packing replaces (``padded``: [rows, heads, T, d], causal,
T = the longest row). Row lengths are drawn from the long-tailed distribution of
``tools/make_bench_data.py`` (log-normal, median ~450 tokens per row, capped at 1024). Shapes are
the benchmark model's: 8 query / 4 KV heads of 64 channels, fp32, forward + backward. Times
are medians over ``--repeat`` runs; the mask column is the memory of the mask alone.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F


def _row_lengths(rows: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    # Prompt and completion log-normal (medians 150 / 250, sigma 0.7), as make_bench_data.py.
    normal = torch.randn(rows, 2, generator=g) * 0.7
    medians = torch.tensor([150.0, 250.0])
    lengths = (medians * normal.exp()).round().clamp(min=1).sum(-1).clamp(max=1024)
    return [int(n) for n in lengths]


def _time(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _fwd_bwd(q, k, v, **kwargs) -> None:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs).sum().backward()


def measure(rows: int, repeat: int, heads: int = 8, groups: int = 4, dim: int = 64) -> dict:
    lengths = _row_lengths(rows, seed=rows)
    total, longest = sum(lengths), max(lengths)
    g = torch.Generator().manual_seed(0)

    def qkv(length: int, batch: int = 1):
        return (
            torch.randn(batch, heads, length, dim, generator=g),
            torch.randn(batch, groups, length, dim, generator=g),
            torch.randn(batch, groups, length, dim, generator=g),
        )

    q, k, v = qkv(total)

    def per_row() -> None:
        qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
        outs = [
            F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True)
            for a, b, c in zip(*(t.split(lengths, dim=2) for t in (qs, ks, vs)))
        ]
        torch.cat(outs, dim=2).sum().backward()

    row = torch.repeat_interleave(torch.arange(rows), torch.tensor(lengths))
    pos = torch.arange(total)
    allowed = (row[:, None] == row[None, :]) & (pos[None, :] <= pos[:, None])
    mask = torch.zeros(total, total).masked_fill(~allowed, -math.inf)

    def block_mask() -> None:
        _fwd_bwd(q, k, v, attn_mask=mask)

    pq, pk, pv = qkv(longest, rows)

    def padded() -> None:
        _fwd_bwd(pq, pk, pv, is_causal=True)

    return {
        "rows": rows,
        "tokens": total,
        "padded_tokens": rows * longest,
        "per_row_s": _time(per_row, repeat),
        "block_mask_s": _time(block_mask, repeat),
        "padded_s": _time(padded, repeat),
        "mask_mib": mask.numel() * mask.element_size() / 2**20,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="4,16", help="rows per micro-batch (comma-separated)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per variant")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"{'rows':>5} {'tokens':>7} {'padded':>7} {'per-row (s)':>12} {'block mask (s)':>15} "
        f"{'padded (s)':>11} {'mask (MiB)':>11}"
    )
    for rows in (int(r) for r in args.rows.split(",")):
        r = measure(rows, args.repeat)
        print(
            f"{r['rows']:>5} {r['tokens']:>7} {r['padded_tokens']:>7} {r['per_row_s']:>12.4f} "
            f"{r['block_mask_s']:>15.4f} {r['padded_s']:>11.4f} {r['mask_mib']:>11.1f}"
        )
    print("(one attention layer's core attention, forward + backward, fp32, median)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
