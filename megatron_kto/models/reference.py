"""Reference-policy strategies: where the frozen reference weights live during training.

Memory cost per rank (P = this rank's parameter bytes):

- `cpu_swap` (NeMo-Aligner's approach): +2P host memory (the reference copy and a backup of the
  policy while the reference is swapped in, both pinned on CUDA), +0 device memory; costs three
  host<->device copies of P per reference pass (policy out, reference in, policy back in),
  issued asynchronously on the compute stream.
- `separate`: +P device memory for a frozen second model; no copies.
- `precomputed`: +0 parameters anywhere; the run's reference forward passes are done before
  training (the KL rows of every epoch it will reach), then 1 + epochs floats per example (host
  memory and a file in the run directory); see `algorithms.precompute`.

The run chooses one strategy object per `reference_policy` (`algorithms.reference_strategies`),
which builds these and owns the other steps of a run that depend on the strategy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from megatron_kto.models.builder import named_weights, unwrap
from megatron_kto.models.training_setup import finish_param_sync

ForwardFn = Callable[[list[torch.nn.Module]], torch.Tensor]


class ReferencePolicy(Protocol):
    """Supplies reference log-probs for a batch."""

    def log_probs(self, batch: dict[str, torch.Tensor], forward: ForwardFn) -> torch.Tensor:
        """Reference log-probs of the batch's rows; `forward(chunks)` computes them with chunks
        that hold reference weights (strategies that keep weights call it)."""
        ...


def _tensors(chunks: list[torch.nn.Module]) -> list[torch.Tensor]:
    # Parameters and the buffers that are weights (`builder.WEIGHT_BUFFERS`: a sigmoid router's
    # expert bias, which `model.moe_router_bias_update_rate` moves during training): the set
    # that defines the forward function (rotary inv_freq is recomputed, not stored state).
    out: list[torch.Tensor] = []
    for chunk in chunks:
        out.extend(t.data for t in named_weights(unwrap(chunk)).values())
    return out


class CPUSwapReference:
    """Keeps a host copy of the initial weights and swaps it into the policy chunks on demand."""

    def __init__(self, policy_chunks: list[torch.nn.Module]):
        self._policy = policy_chunks
        # Pinned host buffers make the copies asynchronous DMA transfers on CUDA (pageable
        # memory would stage through a bounce buffer and block the host on every copy).
        pin = torch.cuda.is_available()
        finish_param_sync(policy_chunks)
        live = _tensors(policy_chunks)
        self._ref = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t) for t in live]
        self._backup = [torch.empty_like(t, pin_memory=pin) for t in self._ref]
        self._held = False

    def log_probs(self, batch: dict[str, torch.Tensor], forward: ForwardFn) -> torch.Tensor:
        """Run `forward` with the reference weights swapped into the policy chunks."""
        if self._held:
            return forward(self._policy)
        with self.swapped() as chunks:
            return forward(chunks)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Keep the reference weights swapped in across several `log_probs` calls (e.g. every
        batch of a validation pass): one swap in and out instead of one per call."""
        with self.swapped():
            self._held = True
            try:
                yield
            finally:
                self._held = False

    @contextlib.contextmanager
    def swapped(self) -> Iterator[list[torch.nn.Module]]:
        """Swap reference weights in (in place, so DDP buffer views stay valid), then back.

        All copies are `non_blocking` on the current stream and nothing waits for them: the
        stream orders backup -> reference-in -> forward -> restore, and the host never reads
        the pinned buffers, so a later swap cannot overwrite a buffer still being copied.
        """
        # A deferred parameter all-gather (distributed optimizer, overlap_param_gather) would
        # otherwise back up stale shards now and gather the *reference* into them later.
        finish_param_sync(self._policy)
        live = _tensors(self._policy)
        for t, ref, backup in zip(live, self._ref, self._backup, strict=True):
            backup.copy_(t, non_blocking=True)
            t.copy_(ref, non_blocking=True)
        try:
            yield self._policy
        finally:
            for t, backup in zip(live, self._backup, strict=True):
                t.copy_(backup, non_blocking=True)


class SeparateReference:
    """A frozen second set of chunks on the device."""

    def __init__(self, ref_chunks: list[torch.nn.Module]):
        for chunk in ref_chunks:
            chunk.eval()
            for p in chunk.parameters():
                p.requires_grad_(False)
        self._ref = ref_chunks

    def log_probs(self, batch: dict[str, torch.Tensor], forward: ForwardFn) -> torch.Tensor:
        """Run `forward` on the frozen chunks."""
        return forward(self._ref)


class PrecomputedReference:
    """Looks reference log-probs up in a table precomputed before training
    (`algorithms.precompute`): by example (`batch["index"]`) and, for KTO's KL rows, by the
    epoch their partner was chosen in (`batch["epoch"]`).

    Args:
        table: float32 on the CPU, one row per (offset) example: KTO ``[N, 1 + E]`` (own row,
            then the KL row of each epoch), DPO ``[N, 2]`` (chosen, rejected). NaN marks entries
            the run was not expected to need.
    """

    def __init__(self, table: torch.Tensor):
        self.table = table

    def log_probs(self, batch: dict[str, torch.Tensor], forward: ForwardFn) -> torch.Tensor:
        """[2B] log-probs: the batch's first rows, then its second rows (as `forward` would)."""
        if "index" not in batch:
            raise KeyError("reference_policy=precomputed needs batches with an `index` key")
        index = batch["index"].to(torch.long).cpu()
        if "epoch" in batch:  # KTO: the sample row, then the KL row of this epoch
            columns = 1 + batch["epoch"].to(torch.long).cpu()
            values = torch.cat([self.table[index, 0], self.table[index, columns]])
        else:
            values = self.table[index].t().reshape(-1)
        if torch.isnan(values).any():  # a CPU check: no device synchronisation
            raise RuntimeError(
                "reference_policy=precomputed: no precomputed reference log-prob for examples "
                f"{index.tolist()} — the run consumed batches the table was not computed for"
            )
        return values.to(batch["index"].device)


def holding(reference: ReferencePolicy) -> contextlib.AbstractContextManager:
    """A scope in which consecutive `reference.log_probs` calls share one weight swap
    (`CPUSwapReference.held`); strategies without a swap need no scope."""
    held = getattr(reference, "held", None)
    return held() if held is not None else contextlib.nullcontext()


def copy_weights(src: list[torch.nn.Module], dst: list[torch.nn.Module]) -> None:
    """Copy parameters chunk by chunk (same layout) — used to initialise `separate`."""
    with torch.no_grad():
        for s, d in zip(_tensors(src), _tensors(dst), strict=True):
            d.copy_(s)
