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

Nothing here waits for the device. The split's indices — which positions this rank keeps, and
the order that puts the CP ranks' gathered keys and values back in row order — are built once
per micro-batch on the device from the segment bounds already there (`split_index`) and read by
every layer (`PackedRows.cp_order`; a padded micro-batch's are shared by shape). The number of
scored positions this rank keeps, which lets the output layer select them with a static size,
is counted on the host from each row's scored runs (`local_scored`, `packing.SCORED_SPANS`).

Per-row statistics are partial on each rank (its chunks' completion tokens) and are summed over
the CP group by `reduce_row_stats` — see its docstring for why the gradient stays right.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch
from megatron.core import parallel_state, tensor_parallel

from megatron_kto.models.packing import NUM_SCORED, PACKED, SCORED_SPANS, PackedRows

#: Micro-batch keys of [rows, T] tensors that the split follows.
SPLIT_KEYS = ("tokens", "labels", "position_ids", "label_weights", "nll_only")


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


class SplitIndex(NamedTuple):
    """Where this CP rank's positions come from and go to: device tensors, built once per
    micro-batch (`split_micro_batch`) and read by every layer."""

    local: torch.Tensor
    """[L / CP] indices into the whole sequence of the positions this rank keeps, in order."""
    order: torch.Tensor
    """[L] permutation taking the rank-major all-gather of the CP ranks' local sequences to the
    whole sequence's order (what `cp_attention` gathers keys and values with)."""
    positions: torch.Tensor
    """[L] position of every whole-sequence token within its segment."""


def split_index(
    total: int,
    cp_size: int,
    cp_rank: int,
    device: torch.device,
    cu_seqlens: torch.Tensor | None = None,
) -> SplitIndex:
    """The `SplitIndex` of a sequence of `total` tokens, computed on `device` from the segment
    bounds already there: no host data is copied and nothing is read back, so a micro-batch's
    split never waits for the device (a host-built index would be a host->device copy).

    Args:
        total: whole-sequence length (a host int).
        cp_size, cp_rank: the CP group's size and this rank.
        device: where the tensors are built.
        cu_seqlens: [segments + 1] bounds of whole segments (every one a multiple of 2·CP) on
            `device`; None: one segment of `total` tokens (a padded micro-batch's row).
    """
    tokens = torch.arange(total, device=device)
    if cu_seqlens is None:
        start, chunk_len = 0, total // (2 * cp_size)
    else:
        bounds = cu_seqlens.long()
        # right=True: a token at a segment's start belongs to that segment, also after empty ones.
        segment = torch.searchsorted(bounds, tokens, right=True) - 1
        start = bounds.index_select(0, segment)
        chunk_len = (bounds.index_select(0, segment + 1) - start) // (2 * cp_size)
    offset = tokens - start
    chunk = offset // chunk_len
    late = chunk >= cp_size
    owner = torch.where(late, 2 * cp_size - 1 - chunk, chunk)
    local_len = total // cp_size
    # Size known on the host (L / CP), so selecting the kept positions never waits.
    local = torch.nonzero_static(owner == cp_rank, size=local_len).squeeze(1)
    # A rank's local sequence holds, segment after segment, its early then its late chunk: a
    # segment starting at s begins at s / CP there (every earlier segment gave 2·CP-th parts).
    within = start // cp_size + late * chunk_len + offset - chunk * chunk_len
    return SplitIndex(local, owner * local_len + within, offset)


@functools.lru_cache(maxsize=8)
def padded_split_index(length: int, cp_size: int, cp_rank: int, device: torch.device) -> SplitIndex:
    """`split_index` of a padded micro-batch's rows of `length` tokens, built on the device once
    per shape and shared by every micro-batch and layer that has it (a padded micro-batch has no
    `PackedRows` to carry it to the attention)."""
    return split_index(length, cp_size, cp_rank, device)


def local_scored(
    spans: Sequence[Sequence[tuple[int, int]]], seqlens: Sequence[int], cp_size: int, cp_rank: int
) -> int:
    """How many scored positions this CP rank keeps, from host facts alone.

    Args:
        spans: per row, its scored columns as (start, end) runs (`packing.SCORED_SPANS`).
        seqlens: per row, its whole (padded) length, a multiple of 2·CP.
        cp_size, cp_rank: the CP group's size and this rank.

    Returns:
        The scored positions in this rank's chunks r and 2·CP−1−r of every row.
    """
    count = 0
    for runs, n in zip(spans, seqlens, strict=True):
        c = n // (2 * cp_size)
        for chunk in (cp_rank, 2 * cp_size - 1 - cp_rank):
            lo, hi = chunk * c, (chunk + 1) * c
            count += sum(max(0, min(hi, b) - max(lo, a)) for a, b in runs)
    return count


def split_micro_batch(batch: dict, cp_size: int, cp_rank: int) -> dict:
    """This CP rank's part of a micro-batch (packed or padded), as the model takes it.

    Args:
        batch: a micro-batch after packing (`PACKED` set; every segment a multiple of 2·CP) or
            padding ([rows, T] with T a multiple of 2·CP).
        cp_size, cp_rank: the CP group's size and this rank.

    Returns:
        A new micro-batch: `SPLIT_KEYS` tensors cut to this rank's positions ([1, L/CP] or
        [rows, T/CP]); a packed one's `PackedRows` made context-parallel (module docstring),
        carrying the micro-batch's `SplitIndex.order` for every layer's attention. `NUM_SCORED`
        becomes this rank's count when the micro-batch carries its rows' `SCORED_SPANS` (host
        facts), and is dropped otherwise (the output layer then counts on the device).

    Raises:
        ValueError: a segment (or padded row) that is not a multiple of 2·CP.
    """
    if cp_size == 1:
        return batch
    packed: PackedRows | None = batch.get(PACKED)
    rows, width = batch["position_ids"].shape
    seqlens = packed.seqlens if packed is not None else (width,)
    bad = [n for n in seqlens if n % (2 * cp_size)]
    if bad:
        raise ValueError(f"segments of {bad} tokens cannot be split into {2 * cp_size} chunks")
    device = batch["position_ids"].device
    if packed is not None:
        index = split_index(width, cp_size, cp_rank, device, packed.cu_seqlens_q)
    else:
        index = padded_split_index(width, cp_size, cp_rank, device)
    out = {k: v for k, v in batch.items() if k != NUM_SCORED}
    if SCORED_SPANS in batch:
        row_lengths = packed.seqlens[: packed.num_rows] if packed is not None else (width,) * rows
        out[NUM_SCORED] = local_scored(batch[SCORED_SPANS], row_lengths, cp_size, cp_rank)
    for key in SPLIT_KEYS:
        if key in batch:
            out[key] = batch[key].index_select(1, index.local)
    if packed is not None:
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
            row_ids=packed.row_ids.index_select(0, index.local),
            cp_size=cp_size,
            cp_rank=cp_rank,
            positions=index.positions.index_select(0, index.local),
            cp_order=index.order,
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
