"""MegatronGPTKTOModel: KTO on megatron-core GPT chunks, through megatron-core's pipeline schedules.

Per global batch (DESIGN.md §1, "Efficiency"):

1. `get_ref_policy_logprobs`: one forward-only pass of the reference over samples + KL rows (2B).
2. `get_loss_and_metrics`: one forward-only pass of the *policy* over the KL rows (B), giving
   z₀ = max(0, mean r_KL) with the mean sample-weighted across DP ranks — z₀ carries no gradient,
   so these rows never enter autograd — then forward+backward over the B sample rows only.

Micro-batch size 1 therefore works: the KL estimate always uses the whole global batch.

A loss that ignores z₀ (`apo_zero_unpaired`) has no KL rows at all: the collate does not build
them, neither pass runs over them, and the `kl` metric reads 0 (as TRL logs it).

Every pass computes log-probs only where the loss looks (completion positions), chunk by chunk,
unless `logprob_chunk_size` is 0 (`models.output_head`), and runs padding-free micro-batches
(rows packed end to end, `models.packing`) unless `pack_sequences` is off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_kto.losses._common import per_token_mean
from megatron_kto.losses.kto import kl_reference_point, kto_total_loss, uses_kl_reference_point
from megatron_kto.losses.metrics import KTO_METRICS, finalize_kto_metrics, kto_metric_sums
from megatron_kto.models.expert_load import add_load_metrics, expert_load
from megatron_kto.models.forward import (
    LOGIT_SUM,
    LOGP_SUM,
    NUM_TOKENS,
    data_parallel_all_reduce,
    forward_sequence_stats,
    stats_forward_step,
)
from megatron_kto.models.output_head import DEFAULT_LOGPROB_CHUNK_SIZE
from megatron_kto.models.packing import DEFAULT_PACK_SEQUENCES
from megatron_kto.models.reference import ReferencePolicy
from megatron_kto.models.router_stats import (
    RouterStatistics,
    add_aux_metrics,
    announce_micro_batches,
    append_final_tokens,
    aux_scalars,
)
from megatron_kto.models.schedule import (
    Batch,
    broadcast_from_last_stage,
    row_lengths,
    run_schedule,
    scored_per_row,
    scored_spans,
    split_micro_batches,
)

REF_SAMPLES = "ref_policy_log_probs_samples"
REF_KL = "ref_policy_log_probs_kl"


@dataclass(frozen=True)
class KTOSettings:
    """Loss and batching settings of a KTO run."""

    beta: float
    desirable_weight: float
    undesirable_weight: float
    loss_type: str
    sft_loss_weight: float
    micro_batch_size: int
    forward_micro_batch_size: int
    vocab_size: int
    average_log_probs: bool = False
    """Rewards (and z₀) from per-token mean log-probs (NeMo's preference_average_log_probs)."""
    sft_average_log_probs: bool = True
    preference_loss_weight: float = 1.0
    logprob_chunk_size: int = DEFAULT_LOGPROB_CHUNK_SIZE
    """Tokens per chunk of the completion-only output layer; 0 computes full logits."""
    pack_sequences: bool = DEFAULT_PACK_SEQUENCES
    """Padding-free micro-batches: rows packed end to end (`models.packing`)."""
    router_aux_loss_coeff: float = 0.0
    """MoE only: weight of the router load-balancing loss (`losses.router_aux`) added to each
    training micro-batch's loss, as TRL adds HF's `router_aux_loss_coef · aux_loss`; 0 = off."""

    @property
    def uses_kl_rows(self) -> bool:
        """Whether z₀ enters the loss (else no KL row is built or run)."""
        return uses_kl_reference_point(self.loss_type)


class MegatronGPTKTOModel:
    """Policy chunks + a reference policy + the KTO loss, driven by megatron-core schedules."""

    needs_reference = True
    """KTO's rewards are policy/reference log-ratios: every step runs the reference pass."""

    def __init__(
        self, chunks: list[torch.nn.Module], reference: ReferencePolicy, settings: KTOSettings
    ):
        """
        Args:
            chunks: this rank's policy chunks, DDP-wrapped for training.
            reference: where the reference weights come from.
            settings: loss and batching settings.
        """
        self.chunks = chunks
        self.reference = reference
        self.settings = settings
        coeff = settings.router_aux_loss_coeff
        self.router_stats = RouterStatistics(chunks, coeff) if coeff else None
        self.expert_load = expert_load(chunks)

    def forward_logprobs(
        self, batch: Batch, chunks: list[torch.nn.Module], micro_batch_size: int | None = None
    ) -> torch.Tensor:
        """Summed completion log-probs of the samples then the KL rows ([2B]; [B], the samples
        alone, when the loss ignores z₀) under `chunks`, forward-only, identical on every
        pipeline stage."""
        keys = [("samples", "sample_labels")]
        if self.settings.uses_kl_rows:
            keys.append(("kl_samples", "kl_sample_labels"))
        tokens = torch.cat([batch[t] for t, _ in keys])
        labels = torch.cat([batch[lab] for _, lab in keys])
        positions = torch.cat([batch["position_ids"]] * len(keys))
        scored = [n for _, lab in keys for n in scored_per_row(batch, lab)]
        spans = scored_spans(batch, *(lab for _, lab in keys))
        s = self.settings
        lengths = (
            [n for _, lab in keys for n in row_lengths(batch, lab)] if s.pack_sequences else None
        )
        stats = forward_sequence_stats(
            chunks,
            tokens,
            labels,
            positions,
            micro_batch_size or s.forward_micro_batch_size,
            s.vocab_size,
            s.logprob_chunk_size,
            scored,
            s.pack_sequences,
            lengths,
            spans,
        )
        return stats[:, LOGP_SUM]

    def get_ref_policy_logprobs(self, batch: Batch) -> torch.Tensor:
        """Reference log-probs of the samples and the KL rows (one forward-only pass over both).

        Args:
            batch: a collated KTO batch on the device (`kto_custom_collate` keys).

        Returns:
            [2B] float32 summed completion log-probs: rows 0..B-1 are the samples, rows B..2B-1
            the KL rows (absent when the loss ignores z₀); identical on every pipeline stage.
        """
        return self.reference.log_probs(batch, lambda chunks: self.forward_logprobs(batch, chunks))

    def kl_row_stats(self, batch: Batch, chunks: list[torch.nn.Module]) -> torch.Tensor:
        """Forward-only [B, 3] statistics (`forward_sequence_stats`) of the KL rows alone."""
        s = self.settings
        return forward_sequence_stats(
            chunks,
            batch["kl_samples"],
            batch["kl_sample_labels"],
            batch["position_ids"],
            s.forward_micro_batch_size,
            s.vocab_size,
            s.logprob_chunk_size,
            scored_per_row(batch, "kl_sample_labels"),
            s.pack_sequences,
            row_lengths(batch, "kl_sample_labels") if s.pack_sequences else None,
            scored_spans(batch, "kl_sample_labels"),
        )

    def kl_reference_point(self, batch: Batch) -> torch.Tensor:
        """z₀ for this global batch: policy forward-only over the KL rows, reduced over DP.

        0 without running anything when the loss does not use z₀.
        """
        device = batch["samples"].device
        if not self.settings.uses_kl_rows:
            return torch.zeros((), dtype=torch.float32, device=device)
        policy_kl = self.kl_row_stats(batch, self.chunks)
        r_kl = policy_kl[:, LOGP_SUM] - batch[REF_KL]
        if self.settings.average_log_probs:
            r_kl = per_token_mean(r_kl, policy_kl[:, NUM_TOKENS])
        # The count is a fill kernel, not torch.tensor(n, device=...): a host->device copy from
        # pageable memory would wait for the queued forward pass.
        count = torch.full((), float(r_kl.numel()), dtype=torch.float64, device=r_kl.device)
        totals = torch.stack([r_kl.sum().double(), count])
        data_parallel_all_reduce(totals)
        return kl_reference_point(totals[0], totals[1]).float()

    def _loss_fn(self, batch: Batch, stats: torch.Tensor, z0: torch.Tensor):
        s = self.settings
        policy_logps, num_tokens = stats[:, LOGP_SUM], stats[:, NUM_TOKENS]
        out = kto_total_loss(
            policy_logps,
            batch["ref_logps"],
            batch["preference"].bool(),
            z0,
            s.beta,
            desirable_weight=s.desirable_weight,
            undesirable_weight=s.undesirable_weight,
            loss_type=s.loss_type,
            sft_loss_weight=s.sft_loss_weight,
            num_tokens=num_tokens,
            average_log_probs=s.average_log_probs,
            sft_average_log_probs=s.sft_average_log_probs,
            preference_loss_weight=s.preference_loss_weight,
        )
        sums = kto_metric_sums(
            out.rewards,
            per_token_mean(policy_logps, num_tokens) if s.average_log_probs else policy_logps,
            batch["preference"].bool(),
            stats[:, LOGIT_SUM],
            num_tokens,
            out.per_example,
        )
        return out.loss, {"sums": sums}

    def get_loss_and_metric_sums(
        self, batch: Batch, forward_only: bool
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The body of `get_loss_and_metrics`, before finalising: what a caller needs to
        aggregate several global batches (a validation pass, a logging interval) exactly.

        Everything stays on the device — nothing here reads a device value on the host
        (tests/test_hot_loop_sync.py) — so the kernels of all micro-batches queue up without a
        stall.

        Returns:
            (the all-reduced [2K] (sum, count) tensor of `KTO_METRICS`, per-batch scalars
            `{"kl": z₀}`), same on all ranks; `finalize_metrics` turns them into metrics.
        """
        z0 = self.kl_reference_point(batch)
        rows = {
            "tokens": batch["samples"],
            "labels": batch["sample_labels"],
            "position_ids": batch["position_ids"],
            "preference": batch["preference"],
            "ref_logps": batch[REF_SAMPLES],
        }
        s = self.settings
        micro = split_micro_batches(
            rows,
            s.micro_batch_size,
            scored=scored_per_row(batch, "sample_labels"),
            lengths=row_lengths(batch, "sample_labels") if s.pack_sequences else None,
            spans=scored_spans(batch, "sample_labels"),
        )
        step = stats_forward_step(
            lambda b, stats: self._loss_fn(b, stats, z0), s.vocab_size, s.logprob_chunk_size
        )
        pack = s.pack_sequences
        if forward_only:
            with torch.no_grad():
                reported = run_schedule(self.chunks, micro, step, forward_only=True, pack=pack)
        else:
            if self.router_stats is not None:
                step = announce_micro_batches(step, self.router_stats)
                micro = [append_final_tokens(b) for b in micro]
            if self.expert_load is not None:
                step = announce_micro_batches(step, self.expert_load)
            reported = run_schedule(self.chunks, micro, step, forward_only=False, pack=pack)
        local = torch.stack([r["sums"] for r in reported]).sum(0) if reported else None
        device = batch["samples"].device
        sums = broadcast_from_last_stage(local, (KTO_METRICS.size,), torch.float64, device)
        data_parallel_all_reduce(sums)
        scalars = {"kl": z0}
        if self.router_stats is not None and not forward_only:
            values = self.router_stats.step_values()  # on every stage
            scalars.update(aux_scalars(values, s.router_aux_loss_coeff))
        if self.expert_load is not None and not forward_only:
            scalars.update(self.expert_load.step_values(device))
        return sums, scalars

    @staticmethod
    def finalize_metrics(sums: torch.Tensor, scalars: dict[str, torch.Tensor]) -> dict[str, float]:
        """Metrics (TRL names) from (possibly accumulated) sums; `scalars["kl"]` is the z₀ used
        (its mean over the batches when accumulated). The step's one device->host read."""
        metrics = add_aux_metrics(finalize_kto_metrics(sums, scalars["kl"]), scalars)
        return add_load_metrics(metrics, scalars)

    def get_loss_and_metrics(
        self, batch: Batch, forward_only: bool
    ) -> tuple[float, dict[str, float]]:
        """KTO loss and metrics over this global batch (training step body or validation).

        For training (`forward_only=False`) gradients are accumulated in the DDP buffers (and
        reduced over DP by megatron's finalize hook); the caller steps the optimizer.

        Args:
            batch: collated KTO batch on the device, with `REF_SAMPLES`/`REF_KL` attached.
            forward_only: validation (no backward).

        Returns:
            (mean loss over the global batch, metrics dict with TRL names), same on all ranks.
        """
        metrics = self.finalize_metrics(*self.get_loss_and_metric_sums(batch, forward_only))
        return metrics["loss"], metrics
