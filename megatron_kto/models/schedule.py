"""Drive megatron-core's pipeline schedules over a list of micro-batches.

We follow megatron-core's forward-step contract: `forward_step(data_iterator, model) ->
(output_tensor, loss_func)`, where `loss_func(output_tensor)` returns `(loss, reported)` for
training and `loss_func(output_tensor, non_loss_data=True)` returns collected data for
forward-only passes. Results exist only on the last pipeline stage; `broadcast_from_last_stage`
hands fixed-size tensors to the other stages.

`run_schedule` is the one place every forward pass goes through (training, reference, KL rows,
precompute, eval), so the micro-batch layout is decided there, free of data-pipeline knowledge:

* padding-free (`pack=True`): each micro-batch's rows are packed end to end (`models.packing`);
  with sequence parallelism the packed length is rounded up to a multiple of TP, and with
  pipeline parallelism every micro-batch of the pass gets the pass's longest packed length
  (megatron-core's p2p buffers have one shape per schedule; see `pipeline_packed_length`);
* padded: sequence parallelism splits the sequence dimension over the TP ranks, and
  megatron-core's scatter asserts that it divides evenly, so every micro-batch is right-padded
  to a multiple of TP (`pad_sequence_dim`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config

from megatron_kto.models.context_parallel import (
    context_parallel_size,
    row_multiple,
    split_micro_batch,
)
from megatron_kto.models.logprobs import IGNORE_INDEX
from megatron_kto.models.packing import (
    NUM_SCORED,
    PAD_VALUES,
    ROW_LENGTHS,
    SCORED_SPANS,
    host_row_lengths,
    pack_micro_batch,
    packed_length,
)

Batch = dict[str, Any]

#: Batch key of host-side facts about label tensors: {labels key: scored positions per row}.
HOST_SCORED = "host_scored"
#: Batch key of host-side facts about label tensors: {labels key: `packing.kept_lengths` per row}.
HOST_LENGTHS = "host_lengths"
#: Batch key of host-side facts about label tensors: {labels key: `label_spans` per row}.
HOST_SPANS = "host_spans"

#: One row's scored columns: (start, end) runs, in order.
Spans = tuple[tuple[int, int], ...]


def label_spans(labels: torch.Tensor) -> list[Spans]:
    """Per row of `labels` ([rows, T]), its scored columns (label != -100) as (start, end) runs.

    A completion is one run in practice, so this is a few ints per row — cheap to keep on the
    host and to slice into micro-batches. Reads `labels` on the host (a device-to-host copy if
    they are on an accelerator).
    """
    mask = (labels != IGNORE_INDEX).to(torch.int8).cpu()
    # +1 where a run starts, -1 one past where it ends.
    edges = torch.diff(F.pad(mask, (1, 1)), dim=-1)
    spans: list[list[int]] = [[] for _ in range(mask.shape[0])]
    for row, col in edges.nonzero().tolist():
        spans[row].append(col)
    return [tuple(zip(cols[::2], cols[1::2], strict=True)) for cols in spans]


def to_device(batch: Batch, device: torch.device) -> Batch:
    """Move every tensor of a batch to `device` (non-blocking on CUDA).

    Label tensors still on the host (keys ending in ``labels``) also leave per-row host facts:
    their counts of scored positions under `HOST_SCORED`, their packed lengths
    (`packing.kept_lengths`) under `HOST_LENGTHS` and their scored runs (`label_spans`) under
    `HOST_SPANS` — the completion-only output layer, the packing of micro-batches and their
    context-parallel split need them without a device-to-host sync in every micro-batch.
    """
    scored = dict(batch.get(HOST_SCORED, {}))
    lengths = dict(batch.get(HOST_LENGTHS, {}))
    spans = dict(batch.get(HOST_SPANS, {}))
    for k, v in batch.items():
        if k.endswith("labels") and torch.is_tensor(v) and v.device.type == "cpu":
            scored[k] = (v != IGNORE_INDEX).sum(dim=-1).tolist()
            lengths[k] = host_row_lengths(v)
            spans[k] = label_spans(v)
    out = {
        k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()
    }
    if scored:
        out[HOST_SCORED] = scored
        out[HOST_LENGTHS] = lengths
        out[HOST_SPANS] = spans
    return out


def scored_per_row(batch: Batch, key: str) -> list[int]:
    """Scored positions per row of `batch[key]` (a labels tensor) as host ints.

    From `HOST_SCORED` when `to_device` recorded them; otherwise counted from the tensor, which
    costs one device-to-host copy on an accelerator — once per pass, never per micro-batch.
    """
    recorded = batch.get(HOST_SCORED, {}).get(key)
    if recorded is not None:
        return list(recorded)
    return (batch[key] != IGNORE_INDEX).sum(dim=-1).tolist()


def scored_spans(batch: Batch, *keys: str) -> list[Spans] | None:
    """`label_spans` of the rows of `batch[key]` (labels tensors), key after key.

    From `HOST_SPANS` when `to_device` recorded them. Otherwise computed — one device-to-host
    copy on an accelerator, once per pass — only under context parallelism, the one reader of
    them (`context_parallel.split_micro_batch`); None without it.
    """
    recorded = batch.get(HOST_SPANS, {})
    if not all(k in recorded for k in keys) and context_parallel_size() == 1:
        return None
    out: list[Spans] = []
    for key in keys:
        out += recorded[key] if key in recorded else label_spans(batch[key])
    return out


def row_lengths(batch: Batch, key: str) -> list[int]:
    """Packed length (`packing.kept_lengths`) of every row of `batch[key]` (a labels tensor), as
    host ints: from `HOST_LENGTHS` when `to_device` recorded them, else computed (one
    device-to-host copy on an accelerator, once per pass)."""
    recorded = batch.get(HOST_LENGTHS, {}).get(key)
    if recorded is not None:
        return list(recorded)
    return host_row_lengths(batch[key])


def split_micro_batches(
    batch: Batch,
    micro_batch_size: int,
    keys: Sequence[str] | None = None,
    scored: Sequence[int] | None = None,
    lengths: Sequence[int] | None = None,
    spans: Sequence[Spans] | None = None,
) -> list[Batch]:
    """Split a batch of B rows into B / micro_batch_size micro-batches along dim 0.

    Args:
        batch: tensors whose first dimension is the row index.
        micro_batch_size: rows per micro-batch; must divide B.
        keys: the keys to keep (all tensors by default).
        scored: scored positions per row (host ints); each micro-batch then gets their sum
            under `NUM_SCORED`.
        lengths: packed lengths per row (host ints, `row_lengths`); each micro-batch then gets
            its rows' under `ROW_LENGTHS` (what `run_schedule` packs it with).
        spans: scored runs per row (host ints, `scored_spans`); each micro-batch then gets its
            rows' under `SCORED_SPANS` (what a context-parallel split counts `NUM_SCORED` with).

    Returns:
        The micro-batches, in order.
    """
    keys = list(keys) if keys is not None else [k for k, v in batch.items() if torch.is_tensor(v)]
    rows = batch[keys[0]].shape[0]
    if rows % micro_batch_size:
        raise ValueError(f"{rows} rows cannot be split into micro-batches of {micro_batch_size}")
    for name, values in (("scored counts", scored), ("row lengths", lengths), ("spans", spans)):
        if values is not None and len(values) != rows:
            raise ValueError(f"{len(values)} {name} for {rows} rows")
    micro = []
    for i in range(0, rows, micro_batch_size):
        part: Batch = {k: batch[k][i : i + micro_batch_size] for k in keys}
        if scored is not None:
            part[NUM_SCORED] = int(sum(scored[i : i + micro_batch_size]))
        if lengths is not None:
            part[ROW_LENGTHS] = list(lengths[i : i + micro_batch_size])
        if spans is not None:
            part[SCORED_SPANS] = list(spans[i : i + micro_batch_size])
        micro.append(part)
    return micro


def pad_sequence_dim(batch: Batch, multiple: int) -> Batch:
    """Right-pad the [rows, T] tensors of a micro-batch to a length divisible by `multiple`.

    Args:
        batch: a micro-batch with `position_ids` [rows, T]; its [rows, T] keys must be among
            `PAD_VALUES` (per-row [rows] tensors pass through).
        multiple: the length must become a multiple of this.

    Returns:
        The batch itself if T already divides, else a new dict with padded tensors.

    Raises:
        ValueError: a [rows, T] tensor under a key with no known fill value.
    """
    length = batch["position_ids"].shape[1]
    pad = -length % multiple
    if pad == 0:
        return batch
    out = dict(batch)
    for key, value in batch.items():
        if not (torch.is_tensor(value) and value.dim() == 2 and value.shape[1] == length):
            continue
        if key not in PAD_VALUES:
            raise ValueError(
                f"cannot pad micro-batch key {key!r} [rows, {length}] for sequence parallelism: "
                f"no fill value (known: {sorted(PAD_VALUES)})"
            )
        out[key] = F.pad(value, (0, pad), value=PAD_VALUES[key])
    return out


def sequence_multiple(model_chunk: torch.nn.Module) -> int:
    """The sequence length a micro-batch must divide into for this model: TP with sequence
    parallelism (megatron scatters the sequence over the TP ranks), else 1."""
    config = get_model_config(model_chunk)
    return config.tensor_model_parallel_size if config.sequence_parallel else 1


def context_parallel_multiple(model_chunk: torch.nn.Module) -> int:
    """What every row must divide into under context parallelism (`context_parallel.
    row_multiple`: 2·CP, × TP under sequence parallelism); 1 without CP."""
    config = get_model_config(model_chunk)
    return row_multiple(
        config.context_parallel_size, config.tensor_model_parallel_size, config.sequence_parallel
    )


def pipeline_packed_length(
    lengths: Sequence[Sequence[int]], multiple: int, row_multiple: int = 1
) -> int:
    """The one packed length of all micro-batches of a pipelined pass: the longest.

    megatron-core's p2p buffers have one shape per schedule (`seq_length`). Its alternative,
    `config.variable_seq_lengths`, sends every tensor's shape first — a blocking exchange with a
    device sync per message — and, under the interleaved schedule at PP=2, would post a
    gradient's and an activation's shape to the same peer in an order the receiver does not
    share (see `builder.make_transformer_config`, batch_p2p_comm). Padding each packed
    micro-batch of a pass to the longest costs at most what padding rows already cost.
    """
    return max(packed_length(row, multiple, row_multiple) for row in lengths)


def prepare_micro_batches(
    model_chunks: list[torch.nn.Module], micro_batches: list[Batch], pack: bool
) -> list[Batch]:
    """The micro-batches as the model takes them: packed (`pack`), else padded to a multiple of
    TP under sequence parallelism; under context parallelism every row is first padded to
    `context_parallel_multiple` and then split (`context_parallel.split_micro_batch`).
    Packing needs each micro-batch's `ROW_LENGTHS`."""
    cp_multiple = context_parallel_multiple(model_chunks[0])
    prepared = _pack_or_pad(model_chunks, micro_batches, pack, cp_multiple)
    if cp_multiple == 1:
        return prepared
    cp_size = parallel_state.get_context_parallel_world_size()
    cp_rank = parallel_state.get_context_parallel_rank()
    return [split_micro_batch(b, cp_size, cp_rank) for b in prepared]


