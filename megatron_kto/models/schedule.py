"""Drive megatron-core's pipeline schedules over a list of micro-batches.

We follow megatron-core's forward-step contract: `forward_step(data_iterator, model) ->
(output_tensor, loss_func)`, where `loss_func(output_tensor)` returns `(loss, reported)` for
training and `loss_func(output_tensor, non_loss_data=True)` returns collected data for
forward-only passes. Results exist only on the last pipeline stage; `broadcast_from_last_stage`
hands fixed-size tensors to the other stages.

Sequence parallelism splits the sequence dimension over the TP ranks, and megatron-core's
scatter asserts that it divides evenly; `run_schedule` therefore right-pads every micro-batch to
a multiple of TP when the model runs with `sequence_parallel` (`pad_sequence_dim`). This is the
one place every forward pass goes through (training, reference, KL rows, precompute, eval), and
it keeps the data pipeline free of model-layout knowledge.
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

from megatron_kto.models.logprobs import IGNORE_INDEX

Batch = dict[str, Any]

#: Batch key of host-side facts about label tensors: {labels key: scored positions per row}.
HOST_SCORED = "host_scored"
#: Micro-batch key: number of scored positions in the micro-batch, a host int.
NUM_SCORED = "num_scored"

#: Fill values of the [rows, T] keys a micro-batch may carry when its length is padded. Padding
#: goes on the right: attention is causal, so real positions never see it, and its labels are
#: ignored, so it carries no loss. Position ids of padding are 0 (any valid id works; a
#: continued arange could run past a learned position table).
SEQUENCE_PAD_VALUES = {"tokens": 0, "labels": IGNORE_INDEX, "position_ids": 0}


def to_device(batch: Batch, device: torch.device) -> Batch:
    """Move every tensor of a batch to `device` (non-blocking on CUDA).

    Label tensors still on the host (keys ending in ``labels``) also leave their per-row counts
    of scored positions under `HOST_SCORED`, as Python ints: the completion-only output layer
    needs them to select positions without a device-to-host sync in every micro-batch.
    """
    host = dict(batch.get(HOST_SCORED, {}))
    for k, v in batch.items():
        if k.endswith("labels") and torch.is_tensor(v) and v.device.type == "cpu":
            host[k] = (v != IGNORE_INDEX).sum(dim=-1).tolist()
    out = {
        k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()
    }
    if host:
        out[HOST_SCORED] = host
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


def split_micro_batches(
    batch: Batch,
    micro_batch_size: int,
    keys: Sequence[str] | None = None,
    scored: Sequence[int] | None = None,
) -> list[Batch]:
    """Split a batch of B rows into B / micro_batch_size micro-batches along dim 0.

    Args:
        batch: tensors whose first dimension is the row index.
        micro_batch_size: rows per micro-batch; must divide B.
        keys: the keys to keep (all tensors by default).
        scored: scored positions per row (host ints); each micro-batch then gets their sum
            under `NUM_SCORED`.

    Returns:
        The micro-batches, in order.
    """
    keys = list(keys) if keys is not None else [k for k, v in batch.items() if torch.is_tensor(v)]
    rows = batch[keys[0]].shape[0]
    if rows % micro_batch_size:
        raise ValueError(f"{rows} rows cannot be split into micro-batches of {micro_batch_size}")
    if scored is not None and len(scored) != rows:
        raise ValueError(f"{len(scored)} scored counts for {rows} rows")
    micro = []
    for i in range(0, rows, micro_batch_size):
        part: Batch = {k: batch[k][i : i + micro_batch_size] for k in keys}
        if scored is not None:
            part[NUM_SCORED] = int(sum(scored[i : i + micro_batch_size]))
        micro.append(part)
    return micro


def pad_sequence_dim(batch: Batch, multiple: int) -> Batch:
    """Right-pad the [rows, T] tensors of a micro-batch to a length divisible by `multiple`.

    Args:
        batch: a micro-batch with `position_ids` [rows, T]; its [rows, T] keys must be among
            `SEQUENCE_PAD_VALUES` (per-row [rows] tensors pass through).
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
        if key not in SEQUENCE_PAD_VALUES:
            raise ValueError(
                f"cannot pad micro-batch key {key!r} [rows, {length}] for sequence parallelism: "
                f"no fill value (known: {sorted(SEQUENCE_PAD_VALUES)})"
            )
        out[key] = F.pad(value, (0, pad), value=SEQUENCE_PAD_VALUES[key])
    return out


def sequence_multiple(model_chunk: torch.nn.Module) -> int:
    """The sequence length a micro-batch must divide into for this model: TP with sequence
    parallelism (megatron scatters the sequence over the TP ranks), else 1."""
    config = get_model_config(model_chunk)
    return config.tensor_model_parallel_size if config.sequence_parallel else 1


def run_schedule(
    model_chunks: list[torch.nn.Module],
    micro_batches: list[Batch],
    forward_step: Callable[[Any, torch.nn.Module], tuple[torch.Tensor, Callable]],
    *,
    forward_only: bool,
    collect_non_loss_data: bool = False,
) -> list[Any]:
    """Run one megatron-core forward(-backward) schedule over `micro_batches`.

    Args:
        model_chunks: this rank's model chunks (DDP-wrapped for training).
        micro_batches: equally shaped micro-batches ([mbs, T] tensors), already on the device;
            with sequence parallelism they are right-padded to a multiple of TP here.
        forward_step: megatron-core forward step function.
        forward_only: no backward pass.
        collect_non_loss_data: collect `loss_func(output, non_loss_data=True)` results.

    Returns:
        Per micro-batch results of the loss function on the last pipeline stage; [] elsewhere.
    """
    if not micro_batches:
        return []
    multiple = sequence_multiple(model_chunks[0])
    if multiple > 1:
        micro_batches = [pad_sequence_dim(b, multiple) for b in micro_batches]
    seq_length = micro_batches[0]["position_ids"].shape[1]
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
