"""Padding-free micro-batches: the rows of a micro-batch packed end to end (THD layout).

A padded micro-batch is [rows, T] with every row right-padded to the longest; on long-tailed
data most of every pass is then padding. A packed micro-batch is [1, L] with L = Σ row lengths:

* each row keeps its first ``length`` positions, where ``length`` is its last scored position
  (label != -100) + 1 — positions after it carry no label and, attention being causal, cannot
  change a scored one, so every statistic the losses read is unchanged;
* position ids restart per row (they are the padded batch's own position ids, gathered);
* attention never crosses rows: megatron-core's `PackedSeqParams` in the `thd` format carry the
  row boundaries (`cu_seqlens`). RoPE restarts at every row, from `cu_seqlens` on the device:
  TE's fused THD kernel, or without it `models.packed_rope` (megatron's own unfused THD RoPE
  would read `cu_seqlens` on the host); the core attention runs causally inside each row:
  Transformer Engine's fused attention with `padding_causal` masks, or `SDPAttention`, which
  runs one causal SDPA call per row;
* per-row statistics are segment sums over the flat positions (`segment_sums`).

When the packed length must divide a multiple (TP under sequence parallelism) or match a common
length (pipeline parallelism: megatron-core's p2p buffers have one fixed shape per schedule), a
padding segment of its own is appended: pad tokens, no labels, attending only to themselves.

`PackedRows` extends `PackedSeqParams` with what the non-TE path needs on the host (segment
lengths, so per-row attention needs no device-to-host copy) and with the row id of every
position. Transformer Engine reads only `PackedSeqParams`' own fields
(`TEDotProductAttention.kept_packed_seq_params`), so the extra fields never reach it.

Packing is sync-free: row lengths are known on the host (`schedule.to_device` records them from
the host labels), and on the device the same rule gives the same lengths, from which the gather
index (`torch.nonzero_static`, host-known size), row ids and `cu_seqlens` are built.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_kto.config.schema import DataConfig
from megatron_kto.models.logprobs import IGNORE_INDEX

#: Default of `model.data.pack_sequences` (the schema holds defaults).
DEFAULT_PACK_SEQUENCES: bool = DataConfig.pack_sequences

#: Micro-batch key of a packed micro-batch's `PackedRows`.
PACKED = "packed_seq_params"
#: Micro-batch key: per-row kept lengths (host ints) of a padded micro-batch, for packing.
ROW_LENGTHS = "row_lengths"
#: Micro-batch key (host int, default 0): positions each row keeps after its last scored one —
#: 1 when a training pass also runs each sequence's final token (`router_stats.
#: append_final_tokens`: its routing counts in the load-balancing loss, nothing is scored there).
ROUTED_TAIL = "routed_tail"
#: Micro-batch key: number of scored positions in the micro-batch, a host int (under context
#: parallelism, this rank's: `context_parallel.split_micro_batch`).
NUM_SCORED = "num_scored"
#: Micro-batch key: per row, its scored columns as (start, end) runs (host ints) — what a
#: context-parallel split needs to know each rank's `NUM_SCORED` without reading the device.
SCORED_SPANS = "scored_spans"

#: Fill values of the [rows, T] keys a micro-batch may carry when its length is padded (on the
#: right, or as a packed micro-batch's padding segment): attention is causal, so real positions
#: never see padding, and its labels are ignored, so it carries no loss. Padding positions are 0
#: (any valid id works; an arange could run past a learned position table).
#: Optional micro-batch key: [rows, T] float weights of each position's log-prob in a row's sum
#: (LD-DPO, `losses.length_desensitized`); packed, split and padded with the labels.
LABEL_WEIGHTS = "label_weights"
#: Optional micro-batch key: [rows, T] float, 1 where a label is scored for the NLL columns only
#: (`forward.NLL_LOGP_SUM`; ORPO's prompt tokens as TRL scores them), 0 elsewhere.
NLL_ONLY = "nll_only"
#: The per-position keys besides `labels` that follow the labels (packed, split, padded).
POSITION_KEYS = (LABEL_WEIGHTS, NLL_ONLY)
PAD_VALUES = {
    "tokens": 0,
    "labels": IGNORE_INDEX,
    "position_ids": 0,
    LABEL_WEIGHTS: 0,
    NLL_ONLY: 0,
}


@dataclass
class PackedRows(PackedSeqParams):
    """megatron-core's THD packing parameters, plus host facts and per-position row ids."""

    seqlens: tuple[int, ...] = ()
    """Length of every segment on the host: the rows in order, then the padding segment if any."""
    num_rows: int = 0
    """Rows packed (segments after them are padding)."""
    row_ids: torch.Tensor | None = None
    """[L] row of every packed position (`num_rows` for the padding segment)."""
    cp_size: int = 1
    """Context-parallel ranks the segments are split over (`models.context_parallel`): `seqlens`,
    `cu_seqlens_*` and `max_seqlen_*` then describe the whole (global) segments, while `row_ids`
    and `positions` describe this rank's positions."""
    cp_rank: int = 0
    """This rank in the context-parallel group."""
    positions: torch.Tensor | None = None
    """[L / cp_size] position of each of this rank's tokens within its segment (set under
    context parallelism; None: derived from `cu_seqlens_q`)."""
    cp_order: torch.Tensor | None = None
    """[L] under context parallelism: the permutation taking the CP ranks' gathered local
    sequences to the whole sequence's order (`context_parallel.SplitIndex.order`), built once
    per micro-batch on the device for every layer's attention."""


