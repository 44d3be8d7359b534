"""Context parallelism (CP): every row of a micro-batch split over the ranks of the CP group.

A row too long for one GPU's activations is cut along the sequence. Causal attention makes the
cost of a position grow with its index, so a plain split into CP consecutive pieces would leave
the last rank with most of the work. Instead every row (a packed micro-batch's segment, or a
padded micro-batch's [T] row) is padded to a multiple of 2·CP and cut into 2·CP equal chunks;
rank r keeps chunks r and 2·CP−1−r — one early and one late chunk, the same attention work on
every rank. This is the layout megatron-core's RoPE slicing (`get_pos_emb_on_this_cp_rank`) and
Transformer Engine's context-parallel attention (`thd_get_partitioned_indices` for THD) expect.

What follows the split: tokens, labels and position ids (each token keeps its position in its
row); for a packed micro-batch, `PackedRows` keeps the whole segments (`seqlens`, `cu_seqlens`,
`max_seqlen` — what TE and RoPE read) and gains this rank's row ids and positions. Padding added
for the split carries no label (`packing.PAD_VALUES`) and, coming after a row's real tokens,
is never attended to by them.

Per-row statistics are partial on each rank (its chunks' completion tokens) and are summed over
the CP group by `reduce_row_stats` — see its docstring for why the gradient stays right.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from megatron.core import parallel_state, tensor_parallel

from megatron_kto.models.packed_rope import segment_positions
from megatron_kto.models.packing import PACKED, PackedRows

#: Micro-batch keys of [rows, T] tensors that the split follows.
SPLIT_KEYS = ("tokens", "labels", "position_ids")


def context_parallel_size() -> int:
    """CP degree of megatron's parallel state (1 when it is not initialised)."""
    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_context_parallel_world_size()


def row_multiple(cp_size: int, tp_size: int, sequence_parallel: bool) -> int:
    """What every row's length must divide into under CP: 2·CP, times TP under sequence
    parallelism (each rank's 2 chunks are then scattered over the TP ranks)."""
    if cp_size == 1:
        return 1
    return 2 * cp_size * (tp_size if sequence_parallel else 1)


def local_chunks(seqlens: Sequence[int], cp_size: int, cp_rank: int) -> list[tuple[int, int]]:
    """(start, length) in the whole sequence of each chunk this rank keeps, in local order:
    for every segment, its chunk `cp_rank` then its chunk 2·CP−1−`cp_rank`."""
    out, start = [], 0
    for n in seqlens:
        if n % (2 * cp_size):
            raise ValueError(f"a segment of {n} tokens cannot be split into {2 * cp_size} chunks")
        c = n // (2 * cp_size)
        out += [(start + cp_rank * c, c), (start + (2 * cp_size - 1 - cp_rank) * c, c)]
        start += n
    return out


@functools.lru_cache(maxsize=64)
def _local_index_cpu(seqlens: tuple[int, ...], cp_size: int, cp_rank: int) -> torch.Tensor:
    parts = [torch.arange(s, s + c) for s, c in local_chunks(seqlens, cp_size, cp_rank)]
    return torch.cat(parts)


def local_index(
    seqlens: Sequence[int], cp_size: int, cp_rank: int, device: torch.device
) -> torch.Tensor:
    """[Σ seqlens / CP] indices into the whole sequence of the positions this rank keeps."""
    return _local_index_cpu(tuple(int(n) for n in seqlens), cp_size, cp_rank).to(
        device, non_blocking=True
    )


@functools.lru_cache(maxsize=64)
def _global_order_cpu(seqlens: tuple[int, ...], cp_size: int) -> torch.Tensor:
    # The CP ranks' local sequences gathered rank after rank: position p of rank j is entry
    # j * local + p. For every whole-sequence position, the entry that holds it.
    local = sum(seqlens) // cp_size
    order = torch.empty(sum(seqlens), dtype=torch.long)
    for rank in range(cp_size):
        index = _local_index_cpu(seqlens, cp_size, rank)
        order[index] = torch.arange(rank * local, (rank + 1) * local)
    return order


