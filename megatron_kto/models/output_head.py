"""Log-probs only where the loss looks: the output layer runs on completion positions only.

megatron-core's `GPTModel` ends with its output layer over every position. Our losses need the
log-probs of completion tokens alone (labels != -100), so on the last pipeline stage we let the
model stop at its final hidden states (`hidden_states_output`) and the loss function applies the
same output weight to the selected positions, in chunks (`models.chunked_logprobs`):

* prompt and padding positions never reach the output layer (no [tokens × vocab] logits at all);
* the selected positions' logits exist one chunk at a time, forward and backward;
* tensor parallelism is handled as `ColumnParallelLinear` handles it: with sequence parallelism
  the hidden states are first all-gathered along the sequence (reduce-scatter in the backward),
  otherwise the selected states enter the TP region (all-reduce in the backward); the weight is
  this rank's vocabulary slice, the softmax is vocab-parallel;
* tied embeddings use the weight megatron's `_postprocess` would use
  (`shared_embedding_or_output_weight`: the embedding on the first stage, the synced copy on
  the last stage with PP > 1);
* under bf16/fp16 the hidden states stay in the compute dtype from the last layer norm to the
  chunks (`hidden_states_call_kwargs`: no fp32 copy, no fp32 all-gather), each chunk's logits
  and softmax are fp32, and the weight gradient is summed over the chunks in fp32 — into
  megatron DDP's `main_grad`, as megatron's own layers do (`models.weight_grad`).

Selection is free of host syncs when the number of scored positions of the micro-batch is known
on the host (`num_scored`, see `schedule.to_device`; under context parallelism this rank's
count, `context_parallel.split_micro_batch`): `torch.nonzero_static` then has a static size. Per-row sums scatter the per-token values back into a [rows × row length] layout and sum
each row (deterministic, unlike an atomic index_add; `packing.segment_sums`); a packed
micro-batch ([1, total tokens]) maps each position to its row with the packing's row ids.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.module import Float16Module

from megatron_kto.config.schema import ModelConfig
from megatron_kto.models.builder import unwrap
from megatron_kto.models.chunked_logprobs import chunked_token_logprobs
from megatron_kto.models.logprobs import IGNORE_INDEX, position_columns
from megatron_kto.models.packing import PackedRows, segment_sums

#: Default tokens per chunk of the completion-only output layer (the schema holds defaults).
DEFAULT_LOGPROB_CHUNK_SIZE: int = ModelConfig.logprob_chunk_size


@contextlib.contextmanager
def hidden_states_output(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, a last-stage `GPTModel` under `model` returns its final (normed) hidden
    states [S, B, H] (S/TP under sequence parallelism) instead of logits.

    `GPTModel._postprocess` returns the hidden states unchanged when `post_process` is False
    (as on an intermediate pipeline stage); everything else it does — the output layer — is what
    `completion_stats` does on fewer positions. The flag is restored on exit, so checkpointing
    and the tied-embedding bookkeeping, which read it, always see the real stage.
    """
    gpt = unwrap(model)
    if not gpt.post_process:
        yield
        return
    gpt.post_process = False
    try:
        yield
    finally:
        gpt.post_process = True


def hidden_states_call_kwargs(model: torch.nn.Module) -> dict[str, bool]:
    """Keyword arguments for calling `model` within `hidden_states_output`.

    megatron-core's `Float16Module` (bf16/fp16) upcasts a last stage's output to fp32 — meant
    for logits. Our output there is the hidden states, which the chunked output layer multiplies
    in the weight's dtype: the upcast would only make an fp32 copy of [S, B, H] (and double the
    bytes of the sequence-parallel all-gather) to be cast straight back. `fp32_output=False` is
    `Float16Module`'s own switch for keeping its output in the compute dtype; every wrapper
    above it (megatron DDP) passes keyword arguments through. Without `Float16Module` (fp32)
    there is nothing to switch off.
    """
    module = model
    while True:
        if isinstance(module, Float16Module):
            return {"fp32_output": False}
        if not hasattr(module, "module"):
            return {}
        module = module.module


@dataclass(frozen=True)
class OutputHead:
    """The output projection of a last-stage model chunk."""

    weight: torch.Tensor
    """[V/TP, H] this TP rank's vocabulary slice (the embedding when tied on one stage)."""
    sequence_parallel: bool
    """Hidden states arrive sequence-scattered over the TP group."""


