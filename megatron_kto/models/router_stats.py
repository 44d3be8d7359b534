"""Collects the router statistics of one micro-batch's forward pass for the load-balancing loss.

`RouterStatistics(chunks)` hooks every megatron MoE router (`TopKRouter`) of the model chunks.
A training pass runs each row's final token too (`append_final_tokens`), as TRL does. For each
micro-batch the forward step (`announce_micro_batches`) calls `begin(token_mask(batch))`
with the tokens that count (in the router's token order); each router then adds its `losses.router_aux.layer_sums` — recomputing
its logits from its input, so the gradient reaches the router weights and the hidden states as
in Hugging Face — and the loss function reads `loss()` (which also resets). Outside a
`begin` ... `loss` window, and whenever autograd is off (reference and KL passes, validation),
the hooks do nothing: forward-only passes add nothing and cost nothing.

The statistics span all layers of the micro-batch, so the model must not be pipelined
(`config.validate` refuses a non-zero coefficient with PP > 1). With sequence parallelism (which
megatron requires for MoE training with TP > 1) each TP rank routes a slice of the sequence; the
statistics are then summed over the TP group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_kto.losses.router_aux import balance_loss, layer_sums
from megatron_kto.models.packing import PACKED, PAD_VALUES, ROUTED_TAIL, ROW_LENGTHS, kept_lengths
from megatron_kto.models.schedule import Batch


def append_final_tokens(micro: Batch) -> Batch:
    """A training micro-batch whose rows also run their sequence's final token.

    A row's input is its sequence without the final token (`data.collate`: nothing is predicted
    from it). Hugging Face's `aux_loss`, as TRL's KTOTrainer and DPOTrainer compute it, routes
    the whole sequence, final token included; so the training pass appends it (it is the row's
    last label) at the position after the row's last input, unscored, and keeps it when packing
    (`packing.ROUTED_TAIL`). Causal attention: no scored position sees it, so the log-probs do
    not change; the routers see exactly TRL's tokens.

    Args:
        micro: `tokens`, `labels`, `position_ids` [rows, T] (padded, before packing), optionally
            `ROW_LENGTHS` (host ints); other entries pass through.

    Returns:
        A new micro-batch with [rows, T + 1] tensors, `ROW_LENGTHS` one longer per row and
        `ROUTED_TAIL` 1.
    """
    tokens, labels, positions = micro["tokens"], micro["labels"], micro["position_ids"]
    last = kept_lengths(labels)[:, None] - 1  # each row's last input position
    out = dict(micro)
    out["tokens"] = F.pad(tokens, (0, 1), value=PAD_VALUES["tokens"]).scatter(
        1, last + 1, labels.gather(1, last)
    )
    out["position_ids"] = F.pad(positions, (0, 1), value=PAD_VALUES["position_ids"]).scatter(
        1, last + 1, positions.gather(1, last) + 1
    )
    out["labels"] = F.pad(labels, (0, 1), value=PAD_VALUES["labels"])
    if ROW_LENGTHS in micro:
        out[ROW_LENGTHS] = [n + 1 for n in micro[ROW_LENGTHS]]
    out[ROUTED_TAIL] = 1
    return out


def token_mask(batch: dict) -> Tensor:
    """[S, B] float mask of the micro-batch's input tokens, in megatron's [S, B] (sequence-major)
    token order: each row's positions up to its last scored one plus the micro-batch's
    `ROUTED_TAIL` (`packing.kept_lengths`), not padding — packed or not, the same tokens: Hugging
    Face's attention-mask tokens of the same rows.
    """
    packed = batch.get(PACKED)
    tokens = batch["tokens"]
    if packed is not None:
        return (packed.row_ids < packed.num_rows).to(torch.float32).reshape(-1, 1)
    b, s = tokens.shape
    kept = kept_lengths(batch["labels"], int(batch.get(ROUTED_TAIL, 0)))
    real = torch.arange(s, device=tokens.device)[None, :] < kept[:, None]  # [B, S]
    return real.t().to(torch.float32)


def announce_micro_batches(forward_step: Callable, stats: RouterStatistics) -> Callable:
    """`forward_step` that first tells `stats` which tokens of each micro-batch count."""

    class _Announcing:
        def __init__(self, iterator: Iterator[dict]):
            self.iterator = iterator

        def __iter__(self) -> _Announcing:
            return self

        def __next__(self) -> dict:
            batch = next(self.iterator)
            stats.begin(token_mask(batch))
            return batch

    def step(data_iterator, model):
        return forward_step(_Announcing(data_iterator), model)

    return step


class RouterStatistics:
    """Forward hooks on the routers of `chunks` accumulating one micro-batch's statistics."""

    def __init__(self, chunks: list[torch.nn.Module]):
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.router import TopKRouter

        self._mask: Tensor | None = None
        tp = parallel_state.get_tensor_model_parallel_world_size()
        # Under sequence parallelism each TP rank routes its slice of the sequence: the counts
        # and probability sums are summed over the TP group (see `loss`).
        self._tp = 1
        self._sums: list[Tensor] | None = None
        self.routers = [m for c in chunks for m in c.modules() if isinstance(m, TopKRouter)]
        self._handles = [r.register_forward_hook(self._hook) for r in self.routers]
        if self.routers and self.routers[0].config.sequence_parallel and tp > 1:
            self._tp = tp

    def begin(self, mask: Tensor) -> None:
        """Start a micro-batch whose counted tokens are `mask` ([S, B], `token_mask`)."""
        if self._tp > 1:  # this rank's sequence slice, as megatron's scatter cuts it
            from megatron.core import parallel_state

            rank = parallel_state.get_tensor_model_parallel_rank()
            mask = mask.chunk(self._tp, dim=0)[rank]
        self._mask, self._sums = mask.reshape(-1), None

    def _hook(self, router: torch.nn.Module, args: tuple, output: tuple) -> None:
        if self._mask is None or not torch.is_grad_enabled():
            return
        hidden = args[0]
        logits = F.linear(hidden.reshape(-1, hidden.shape[-1]), router.weight)
        _, routing_map = output
        sums = layer_sums(logits, routing_map.reshape(logits.shape), self._mask)
        self._sums = list(sums) if self._sums is None else [a + b for a, b in zip(self._sums, sums)]

    def loss(self) -> Tensor | None:
        """This micro-batch's balance loss (None if no router ran with autograd); resets."""
        sums, self._mask, self._sums = self._sums, None, None
        if sums is None:
            return None
        if self._tp > 1:
            from megatron.core import parallel_state
            from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

            counts, prob_sums, tokens = sums
            group = parallel_state.get_tensor_model_parallel_group()
            totals = torch.cat([counts.detach(), tokens.detach().reshape(1)])
            torch.distributed.all_reduce(totals, group=group)
            # Forward: the sum over the TP ranks; backward: identity, so each rank's gradient
            # reaches its own tokens (the replicated router's gradients are then summed over
            # TP by megatron, as for every sequence-parallel parameter).
            prob_sums = reduce_from_tensor_model_parallel_region(prob_sums)
            sums = [totals[:-1], prob_sums, totals[-1]]
        return balance_loss(*sums)

    def remove(self) -> None:
        """Detach the hooks."""
        for handle in self._handles:
            handle.remove()