def _pack_or_pad(
    model_chunks: list[torch.nn.Module], micro_batches: list[Batch], pack: bool, row_multiple: int
) -> list[Batch]:
    # Rows that are multiples of `row_multiple` (which TP under SP divides) make any sum of rows
    # a multiple of TP too.
    multiple = max(sequence_multiple(model_chunks[0]), row_multiple)
    if not pack:
        if multiple > 1:
            micro_batches = [pad_sequence_dim(b, multiple) for b in micro_batches]
        return micro_batches
    missing = [i for i, b in enumerate(micro_batches) if ROW_LENGTHS not in b]
    if missing:
        raise ValueError(
            f"packing needs the row lengths of every micro-batch (split_micro_batches(lengths=)); "
            f"micro-batches {missing} have none"
        )
    lengths = [b[ROW_LENGTHS] for b in micro_batches]
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        common = pipeline_packed_length(lengths, multiple, row_multiple)
        return [
            pack_micro_batch(b, n, common, row_multiple) for b, n in zip(micro_batches, lengths)
        ]
    return [
        pack_micro_batch(b, n, packed_length(n, multiple, row_multiple), row_multiple)
        for b, n in zip(micro_batches, lengths)
    ]


def run_schedule(
    model_chunks: list[torch.nn.Module],
    micro_batches: list[Batch],
    forward_step: Callable[[Any, torch.nn.Module], tuple[torch.Tensor, Callable]],
    *,
    forward_only: bool,
    collect_non_loss_data: bool = False,
    pack: bool = False,
) -> list[Any]:
    """Run one megatron-core forward(-backward) schedule over `micro_batches`.

    Args:
        model_chunks: this rank's model chunks (DDP-wrapped for training).
        micro_batches: equally shaped micro-batches ([mbs, T] tensors), already on the device;
            packed here (`pack`), or right-padded to a multiple of TP under sequence parallelism.
        forward_step: megatron-core forward step function; a packed micro-batch carries its
            `packing.PackedRows` under `packing.PACKED` for the model call.
        forward_only: no backward pass.
        collect_non_loss_data: collect `loss_func(output, non_loss_data=True)` results.
        pack: pack each micro-batch's rows end to end (`models.packing`; needs `ROW_LENGTHS`).

    Returns:
        Per micro-batch results of the loss function on the last pipeline stage; [] elsewhere.
    """
    if not micro_batches:
        return []
    micro_batches = prepare_micro_batches(model_chunks, micro_batches, pack)
    # megatron-core's p2p shapes take the whole sequence and divide it by CP (and TP under SP).
    seq_length = micro_batches[0]["position_ids"].shape[1] * context_parallel_size()
    micro_batch_size = micro_batches[0]["position_ids"].shape[0]
    # Interleaved schedules take one iterator per model chunk over the same micro-batches.
    iterators: Any = [iter(micro_batches) for _ in model_chunks]
    if len(model_chunks) == 1:
        iterators = iterators[0]
    fb = get_forward_backward_func()
    return fb(
        forward_step_func=forward_step,
        data_iterator=iterators,
        model=model_chunks if len(model_chunks) > 1 else model_chunks[0],
        num_microbatches=len(micro_batches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
    )


def broadcast_from_last_stage(
    tensor: torch.Tensor | None, shape: Sequence[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Give every pipeline stage the last stage's fixed-size tensor.

    Args:
        tensor: the value on the last stage (ignored elsewhere).
        shape, dtype, device: of the tensor, known on every stage.

    Returns:
        The last stage's tensor, on every rank of the pipeline group.
    """
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        assert tensor is not None
        return tensor
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        assert tensor is not None
        buf = tensor.detach().to(device=device, dtype=dtype).contiguous()
    else:
        buf = torch.empty(tuple(shape), dtype=dtype, device=device)
    dist.broadcast(
        buf,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return buf
