"""Forward steps and the forward-only log-prob pass shared by the KTO and DPO models."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from megatron.core import parallel_state

from megatron_kto.models.context_parallel import reduce_row_stats
from megatron_kto.models.logprobs import (
    IGNORE_INDEX,
    masked_sum,
    mean_logit_sums,
    mean_logits,
    position_columns,
    token_logprobs,
)
from megatron_kto.models.output_head import (
    completion_stats,
    hidden_states_call_kwargs,
    hidden_states_output,
    output_head,
)
from megatron_kto.models.packing import (
    DEFAULT_PACK_SEQUENCES,
    LABEL_WEIGHTS,
    NLL_ONLY,
    NUM_SCORED,
    PACKED,
    PackedRows,
    segment_sums,
)
from megatron_kto.models.schedule import (
    Batch,
    Spans,
    broadcast_from_last_stage,
    row_lengths,
    run_schedule,
    scored_spans,
    split_micro_batches,
)

#: Columns of the per-row statistics returned by `forward_sequence_stats`.
LOGP_SUM, NUM_TOKENS, LOGIT_SUM = 0, 1, 2
#: Two more columns when a micro-batch carries `NLL_ONLY` marks: the log-prob sum and count
#: over every scored position, the NLL-only ones included (the three above leave them out).
NLL_LOGP_SUM, NLL_NUM_TOKENS = 3, 4


def sequence_stats(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    packed: PackedRows | None = None,
    weights: torch.Tensor | None = None,
    nll_only: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-row [logp_sum, num_tokens, logit_sum] from this TP rank's logits ([N, 3] float32).

    `weights` ([N, T] like `labels`, or None for 1) multiply each position's log-prob in
    `logp_sum` (LD-DPO). `nll_only` ([N, T], or None): positions scored for the two NLL columns
    only (`logprobs.position_columns`; the result is then [N, 5]).

    `vocab_size` is the real vocabulary: padded logit columns are not tokens. `logit_sum` is read
    before `token_logprobs`, which may normalise fp32 logits in place. A packed micro-batch
    ([1, L] logits and labels, `packed` its `PackedRows`) gives one row per packed row.
    """
    if packed is None and nll_only is None:
        logit_sum = mean_logit_sums(logits, labels, vocab_size)
        logp = token_logprobs(logits, labels, vocab_size)
        logp_sum, count = masked_sum(logp if weights is None else logp * weights, labels)
        return torch.stack([logp_sum, count.to(logp_sum.dtype), logit_sum], dim=-1)
    mask = (labels != IGNORE_INDEX).reshape(-1)
    logit_mean = mean_logits(logits, vocab_size).reshape(-1) * mask
    logp = token_logprobs(logits, labels, vocab_size).reshape(-1)
    per_position = position_columns(
        logp,
        mask.to(logp.dtype),
        logit_mean,
        weights.reshape(-1) if weights is not None else None,
        nll_only.reshape(-1) if nll_only is not None else None,
    )
    positions = torch.arange(per_position.shape[0], device=per_position.device)
    return segment_sums(per_position, positions, *labels.shape, packed)


def model_call(model: torch.nn.Module, batch: Batch, **kwargs: object) -> torch.Tensor:
    """Run a model chunk on a micro-batch (with its THD parameters when it is packed); `kwargs`
    go to the model's forward (e.g. `hidden_states_call_kwargs`)."""
    packed = batch.get(PACKED)
    if packed is not None:
        kwargs = {**kwargs, "packed_seq_params": packed}
    return model(batch["tokens"], batch["position_ids"], None, **kwargs)


def gpt_forward_step(loss_fn: Callable[[Batch, torch.Tensor], object]) -> Callable:
    """A megatron-core forward step: run the chunk on `tokens`/`position_ids` of the next
    micro-batch and bind `loss_fn(batch, output)` for the last stage."""

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model_call(model, batch)

        def loss_func(output_tensor, non_loss_data: bool = False):
            return loss_fn(batch, output_tensor)

        return output, loss_func

    return forward_step


