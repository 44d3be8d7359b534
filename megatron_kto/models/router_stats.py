"""The router load-balancing loss of each training micro-batch, across pipeline stages.

`RouterStatistics(chunks, coeff)` hooks every megatron MoE router (`TopKRouter`) of the model
chunks. A training pass runs each row's final token too (`append_final_tokens`), as TRL does. For
each micro-batch the forward step (`announce_micro_batches`) calls `begin(token_mask(batch))`
with the tokens that count (in the router's token order); each router then adds its
`losses.router_aux.layer_sums` — recomputing its logits from its input, so the gradient reaches
the router weights and the hidden states as in Hugging Face — and `finish()` ends the micro-batch
on this stage. Outside a `begin` ... `finish` window, and whenever autograd is off (reference and
KL passes, validation), the hooks do nothing: forward-only passes add nothing and cost nothing.

Hugging Face's loss is joint over all layers (a product of sums over layers and tokens), so with
pipeline parallelism (and under sequence parallelism, where each TP rank routes a slice of the
sequence) the ranks holding parts of a micro-batch share their statistics: `finish` starts an
asynchronous all-reduce of this rank's [counts, probability sums, tokens] over them — the later
stages have not run the micro-batch yet — and its result is read when this stage runs the
micro-batch's backward (every stage has run its forward by then), and for the logged value
(`step_values`, the whole model's, on every rank). That all-reduce runs on a process group of its
own (`own_group`: the ranks of megatron's pipeline or model-parallel group, another NCCL
communicator). On megatron's pipeline group it would deadlock NCCL, which runs a group's
collectives and batched sends in issue order on one communicator: stage 0 queues [all-reduce(mb0),
send(mb0)], the last stage [recv(mb0), ..., all-reduce(mb0)] (gloo lets it pass; the tests replay
the order as NCCL would, `tests/nccl_order.py`). Each router's share of the gradient,
E · C / T² per expert with the global counts C and token total T, enters through megatron-core's
`MoEAuxLossAutoScaler` on the router's output (how megatron attaches its own MoE losses on every
stage, with the main loss's scale). Virtual pipelining (several chunks per rank, their micro-
batches interleaved) and full activation recompute (routers re-run in backward) are refused
with the loss (`config.validate`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_kto.losses.router_aux import balance_loss, layer_sums
from megatron_kto.models.packing import (
    PACKED,
    PAD_VALUES,
    POSITION_KEYS,
    ROUTED_TAIL,
    ROW_LENGTHS,
    kept_lengths,
)
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
    for key in POSITION_KEYS:  # LD-DPO's weights, ORPO's NLL-only marks follow the labels
        if key in micro:
            out[key] = F.pad(micro[key], (0, 1), value=PAD_VALUES[key])
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
    """`forward_step` that first tells `stats` which tokens of each micro-batch count and, once
    this stage's forward of the micro-batch has run, hands its statistics on (`finish`)."""

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
        result = forward_step(_Announcing(data_iterator), model)
        stats.finish()
        return result

    return step


#: (megatron's group, the group of its own made from it by `own_group`), most recent last.
_OWN_GROUPS: list[tuple[object, object]] = []


def own_group(group):
    """A process group with the ranks of `group` (one of megatron's) but a communicator of its own.

    NCCL runs all of a communicator's collectives and batched point-to-point operations in the
    order each rank issued them; the statistics' all-reduce, issued between stages' sends and
    receives, must not share a queue with them. Every group needs every rank to call
    `torch.distributed.new_group` for it, in the same order: each rank shares its group's rank
    list over the world (the partition megatron made, e.g. all pipeline groups) and all create
    the distinct lists in sorted order. Collective over the whole world: every rank calls it at
    the same point, with its own group of the same kind; made once per megatron group (cached).
    """
    for source, own in _OWN_GROUPS:
        if source is group:
            return own
    import torch.distributed as dist

    mine = dist.get_process_group_ranks(group)
    lists: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(lists, mine)
    own = None
    for ranks in sorted({tuple(r) for r in lists}):
        created = dist.new_group(list(ranks), group_desc="ROUTER_STATISTICS")
        if list(ranks) == mine:
            own = created
    _OWN_GROUPS[:] = [(group, own)]  # a new parallel state replaces the old one's groups
    return own


class _Totals:
    """One micro-batch's statistics [counts E, probability sums E, tokens], summed over the ranks
    that route parts of it (pipeline stages; TP ranks under sequence parallelism). Filled when
    this stage's forward of the micro-batch ends (an asynchronous all-reduce: the later stages
    have not run it yet); read in its backward, when every stage has."""

    def __init__(self) -> None:
        self.buffer: Tensor | None = None
        self.work = None

    def result(self) -> Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        assert self.buffer is not None, "read before the micro-batch's forward ended"
        return self.buffer


