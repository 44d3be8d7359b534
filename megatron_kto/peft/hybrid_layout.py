"""How hybrid models' fused linears (Qwen3-Next, Qwen3.5) are made of their Hugging Face
projections, for LoRA: one pure function over row blocks, shared by the adapter's forward
(`lora.LoRALinear`, this rank's B matrices) and merging (`merge.merge_lora`, whole B·A products).

* `gated_qkv` (gated full attention's `linear_qkv`): HF `q_proj` rows are per query head
  [query | gate], `k_proj` / `v_proj` per key-value head; megatron's rows are per query group
  [its queries | their gates | key | value] (`conversion.deltanet.fuse_gated_qkv`).
* `deltanet_in_proj` (DeltaNet's `in_proj`): megatron's rows on a TP rank are [q | k | v | z | beta
  | alpha] of its heads, from Qwen3-Next's `in_proj_qkvz` + `in_proj_ba` (grouped per key head,
  `conversion.deltanet.split_hf_qkvz_ba`) or Qwen3.5's `in_proj_qkv` / `in_proj_z` / `in_proj_b`
  / `in_proj_a`.

A TP rank's share of every projection here is one contiguous block of its rows (whole query
groups, whole key heads with the value heads they serve) — except Qwen3.5's `in_proj_qkv`, whose
q, k and v are three blocks: its B is stored sharded like any other (a contiguous block of the HF
rows) and the adapter's forward gathers it and takes its three blocks (`LoRALinear`).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_kto.conversion.deltanet import DeltaNetShape, fuse_gated_qkv, split_hf_qkvz_ba

#: Fused layouts of this module (`lora.FusedLayout.kind`).
HYBRID_LAYOUTS = ("gated_qkv", "deltanet_in_proj")


def deltanet_shape(layout: Any, tp: int) -> DeltaNetShape:
    """This rank's DeltaNet heads (the layout's `deltanet` shape over `tp` ranks)."""
    s = layout.deltanet
    return DeltaNetShape(s.key_heads // tp, s.value_heads // tp, s.key_dim, s.value_dim)


def projection_rows(layout: Any, count: int, tp: int) -> list[int]:
    """Output rows of each of the `count` projections on one of `tp` ranks, in fused order."""
    if layout.kind == "gated_qkv":
        d, groups = layout.head_dim, layout.groups // tp
        return [groups * layout.heads_per_group * 2 * d, groups * d, groups * d]
    s = deltanet_shape(layout, tp)
    qk, v, hv = s.key_heads * s.key_dim, s.value_heads * s.value_dim, s.value_heads
    return [2 * qk + 2 * v, 2 * hv] if count == 2 else [2 * qk + v, v, hv, hv]


def fuse_blocks(layout: Any, blocks: list[torch.Tensor], tp: int) -> torch.Tensor:
    """One rank's fused rows from its row block of each projection (fused order, any trailing
    width): laid out as the base linear's output rows."""
    if layout.kind == "gated_qkv":
        groups = layout.groups // tp
        return fuse_gated_qkv(*blocks, heads=groups * layout.heads_per_group, groups=groups)
    s = deltanet_shape(layout, tp)
    if len(blocks) == 2:
        parts = split_hf_qkvz_ba(*blocks, s)
        return torch.cat([parts[n] for n in "qkvzba"])
    qkv, z, b, a = blocks
    qk = s.key_heads * s.key_dim
    return torch.cat([*qkv.split([qk, qk, s.value_heads * s.value_dim]), z, b, a])
