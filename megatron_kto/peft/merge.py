"""Merging LoRA adapters into a base weight: one pure function, `merge_lora`.

merged = W + scale·B·A for a plain linear. A fused megatron linear holds one (A, B) pair per
Hugging Face projection — `linear_qkv` = q/k/v, a gated `linear_fc1` = gate/up — and the
products are laid out as its weight is, with the conversion table's own `fuse_qkv` (per query
group: its query heads, key head, value head) and `fuse_fc1` ([gate; up]); a projection without
an adapter adds zero rows. The layout facts are the adapter's `lora.FusedLayout`.

Plain tensors in, one tensor out: no model, no process group, no config. The product is taken in
float32 and cast to W's dtype once, before the add.

Callers: `hf_peft.merge_and_strip` (the `tools/convert_checkpoint.py export --merge-lora` path,
`hf_writer.lora_export.merged_loader`) on a TP=1 model's weights, and the training-time writer's
`hf_merged/` (`hf_writer.output`, `exp_manager.save_hf_merged`) on tensor-parallel-gathered
weights and adapters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_kto.conversion.mappings import fuse_fc1, fuse_qkv
from megatron_kto.peft.hybrid_layout import HYBRID_LAYOUTS, fuse_blocks, projection_rows
from megatron_kto.peft.lora import FusedLayout

#: A linear that is one projection.
SINGLE = FusedLayout("single")

#: One projection's full (unsharded) adapter: (lora_A [r, in], lora_B [out, r]).
Pair = tuple[torch.Tensor, torch.Tensor]


def merge_lora(
    weight: torch.Tensor,
    pairs: Sequence[Pair | None],
    scale: float,
    layout: FusedLayout = SINGLE,
) -> torch.Tensor:
    """`weight` with its adapters merged in: W + (scale·B·A laid out as W), in W's dtype.

    Args:
        weight: the linear's full base weight [out, in] (megatron's fused layout).
        pairs: one entry per projection of the linear, in fused order (q, k, v; gate, up; or
            the one projection): its (lora_A [r, in], lora_B [out_p, r]), or None for a
            projection without an adapter (it adds zero). At least one is not None.
        scale: lora_alpha / r.
        layout: how the linear fuses its projections (`kind` 'single', 'qkv' or 'fc1'; for
            'qkv' the query groups, heads per group and head dim; a hybrid model's 'gated_qkv' /
            'deltanet_in_proj', `hybrid_layout`).

    Returns:
        A new tensor, `weight` + the delta cast to `weight.dtype` (`weight` is not modified).

    Raises:
        ValueError: no adapter, a number of entries the layout does not have, or a delta whose
            shape is not the weight's.
    """
    delta = _delta(pairs, scale, layout)
    if delta.shape != weight.shape:
        raise ValueError(
            f"LoRA merge: the adapters make a {tuple(delta.shape)} update for a "
            f"{tuple(weight.shape)} weight ({layout.kind} layout)"
        )
    return weight + delta.to(weight.dtype)


def _delta(pairs: Sequence[Pair | None], scale: float, layout: FusedLayout) -> torch.Tensor:
    """scale·B·A of every projection (float32), fused as the base weight is."""
    expected = {"single": 1, "fc1": 2, "qkv": 3, "gated_qkv": 3}.get(layout.kind, len(pairs))
    if len(pairs) != expected:
        raise ValueError(
            f"LoRA merge: a {layout.kind} linear has {expected} projections, got {len(pairs)}"
        )
    deltas = [None if p is None else (p[1].float() @ p[0].float()) * scale for p in pairs]
    like = next((d for d in deltas if d is not None), None)
    if like is None:
        raise ValueError("LoRA merge: the linear has no adapter")
    if layout.kind == "single":
        return like
    if layout.kind in HYBRID_LAYOUTS:
        rows = projection_rows(layout, len(deltas), 1)
        blocks = [
            like.new_zeros(n, like.shape[1]) if x is None else x for x, n in zip(deltas, rows)
        ]
        return fuse_blocks(layout, blocks, 1)
    if layout.kind == "fc1":
        gate, up = (torch.zeros_like(like) if d is None else d for d in deltas)
        return fuse_fc1(gate, up)
    d, groups = layout.head_dim, layout.groups
    rows = (groups * layout.heads_per_group * d, groups * d, groups * d)
    q, k, v = (
        like.new_zeros(n, like.shape[1]) if x is None else x
        for x, n in zip(deltas, rows, strict=True)
    )
    return fuse_qkv(q, k, v, heads=groups * layout.heads_per_group, groups=groups)