def output_head(model: torch.nn.Module) -> OutputHead:
    """The weight (and SP mode) the model's own output layer would use."""
    gpt = unwrap(model)
    if gpt.share_embeddings_and_output_weights:
        weight = gpt.shared_embedding_or_output_weight()
    else:
        weight = gpt.output_layer.weight
    return OutputHead(weight=weight, sequence_parallel=bool(gpt.output_layer.sequence_parallel))


def scored_positions(labels: torch.Tensor, num_scored: int | None) -> torch.Tensor:
    """Flat indices (row-major over [B, T]) of positions with a label, in order.

    Args:
        labels: [B, T] with `IGNORE_INDEX` where nothing is scored.
        num_scored: how many labels are set, known on the host; None finds out on the device
            (a host sync on accelerators).
    """
    flat = labels.reshape(-1) != IGNORE_INDEX
    if num_scored is None:
        return flat.nonzero().squeeze(1)
    return torch.nonzero_static(flat, size=num_scored).squeeze(1)


def completion_stats(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: OutputHead,
    vocab_size: int,
    chunk_size: int,
    num_scored: int | None = None,
    packed: PackedRows | None = None,
    weights: torch.Tensor | None = None,
    nll_only: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-row [logp_sum, num_tokens, logit_sum] from final hidden states ([B, 3] float32;
    [B, 5] with `nll_only`, `logprobs.position_columns`).

    The same statistics as `forward.sequence_stats` computes from full logits: summed completion
    log-prob (differentiable), number of completion tokens, and the sum over them of the mean
    logit over the real vocabulary.

    Args:
        hidden: [S, B, H] (or [S/TP, B, H] under sequence parallelism) from
            `hidden_states_output`, in the compute dtype (`hidden_states_call_kwargs`): the
            sequence-parallel gather and the selection move no more bytes than needed.
        labels: [B, S] next-token targets, `IGNORE_INDEX` where not scored.
        head: the chunk's `output_head`.
        vocab_size: the real vocabulary size (padded columns are left out).
        chunk_size: tokens per output-layer chunk.
        num_scored: number of scored labels in `labels` if known on the host (no sync then).
        packed: the `PackedRows` of a packed micro-batch (hidden [L, 1, H], labels [1, L]);
            the result then has one row per packed row.
        weights: [B, S] like `labels`: each position's log-prob is multiplied by its weight in
            `logp_sum` (LD-DPO); None: 1.
        nll_only: [B, S] like `labels`: 1 where a scored label counts in the NLL columns only
            (`packing.NLL_ONLY`); None: no NLL columns.
    """
    if head.sequence_parallel:
        hidden = tensor_parallel.gather_from_sequence_parallel_region(
            hidden, tensor_parallel_output_grad=True
        )
    seq, rows, width = hidden.shape
    if tuple(labels.shape) != (rows, seq):
        raise ValueError(f"labels {tuple(labels.shape)} do not match hidden states {(seq, rows)}")
    positions = scored_positions(labels, num_scored)
    # Hidden states are sequence-major: position (row, col) is entry col * rows + row.
    selected = hidden.reshape(seq * rows, width).index_select(
        0, (positions % seq) * rows + positions // seq
    )
    if parallel_state.get_tensor_model_parallel_world_size() > 1 and not head.sequence_parallel:
        # Identity forward, all-reduce of the vocabulary-partial gradients in the backward.
        selected = tensor_parallel.copy_to_tensor_model_parallel_region(selected)
    target = labels.reshape(-1).index_select(0, positions)
    logp, mean_logit = chunked_token_logprobs(
        selected.to(head.weight.dtype), head.weight, target, chunk_size, vocab_size
    )

    def picked(values: torch.Tensor | None) -> torch.Tensor | None:
        return None if values is None else values.reshape(-1).index_select(0, positions)

    w = picked(weights)
    per_token = position_columns(
        logp, torch.ones_like(logp), mean_logit, w.to(logp.dtype) if w is not None else None,
        picked(nll_only),
    )  # fmt: skip
    return segment_sums(per_token, positions, rows, seq, packed)