def kept_lengths(labels: torch.Tensor, tail: int = 0) -> torch.Tensor:
    """Positions of each row that a packed micro-batch keeps: its last scored position + 1
    (at least 1) + `tail`, as a [rows] long tensor on the labels' device. No host sync.

    Args:
        labels: [rows, T] next-token targets, `IGNORE_INDEX` where nothing is scored.
        tail: unscored positions kept after the last scored one (`ROUTED_TAIL`).
    """
    columns = torch.arange(1, labels.shape[-1] + 1, device=labels.device)
    last = torch.where(labels != IGNORE_INDEX, columns, torch.zeros_like(columns))
    return last.amax(dim=-1).clamp(min=1) + tail


def host_row_lengths(labels: torch.Tensor) -> list[int]:
    """`kept_lengths` as host ints (a device-to-host copy if `labels` is on an accelerator)."""
    return kept_lengths(labels).tolist()


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def segment_lengths(lengths: Sequence[int], row_multiple: int = 1) -> list[int]:
    """The packed segment of each row: its kept length rounded up to `row_multiple` (context
    parallelism splits every row into 2·CP equal chunks)."""
    return [_round_up(int(n), row_multiple) for n in lengths]


def packed_length(lengths: Sequence[int], multiple: int = 1, row_multiple: int = 1) -> int:
    """Length of the packed micro-batch of rows of `lengths` (each rounded up to `row_multiple`),
    rounded up to `multiple`."""
    return _round_up(sum(segment_lengths(lengths, row_multiple)), multiple)