def global_order(seqlens: Sequence[int], cp_size: int, device: torch.device) -> torch.Tensor:
    """[Σ seqlens] permutation taking the rank-major all-gather of the CP ranks' local sequences
    to the whole sequence's order."""
    return _global_order_cpu(tuple(int(n) for n in seqlens), cp_size).to(device, non_blocking=True)


def split_micro_batch(batch: dict, cp_size: int, cp_rank: int) -> dict:
    """This CP rank's part of a micro-batch (packed or padded), as the model takes it.

    Args:
        batch: a micro-batch after packing (`PACKED` set; every segment a multiple of 2·CP) or
            padding ([rows, T] with T a multiple of 2·CP).
        cp_size, cp_rank: the CP group's size and this rank.

    Returns:
        A new micro-batch: `SPLIT_KEYS` tensors cut to this rank's positions ([1, L/CP] or
        [rows, T/CP]); a packed one's `PackedRows` made context-parallel (module docstring).
        The number of scored positions is no longer known on the host (`NUM_SCORED` dropped).
    """
    from megatron_kto.models.schedule import NUM_SCORED

    if cp_size == 1:
        return batch
    packed: PackedRows | None = batch.get(PACKED)
    width = batch["position_ids"].shape[1]
    seqlens = packed.seqlens if packed is not None else (width,)
    device = batch["position_ids"].device
    index = local_index(seqlens, cp_size, cp_rank, device)
    out = {k: v for k, v in batch.items() if k != NUM_SCORED}
    for key in SPLIT_KEYS:
        if key in batch:
            out[key] = batch[key].index_select(1, index)
    if packed is not None:
        positions = segment_positions(packed.cu_seqlens_q, width).index_select(0, index)
        # TE reads the padded bounds under CP (megatron-core passes `cu_seqlens_*_padded`); every
        # segment is already whole there, so both bounds are the same tensor: no padding between
        # sequences, which every TE kernel with CP takes.
        out[PACKED] = PackedRows(
            qkv_format="thd",
            cu_seqlens_q=packed.cu_seqlens_q,
            cu_seqlens_kv=packed.cu_seqlens_kv,
            cu_seqlens_q_padded=packed.cu_seqlens_q,
            cu_seqlens_kv_padded=packed.cu_seqlens_kv,
            max_seqlen_q=packed.max_seqlen_q,
            max_seqlen_kv=packed.max_seqlen_kv,
            seqlens=packed.seqlens,
            num_rows=packed.num_rows,
            row_ids=packed.row_ids.index_select(0, index),
            cp_size=cp_size,
            cp_rank=cp_rank,
            positions=positions.long(),
        )
    return out


def reduce_row_stats(stats: torch.Tensor) -> torch.Tensor:
    """Per-row statistics summed over the CP group: forward all-reduce, backward identity.

    Every CP rank then holds the whole rows' statistics and computes the same loss L from them.
    The gradient each rank sends into its own chunks' log-probs is ∂L/∂(row sum) — exactly the
    derivative of the one loss with respect to that rank's part of the sum — so the ranks'
    weight gradients are the parts of the CP=1 gradient, and megatron-core completes the sum:
    its schedule multiplies each micro-batch's loss by the CP size (`forward_step_calc_loss`,
    two-value loss functions) and DDP averages over the data-and-context-parallel group, a
    factor 1/(DP·CP): CP · Σ_cp parts / (DP · CP) = the CP=1 gradient averaged over DP.
    (An all-reduce whose backward also sums, like `torch.distributed.nn.all_reduce`, would count
    each rank's identical loss CP times.) megatron-core's `reduce_from_tensor_model_parallel_
    region` has exactly this forward/backward pair and takes the group to reduce over.
    """
    if context_parallel_size() == 1:
        return stats
    # A copy: megatron's reduction works in place on its input.
    return tensor_parallel.reduce_from_tensor_model_parallel_region(
        stats.contiguous().clone(), group=parallel_state.get_context_parallel_group()
    )