def stats_forward_step(
    loss_fn: Callable[[Batch, torch.Tensor], object], vocab_size: int, chunk_size: int
) -> Callable:
    """A megatron-core forward step whose loss function sees per-row statistics, not logits.

    `loss_fn(batch, stats)` gets the micro-batch and its `sequence_stats`-style [N, 3] tensor
    (`LOGP_SUM`, `NUM_TOKENS`, `LOGIT_SUM`; [N, 5] with `NLL_ONLY` marks). With `chunk_size` > 0 the model's last stage stops
    at its hidden states and the output layer runs on completion positions only, `chunk_size`
    tokens at a time (`models.output_head`); 0 computes full logits at every position.
    """

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        if chunk_size:
            # The last stage stops at its hidden states, kept in the compute dtype.
            with hidden_states_output(model):
                output = model_call(model, batch, **hidden_states_call_kwargs(model))
        else:
            output = model_call(model, batch)

        def loss_func(output_tensor, non_loss_data: bool = False):
            if chunk_size:
                stats = completion_stats(
                    output_tensor,
                    batch["labels"],
                    output_head(model),
                    vocab_size,
                    chunk_size,
                    batch.get(NUM_SCORED),
                    batch.get(PACKED),
                    batch.get(LABEL_WEIGHTS),
                    batch.get(NLL_ONLY),
                )
            else:
                stats = sequence_stats(
                    output_tensor,
                    batch["labels"],
                    vocab_size,
                    batch.get(PACKED),
                    batch.get(LABEL_WEIGHTS),
                    batch.get(NLL_ONLY),
                )
            # Under context parallelism each rank holds its chunks' part of every row.
            return loss_fn(batch, reduce_row_stats(stats))

        return output, loss_func

    return forward_step


@contextlib.contextmanager
def eval_mode(chunks: list[torch.nn.Module]) -> Iterator[None]:
    """Disable dropout for forward-only passes; restore the previous modes afterwards."""
    modes = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    try:
        yield
    finally:
        for c, mode in zip(chunks, modes, strict=True):
            c.train(mode)


def forward_sequence_stats(
    chunks: list[torch.nn.Module],
    tokens: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor,
    micro_batch_size: int,
    vocab_size: int,
    chunk_size: int = 0,
    scored: list[int] | None = None,
    pack: bool = DEFAULT_PACK_SEQUENCES,
    lengths: list[int] | None = None,
    spans: list[Spans] | None = None,
    label_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Forward-only pass over N rows through the pipeline schedule, without an autograd graph.

    Args:
        chunks: model chunks (policy or reference weights).
        tokens, labels, position_ids: [N, T] on the device.
        micro_batch_size: rows per micro-batch (must divide N).
        vocab_size: real vocabulary size (padded logit columns are left out).
        chunk_size: > 0: output layer on completion positions only, in chunks of this many
            tokens; 0: full logits (`stats_forward_step`).
        scored: scored positions per row as host ints (`schedule.scored_per_row`); None counts
            them from `labels` (one device-to-host copy on an accelerator).
        pack: padding-free micro-batches (`models.packing`).
        lengths: packed row lengths as host ints (`schedule.row_lengths`); None computes them
            from `labels` when packing (one device-to-host copy on an accelerator).
        spans: scored runs per row as host ints (`schedule.scored_spans`), for each context-
            parallel rank's count of scored positions; None: under context parallelism they are
            computed from `labels` (one device-to-host copy on an accelerator).
        label_weights: [N, T] weights of each position's log-prob (`LABEL_WEIGHTS`), or None.

    Returns:
        [N, 3] float32 (`LOGP_SUM`, `NUM_TOKENS`, `LOGIT_SUM` columns) on every pipeline stage.
    """
    batch = {"tokens": tokens, "labels": labels, "position_ids": position_ids}
    if label_weights is not None:
        batch[LABEL_WEIGHTS] = label_weights
    if chunk_size and scored is None:
        scored = (labels != IGNORE_INDEX).sum(dim=-1).tolist()
    if pack and lengths is None:
        lengths = row_lengths(batch, "labels")
    if chunk_size and spans is None:
        spans = scored_spans(batch, "labels")
    micro = split_micro_batches(
        batch,
        micro_batch_size,
        scored=scored,
        lengths=lengths if pack else None,
        spans=spans if chunk_size else None,
    )
    step = stats_forward_step(lambda b, stats: stats, vocab_size, chunk_size)
    with torch.no_grad(), eval_mode(chunks):
        results = run_schedule(
            chunks, micro, step, forward_only=True, collect_non_loss_data=True, pack=pack
        )
    local = torch.cat(results, dim=0) if results else None
    return broadcast_from_last_stage(local, (tokens.shape[0], 3), torch.float32, tokens.device)


def data_parallel_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a fixed-size tensor over the data-parallel group (in place; returned for chaining)."""
    if parallel_state.get_data_parallel_world_size() > 1:
        torch.distributed.all_reduce(tensor, group=parallel_state.get_data_parallel_group())
    return tensor


def data_parallel_all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """[DP, *shape]: every data-parallel rank's `tensor` (the same fixed shape on each), in rank
    order — one all-reduce of zero-filled slots (exact: each slot has one non-zero summand)."""
    world = parallel_state.get_data_parallel_world_size()
    if world == 1:
        return tensor.unsqueeze(0)
    slots = torch.zeros((world, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
    slots[parallel_state.get_data_parallel_rank()] = tensor
    torch.distributed.all_reduce(slots, group=parallel_state.get_data_parallel_group())
    return slots