class _BalanceGradient(torch.autograd.Function):
    """d(balance loss of the whole model)/d(one router's probability sums) = E · C / T², with C
    the micro-batch's selection counts and T its token total over all layers and ranks
    (`losses.router_aux.balance_loss`; C carries no gradient). Both are known only once every
    stage has run the micro-batch, so they are read in backward. The forward value is 0: the
    loss's value is `RouterStatistics.step_values`, its gradient enters through megatron's
    `MoEAuxLossAutoScaler`, which gives this term the main loss's scale."""

    @staticmethod
    def forward(ctx, prob_sums: Tensor, totals: _Totals) -> Tensor:
        ctx.totals = totals
        return prob_sums.new_zeros(())

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        buffer = ctx.totals.result()
        experts = (buffer.numel() - 1) // 2
        counts, tokens = buffer[:experts], buffer[-1].clamp(min=1.0)
        return grad * experts * counts / tokens**2, None


class RouterStatistics:
    """Forward hooks on the routers of `chunks` that add the balance loss of each training
    micro-batch: its value (`step_values`) and gradient, across pipeline stages."""

    def __init__(self, chunks: list[torch.nn.Module], coeff: float):
        """
        Args:
            chunks: this rank's model chunks (one: virtual pipelining is refused with the loss).
            coeff: weight of the loss in the training loss (`router_aux_loss_coef`).
        """
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.utils import get_model_config

        config = get_model_config(chunks[0])
        self._experts = int(config.num_moe_experts)
        self._coeff = coeff
        self._mask: Tensor | None = None
        self._sums: list[Tensor] | None = None
        self._totals: _Totals | None = None
        self._done: list[_Totals] = []
        tp = parallel_state.get_tensor_model_parallel_world_size()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        # Under sequence parallelism each TP rank routes its slice of the sequence; each stage
        # routes its own layers: the statistics are summed over those ranks (TP x PP).
        self._tp = tp if config.sequence_parallel and tp > 1 else 1
        self._group = None
        if self._tp > 1:
            self._group = own_group(parallel_state.get_model_parallel_group())
        elif pp > 1:
            self._group = own_group(parallel_state.get_pipeline_model_parallel_group())
        self.routers = [m for c in chunks for m in c.modules() if isinstance(m, TopKRouter)]
        self._handles = [r.register_forward_hook(self._hook) for r in self.routers]

    def begin(self, mask: Tensor) -> None:
        """Start a micro-batch whose counted tokens are `mask` ([S, B], `token_mask`)."""
        if self._tp > 1:  # this rank's sequence slice, as megatron's scatter cuts it
            from megatron.core import parallel_state

            rank = parallel_state.get_tensor_model_parallel_rank()
            mask = mask.chunk(self._tp, dim=0)[rank]
        self._mask, self._sums, self._totals = mask.reshape(-1), None, _Totals()

    def _hook(self, router: torch.nn.Module, args: tuple, output: tuple) -> tuple | None:
        if self._mask is None or not torch.is_grad_enabled():
            return None
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        hidden = args[0]
        # Recomputed from the router's input, so the gradient reaches the router weights (and
        # bias: GPT-OSS) and the hidden states as in Hugging Face.
        bias = getattr(router, "bias", None)
        logits = F.linear(hidden.reshape(-1, hidden.shape[-1]), router.weight, bias)
        probs, routing_map = output
        counts, prob_sums, tokens = layer_sums(
            logits, routing_map.reshape(logits.shape), self._mask
        )
        sums = [counts, prob_sums.detach(), tokens]
        self._sums = sums if self._sums is None else [a + b for a, b in zip(self._sums, sums)]
        term = _BalanceGradient.apply(prob_sums, self._totals)
        # megatron's own way to give a loss term computed inside a layer the main loss's scale
        # (set by its schedule: loss scale / micro-batches) on every pipeline stage.
        return MoEAuxLossAutoScaler.apply(probs, self._coeff * term), routing_map

    def finish(self) -> None:
        """End of this stage's forward of the micro-batch: start summing its statistics over the
        ranks that share it. Every stage calls it for every training micro-batch, in order, so
        the collectives match (a stage whose routers did not run contributes zeros)."""
        if self._mask is None:
            return
        device = self._mask.device
        zeros = [torch.zeros(self._experts, device=device)] * 2 + [torch.zeros((), device=device)]
        sums = self._sums or zeros
        totals = self._totals
        totals.buffer = torch.cat([t.detach().float().reshape(-1) for t in sums])
        if self._group is not None:
            totals.work = torch.distributed.all_reduce(
                totals.buffer, group=self._group, async_op=True
            )
        self._done.append(totals)
        self._mask = self._sums = self._totals = None

    def step_values(self) -> list[Tensor]:
        """The whole model's balance loss of every micro-batch trained since the last call, in
        order, on every stage and rank of the micro-batch; resets."""
        done, self._done = self._done, []
        e = self._experts
        return [balance_loss(b[:e], b[e : 2 * e], b[-1]) for b in (t.result() for t in done)]

    def remove(self) -> None:
        """Detach the hooks."""
        for handle in self._handles:
            handle.remove()


def aux_scalars(values: list[Tensor], coeff: float) -> dict[str, Tensor]:
    """Per-step scalars `aux_loss` (mean over every micro-batch of every data-parallel rank, as
    TRL's gathered mean) and `aux_loss_term` (x `coeff`) from `RouterStatistics.step_values`;
    empty without values."""
    from megatron_kto.models.forward import data_parallel_all_reduce

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
