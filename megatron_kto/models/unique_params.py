"""Whole-model sums over parameters that are spread and replicated over the ranks.

Each tensor of the model lives on some ranks and is replicated over others: a dense tensor over
the data-parallel (and context-parallel) ranks and, unless TP-sharded, the TP ranks; a routed
expert's tensor (megatron-core's expert-parallel mark, `allreduce=False`) over the expert-data-
parallel ranks and, unless sharded, the expert-TP ranks — the experts on other EP ranks are other
tensors. With tied embeddings under PP the last stage holds a copy of the embedding.
`counted_here` picks, on each rank, the parameters no other rank also picks, so a sum over them
all-reduced over the world (`world_sum`) counts every tensor of the model once, whatever the
layout (TP, PP, DP, CP, EP, ETP).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate

from megatron_kto.models.builder import unwrap


def _tied_copy(model: torch.nn.Module) -> int | None:
    """id of the last stage's copy of a tied embedding (PP > 1), else None."""
    tied = getattr(model, "share_embeddings_and_output_weights", False)
    if tied and model.post_process and not model.pre_process:
        return id(model.output_layer.weight)
    return None


def counted_here(chunks: list[torch.nn.Module]) -> Iterator[torch.nn.Parameter]:
    """This rank's parameters of `chunks` that no other rank also yields (every parameter
    without a distributed world)."""
    dist = torch.distributed.is_initialized()
    dense_here = not dist or parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
    experts_here = not dist or parallel_state.get_expert_data_parallel_rank() == 0
    expert_tp_rank = parallel_state.get_expert_tensor_parallel_rank() if dist else 0
    for chunk in chunks:
        model = unwrap(chunk)
        copy = _tied_copy(model)
        for p in model.parameters():
            if id(p) == copy:
                continue
            if getattr(p, "allreduce", True):  # dense
                here = dense_here and (not dist or param_is_not_tensor_parallel_duplicate(p))
            else:  # a routed expert's
                sharded = bool(getattr(p, "tensor_model_parallel", False))
                here = experts_here and (sharded or expert_tp_rank == 0)
            if here:
                yield p


def world_sum(values: torch.Tensor) -> torch.Tensor:
    """`values` summed over every rank (a collective over the world; itself without one)."""
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(values)
    return values