def with_aux_loss(
    stats: RouterStatistics | None, coeff: float, loss: Tensor, reported: dict[str, Tensor]
) -> tuple[Tensor, dict[str, Tensor]]:
    """A training micro-batch's loss plus `coeff` x its balance loss (the aux value reported
    under "aux"); unchanged when `stats` is None or no router ran with autograd."""
    aux = stats.loss() if stats is not None else None
    if aux is None:
        return loss, reported
    return loss + coeff * aux, {**reported, "aux": aux.detach()}


def aux_scalars(reported: list[dict[str, Tensor]], coeff: float) -> dict[str, Tensor]:
    """Per-step scalars `aux_loss` (mean over every micro-batch of every data-parallel rank, as
    TRL's gathered mean) and `aux_loss_term` (x `coeff`); empty without aux values."""
    from megatron_kto.models.forward import data_parallel_all_reduce

    values = [r["aux"] for r in reported if "aux" in r]
    if not values:
        return {}
    aux = torch.stack(values).to(torch.float64)
    totals = torch.stack([aux.sum(), torch.full_like(aux.sum(), float(aux.numel()))])
    data_parallel_all_reduce(totals)
    mean = totals[0] / totals[1]
    return {"aux_loss": mean, "aux_loss_term": coeff * mean}


def add_aux_metrics(metrics: dict[str, float], scalars: dict[str, Tensor]) -> dict[str, float]:
    """TRL's logging: `aux_loss`, and a `loss` that includes the coefficient-weighted term."""
    if "aux_loss" in scalars:
        metrics["aux_loss"] = float(scalars["aux_loss"])
        metrics["loss"] += float(scalars["aux_loss_term"])
    return metrics
