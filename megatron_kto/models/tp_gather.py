"""A whole tensor from its tensor-parallel shards: one all-gather over the given group.

Shared by the training-time Hugging Face writer (`hf_writer.gather`, every table entry) and by
LoRA's adapter output (`peft.hf_peft.full_pair`); a collective, so every rank of the group must
ask for the same tensors in the same order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_kto.conversion.addressing import merge_shards


def gather_tp(
    tensor: torch.Tensor,
    axis: int | None,
    kind: str,
    group: Any,
    sections: list[int] | None = None,
) -> torch.Tensor:
    """The full tensor of which `tensor` is this rank's shard along `axis` over `group` (axis
    None: replicated, returned as is; group None: no group, returned as is — never the default
    group); `kind` "gated_mlp" un-interleaves the per-rank [gate; up] halves, `sections` (see
    `addressing.merge_shards`) the per-rank shares of a DeltaNet tensor's parts."""
    size = dist.get_world_size(group) if group is not None else 1
    if axis is None or size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return merge_shards(parts, axis, kind, sections)