def pack_micro_batch(
    batch: dict, lengths: Sequence[int], length: int | None = None, row_multiple: int = 1
) -> dict:
    """Pack a padded micro-batch into one row of concatenated rows.

    Args:
        batch: a micro-batch whose [rows, T] tensors are `tokens`, `labels`, `position_ids`
            (the keys of `PAD_VALUES`); other entries (per-row tensors, host ints) pass through.
        lengths: `kept_lengths` of its rows (with the micro-batch's `ROUTED_TAIL`), as host
            ints.
        length: total packed length (>= the rows' segments); the rest becomes a padding segment.
            None: exactly the rows' segments.
        row_multiple: every row's segment is its kept length rounded up to this multiple: the
            positions after the kept ones continue the row (its own right padding, or
            `PAD_VALUES` past the batch's width) and carry no label.

    Returns:
        A new micro-batch: the [rows, T] keys as [1, length] tensors, `PACKED` the
        `PackedRows`; `ROW_LENGTHS` dropped.

    Raises:
        ValueError: a [rows, T] tensor under a key with no fill value, a length that does not fit.
    """
    rows, width = batch["labels"].shape
    if len(lengths) != rows:
        raise ValueError(f"{len(lengths)} row lengths for a micro-batch of {rows} rows")
    segments = segment_lengths(lengths, row_multiple)
    real = sum(segments)
    total = real if length is None else int(length)
    if total < real:
        raise ValueError(f"packed length {total} is shorter than the rows' {real} tokens")
    pad = total - real
    device = batch["labels"].device
    kept = kept_lengths(batch["labels"], int(batch.get(ROUTED_TAIL, 0)))
    if row_multiple > 1:
        kept = (kept + row_multiple - 1) // row_multiple * row_multiple
        batch = _widen(batch, max(segments) - width, rows, width)
        width = max(width, max(segments))
    keep = torch.arange(width, device=device) < kept[:, None]
    # Static size: the host knows how many positions are kept, so selecting them never waits.
    flat = torch.nonzero_static(keep.reshape(-1), size=real).squeeze(1)
    out = {k: v for k, v in batch.items() if k != ROW_LENGTHS}
    for key, value in batch.items():
        if not (torch.is_tensor(value) and value.dim() == 2 and value.shape == (rows, width)):
            continue
        if key not in PAD_VALUES:
            raise ValueError(
                f"cannot pack micro-batch key {key!r} [rows, {width}]: no fill value for its "
                f"padding (known: {sorted(PAD_VALUES)})"
            )
        packed = value.reshape(-1).index_select(0, flat)
        if pad:
            # Padding positions are 0, not an arange: a pipelined pass pads to its longest packed
            # micro-batch, which may exceed a learned position table's length.
            fill = torch.full((pad,), PAD_VALUES[key], dtype=value.dtype, device=device)
            packed = torch.cat([packed, fill])
        out[key] = packed.unsqueeze(0)
    row_ids = flat // width
    bounds = [torch.zeros(1, dtype=torch.int32, device=device), kept.cumsum(0).to(torch.int32)]
    seqlens = tuple(segments)
    if pad:
        row_ids = F.pad(row_ids, (0, pad), value=rows)
        bounds.append(torch.full((1,), total, dtype=torch.int32, device=device))
        seqlens += (pad,)
    cu_seqlens = torch.cat(bounds)
    out[PACKED] = PackedRows(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=max(seqlens),
        max_seqlen_kv=max(seqlens),
        seqlens=seqlens,
        num_rows=rows,
        row_ids=row_ids,
    )
    return out


def _widen(batch: dict, extra: int, rows: int, width: int) -> dict:
    """The micro-batch with its [rows, width] keys right-padded by `extra` columns."""
    if extra <= 0:
        return batch
    out = dict(batch)
    for key, value in batch.items():
        if torch.is_tensor(value) and value.dim() == 2 and value.shape == (rows, width):
            if key not in PAD_VALUES:
                raise ValueError(f"cannot pack micro-batch key {key!r}: no fill value")
            out[key] = F.pad(value, (0, extra), value=PAD_VALUES[key])
    return out


def segment_sums(
    values: torch.Tensor,
    positions: torch.Tensor,
    rows: int,
    seq: int,
    packed: PackedRows | None = None,
) -> torch.Tensor:
    """Per-row sums of per-position values, deterministically (no atomic adds).

    The values are scattered into a dense [rows × row length] layout and summed per row, as the
    padded path sums its [rows, T] positions.

    Args:
        values: [n, k] values at `positions` (differentiable).
        positions: [n] flat indices into the micro-batch's [rows, seq] positions.
        rows, seq: the micro-batch's tensor shape ([1, L] when packed).
        packed: the micro-batch's `PackedRows`; None for a padded micro-batch.

    Returns:
        [rows, k] sums (the packed micro-batch's real rows when packed).
    """
    if packed is None:
        row, col, num_rows, width = positions // seq, positions % seq, rows, seq
    else:
        row = packed.row_ids.index_select(0, positions)
        if packed.positions is not None:
            col = packed.positions.index_select(0, positions).to(positions.dtype)
        else:
            col = positions - packed.cu_seqlens_q.index_select(0, row).to(positions.dtype)
        num_rows, width = len(packed.seqlens), max(packed.seqlens)
    dense = values.new_zeros(num_rows * width, values.shape[-1])
    dense = dense.index_put((row * width + col,), values)
    sums = dense.view(num_rows, width, -1).sum(dim=1)
    return sums if packed is None else sums[: packed.num_rows]
