"""Output layer + vocab-parallel log-softmax over selected tokens, chunk by chunk.

`chunked_token_logprobs(hidden, weight, target, ...)` is log π(target | hidden) for N selected
positions, where the logits would be ``hidden @ weight.T`` on this TP rank's vocabulary slice. The
[N × V/TP] logits only ever exist one chunk of ``chunk_size`` tokens at a time, in the forward
*and* in the backward:

* forward: per chunk, logits → megatron-core's vocab-parallel cross-entropy steps
  (`VocabParallelCrossEntropy`: max, target logit and sum of exponentials, reduced over the TP
  group — the vocabulary is never gathered); only the per-token log-sum-exp ([N] floats) is kept;
* backward: per chunk, the logits are recomputed (one extra matmul), turned into the softmax with
  the saved log-sum-exp (no collective), and megatron's gradient step gives d/d(logits); the
  gradients for the hidden states and the weight follow from two matmuls (the weight's is summed
  over the chunks in fp32 whatever the weight's dtype: `models.weight_grad`).

Peak memory is therefore O(chunk × V/TP) instead of O(N × V/TP) — what lets a 128k vocabulary run
long sequences — at the price of recomputing the output-layer matmul once in the backward.

The hidden-state gradient returned is this rank's partial sum over its vocabulary slice; the
caller puts the hidden states through megatron's TP region functions first (all-reduce or
reduce-scatter in the backward), exactly as `ColumnParallelLinear` does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

from megatron_kto.models.weight_grad import WeightGradSum


def _tp_rank() -> int:
    return parallel_state.get_tensor_model_parallel_rank()


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, real: int) -> torch.Tensor:
    """fp32 logits of one chunk on this rank's slice; padded vocabulary columns can never win."""
    logits = (h @ weight.t()).float()
    if real < logits.shape[-1]:
        # Finite (not -inf), so max-subtraction cannot produce NaN on an all-padding slice.
        logits[:, real:] = torch.finfo(logits.dtype).min
    return logits


def _target_in_slice(target: torch.Tensor, start: int, width: int):
    """(mask of targets outside this slice, their column inside it, 0 where outside)."""
    outside = (target < start) | (target >= start + width)
    local = (target - start).masked_fill(outside, 0)
    return outside, local


class _ChunkedVocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, chunk_size, real, vocab_size, group):
        width = weight.shape[0]
        start = _tp_rank() * width
        tp = dist.get_world_size(group) if group is not None else 1
        n = hidden.shape[0]
        logp = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        logit_sum = hidden.new_empty(n, dtype=torch.float32)
        for lo in range(0, n, chunk_size):
            hi = min(lo + chunk_size, n)
            logits = _chunk_logits(hidden[lo:hi], weight, real)
            # Vocabulary-mean logit (TRL's logits/* metric) over real columns only.
            logit_sum[lo:hi] = logits[:, :real].sum(-1)
            logits, logits_max = VocabParallelCrossEntropy.calculate_logits_max(logits)
            if tp > 1:
                dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
            _, _, predicted, sum_exp, _ = VocabParallelCrossEntropy.calculate_predicted_logits(
                logits, target[lo:hi], logits_max, start, start + width
            )
            del logits  # the normalised exponentials: not needed any more
            sums = torch.stack([predicted, sum_exp, logit_sum[lo:hi]])
            if tp > 1:
                dist.all_reduce(sums, group=group)
            log_sum_exp = torch.log(sums[1])
            logp[lo:hi] = sums[0] - log_sum_exp  # `predicted` is already max-subtracted
            lse[lo:hi] = log_sum_exp + logits_max
            logit_sum[lo:hi] = sums[2] / vocab_size
        ctx.save_for_backward(hidden, weight, target, lse)
        ctx.chunk_size, ctx.real = chunk_size, real
        ctx.mark_non_differentiable(logit_sum)
        return logp, logit_sum

    @staticmethod
    def backward(ctx, grad_logp, _grad_logit_sum):
        hidden, weight, target, lse = ctx.saved_tensors
        width = weight.shape[0]
        start = _tp_rank() * width
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # Each row of the hidden-state gradient comes from one chunk: one GEMM over this rank's
        # vocabulary slice (fp32 accumulation inside), rounded once to the hidden states' dtype.
        grad_h = torch.empty_like(hidden) if want_h else None
        # The weight gradient sums over every chunk: in fp32 (into megatron DDP's `main_grad`
        # for a half-precision weight), never in a running bf16 sum (`models.weight_grad`).
        grad_w = WeightGradSum(weight) if want_w else None
        n = hidden.shape[0]
        for lo in range(0, n, ctx.chunk_size):
            hi = min(lo + ctx.chunk_size, n)
            h = hidden[lo:hi]
            softmax = _chunk_logits(h, weight, ctx.real)
            softmax.sub_(lse[lo:hi, None]).exp_()
            outside, local = _target_in_slice(target[lo:hi], start, width)
            grad_2d, arange_1d, update, grad_in = (
                VocabParallelCrossEntropy.prepare_gradient_calculation_operands(softmax, outside)
            )
            # megatron's step is the gradient of −log p (cross-entropy); ours is of +log p.
            grad_logits = VocabParallelCrossEntropy.calculate_gradients(
                grad_2d, arange_1d, local, update, grad_in, -grad_logp[lo:hi]
            ).to(weight.dtype)
            if want_h:
                torch.mm(grad_logits, weight, out=grad_h[lo:hi])
            if want_w:
                grad_w.add(grad_logits, h)
        weight_grad = grad_w.result() if grad_w is not None else None
        return grad_h, weight_grad, None, None, None, None, None


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    chunk_size: int,
    vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of `target` under the logits ``hidden @ weight.T``, computed chunk by chunk.

    Args:
        hidden: [N, H] hidden states of the selected positions, in the weight's dtype, already
            through megatron's TP region function (its backward sums the partial gradients).
        weight: [V/TP, H] this TP rank's output-layer (or tied embedding) weight.
        target: [N] vocabulary ids (every one a real token).
        chunk_size: tokens per chunk (> 0).
        vocab_size: the real vocabulary size; padded columns beyond it are excluded from the
            softmax and from the mean logit.

    Returns:
        (log-probs [N] float32, differentiable w.r.t. `hidden` and `weight`;
        mean logit over the real vocabulary [N] float32, no gradient).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    width = weight.shape[0]
    real = max(0, min(width, vocab_size - _tp_rank() * width))
    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
    return _ChunkedVocabParallelLogprobs.apply(
        hidden, weight, target, chunk_size, real, vocab_size, group
    )
