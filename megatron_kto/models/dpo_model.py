"""MegatronGPTDPOModel: DPO on megatron-core GPT chunks (same machinery as the KTO model).

A reference-free objective (`cpo`, `simpo`, `orpo`: `DPOLossKind.needs_reference` is False)
makes `needs_reference` False: the trainer then runs no reference pass, the batches carry no
reference log-probs and the step is one forward+backward of the policy.

A training micro-batch holds `micro_batch_size` pairs: their chosen rows followed by their
rejected rows, so each pair's loss is computed inside one micro-batch (packed end to end, in that
order, unless `pack_sequences` is off).

A loss that pairs values by rank over the global batch (`aot`, `aot_unpaired`:
`DPOLossKind.sorts_batch`) first runs the policy forward-only over this rank's pairs, gathers
every data-parallel rank's log-probs (fixed size) and gives each pair its rank partners
(`losses.batch_sort`), so the sort is over the global batch whatever the micro-batch size or DP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core import parallel_state

from megatron_kto.losses.batch_sort import SortPartners, sort_partners
from megatron_kto.losses.dpo import dpo_total_loss
from megatron_kto.losses.dpo_types import (
    loss_type_names,
    needs_reference,
    orpo_log_odds,
    sorts_batch,
)
from megatron_kto.losses.length_desensitized import ld_token_weights
from megatron_kto.losses.metrics import (
    DPO_METRICS,
    dpo_metric_set,
    dpo_metric_sums,
    reference_free_metric_sums,
)
from megatron_kto.models.expert_load import add_load_metrics, expert_load
from megatron_kto.models.forward import (
    LABEL_WEIGHTS,
    LOGIT_SUM,
    LOGP_SUM,
    NLL_LOGP_SUM,
    NLL_NUM_TOKENS,
    NUM_TOKENS,
    data_parallel_all_gather,
    data_parallel_all_reduce,
    forward_sequence_stats,
    stats_forward_step,
)
from megatron_kto.models.logprobs import IGNORE_INDEX
from megatron_kto.models.output_head import DEFAULT_LOGPROB_CHUNK_SIZE
from megatron_kto.models.packing import (
    DEFAULT_PACK_SEQUENCES,
    NLL_ONLY,
    NUM_SCORED,
    ROW_LENGTHS,
    SCORED_SPANS,
)
from megatron_kto.models.prompt_nll import CHOSEN_NLL_ONLY, with_prompt_nll
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
)

REF_CHOSEN = "ref_policy_log_probs_chosen"
REF_REJECTED = "ref_policy_log_probs_rejected"
#: Batch keys of the pairs' chosen and rejected rewards from the data (`data.collate`; RPO).
REWARDS = ("chosen_rewards", "rejected_rewards")
#: A micro-batch's keys for its pairs' `SortPartners` fields (aot, aot_unpaired).
_PARTNERS = ("aot_offset", "unpaired_rejected", "unpaired_chosen")


@dataclass(frozen=True)
class DPOSettings:
    """Loss and batching settings of a DPO run."""

    beta: float
    loss_type: str | tuple[str, ...]
    """A name of losses.DPO_LOSS_TYPES or several (their weighted sum)."""
    label_smoothing: float
    average_log_probs: bool
    sft_loss_weight: float
    micro_batch_size: int
    forward_micro_batch_size: int
    vocab_size: int
    sft_average_log_probs: bool = True
    preference_loss_weight: float = 1.0
    logprob_chunk_size: int = DEFAULT_LOGPROB_CHUNK_SIZE
    """Tokens per chunk of the completion-only output layer; 0 computes full logits."""
    pack_sequences: bool = DEFAULT_PACK_SEQUENCES
    """Padding-free micro-batches: rows packed end to end (`models.packing`)."""
    loss_weights: tuple[float, ...] | None = None
    """One weight per loss_type entry; None means all 1."""
    discopop_tau: float = 0.05
    """τ of the discopop loss."""
    f_divergence_type: str = "reverse_kl"
    """f-DPO regulariser (losses.f_divergence)."""
    f_alpha_divergence_coef: float = 0.5
    """α of alpha_divergence."""
    simpo_gamma: float = 0.5
    """γ, SimPO's target margin."""
    cpo_alpha: float = 1.0
    """α, the chosen NLL's weight in CPO and SimPO."""
    gt_reward_scale: float = 1.0
    """RPO losses: the reward gap is gt_reward_scale × (chosen − rejected reward) of the data."""
    prompt_nll: bool = False
    """The reference-free NLL also scores the chosen rows' prompt tokens (TRL's ORPO;
    `models.prompt_nll`)."""
    ld_alpha: float | None = None
    """LD-DPO: the weight of the tokens beyond the pair's shorter completion in every log-prob
    (policy and reference; `losses.length_desensitized`); None: plain sums."""
    router_aux_loss_coeff: float = 0.0
    """MoE only: weight of the router load-balancing loss over each training micro-batch (its
    chosen and rejected rows, one forward as TRL's concatenated pass); 0 = off."""


def _logps(stats: torch.Tensor, average: bool) -> torch.Tensor:
    logps = stats[:, LOGP_SUM]
    return logps / stats[:, NUM_TOKENS].clamp(min=1) if average else logps


class MegatronGPTDPOModel:
    """Policy chunks + a reference policy + the DPO loss, driven by megatron-core schedules."""

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        reference: ReferencePolicy | None,
        settings: DPOSettings,
    ):
        self.chunks = chunks
        self.reference = reference
        self.settings = settings
        names = loss_type_names(settings.loss_type)
        self.needs_reference = needs_reference(names)
        """False for the reference-free objectives: no reference pass is ever run."""
        self.sorts_batch = sorts_batch(names)
        """True for aot / aot_unpaired: a forward-only policy pass precedes each step."""
        self.metrics = dpo_metric_set(names)
        coeff = settings.router_aux_loss_coeff
        self.router_stats = RouterStatistics(chunks, coeff) if coeff else None
        self.expert_load = expert_load(chunks)

    def label_weights(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """LD-DPO's per-position weights of the chosen and rejected rows ([B, T] each), or None
        without `ld_alpha`."""
        if self.settings.ld_alpha is None:
            return None
        return ld_token_weights(
            batch["chosen_labels"] != IGNORE_INDEX,
            batch["rejected_labels"] != IGNORE_INDEX,
            self.settings.ld_alpha,
        )

    def forward_logprobs(
        self, batch: Batch, chunks: list[torch.nn.Module], micro_batch_size: int | None = None
    ) -> torch.Tensor:
        """Log-probs of chosen rows then rejected rows ([2B]; per-token means if
        length-normalised) under `chunks`, forward-only, identical on every pipeline stage."""
        tokens = torch.cat([batch["chosen"], batch["rejected"]])
        labels = torch.cat([batch["chosen_labels"], batch["rejected_labels"]])
        positions = torch.cat([batch["position_ids"], batch["position_ids"]])
        s = self.settings
        mbs = micro_batch_size or s.forward_micro_batch_size
        scored = scored_per_row(batch, "chosen_labels") + scored_per_row(batch, "rejected_labels")
        spans = scored_spans(batch, "chosen_labels", "rejected_labels")
        lengths = None
        if s.pack_sequences:
            lengths = row_lengths(batch, "chosen_labels") + row_lengths(batch, "rejected_labels")
        weights = self.label_weights(batch)
        stats = forward_sequence_stats(
            chunks,
            tokens,
            labels,
            positions,
            mbs,
            s.vocab_size,
            s.logprob_chunk_size,
            scored,
            s.pack_sequences,
            lengths,
            spans,
            torch.cat(weights) if weights is not None else None,
        )
        return _logps(stats, s.average_log_probs)

    def get_ref_policy_logprobs(self, batch: Batch) -> torch.Tensor:
        """Reference log-probs of chosen rows then rejected rows ([2B])."""
        return self.reference.log_probs(batch, lambda chunks: self.forward_logprobs(batch, chunks))

    def global_sort_partners(self, batch: Batch) -> SortPartners:
        """This rank's pairs' rank partners over the global batch: a forward-only policy pass
        over its pairs, every DP rank's log-probs gathered (fixed size), sorted
        (`losses.batch_sort.sort_partners`), and this rank's share returned."""
        pc, pr = self.forward_logprobs(batch, self.chunks).double().chunk(2)
        local = torch.stack([pc, pr, batch[REF_CHOSEN].double(), batch[REF_REJECTED].double()])
        every = data_parallel_all_gather(local)  # [DP, 4, B]
        rows = pc.shape[0]
        whole = every.permute(1, 0, 2).reshape(4, -1)
        start = parallel_state.get_data_parallel_rank() * rows
        return sort_partners(*whole).rows(slice(start, start + rows))

    def _loss_fn(self, batch: Batch, stats: torch.Tensor):
        s = self.settings
        n = stats.shape[0] // 2
        logps = _logps(stats, s.average_log_probs)
        chosen_tokens = stats[:n, NUM_TOKENS]
        # The NLL's own sums: the whole chosen rows' with prompt_nll, else the completions'.
        nll_columns = (NLL_LOGP_SUM, NLL_NUM_TOKENS) if s.prompt_nll else (LOGP_SUM, NUM_TOKENS)
        nll_logps, nll_tokens = (stats[:n, c] for c in nll_columns)
        reference = self.needs_reference
        out = dpo_total_loss(
            logps[:n],
            logps[n:],
            batch["ref_chosen"] if reference else None,
            batch["ref_rejected"] if reference else None,
            s.beta,
            loss_type=s.loss_type,
            label_smoothing=s.label_smoothing,
            sft_loss_weight=s.sft_loss_weight,
            chosen_num_tokens=chosen_tokens,
            average_log_probs=s.average_log_probs,
            sft_average_log_probs=s.sft_average_log_probs,
            preference_loss_weight=s.preference_loss_weight,
            loss_weights=s.loss_weights,
            discopop_tau=s.discopop_tau,
            rejected_num_tokens=stats[n:, NUM_TOKENS],
            f_divergence_type=s.f_divergence_type,
            f_alpha_divergence_coef=s.f_alpha_divergence_coef,
            simpo_gamma=s.simpo_gamma,
            cpo_alpha=s.cpo_alpha,
            chosen_nll_logps=nll_logps if s.prompt_nll else None,
            chosen_nll_num_tokens=nll_tokens if s.prompt_nll else None,
            reward_margins=(
                s.gt_reward_scale * (batch[REWARDS[0]] - batch[REWARDS[1]])
                if REWARDS[0] in batch
                else None
            ),
            sort_partners=(
                SortPartners(*(batch[k].to(logps.dtype) for k in _PARTNERS))
                if self.sorts_batch
                else None
            ),
        )
        sums = dpo_metric_sums(
            out.chosen_rewards,
            out.rejected_rewards,
            logps[:n],
            logps[n:],
            stats[:n, LOGIT_SUM],
            chosen_tokens,
            stats[n:, LOGIT_SUM],
            stats[n:, NUM_TOKENS],
            out.per_example,
        )
        if self.metrics is not DPO_METRICS:
            per_token = stats[:, LOGP_SUM] / stats[:, NUM_TOKENS].clamp(min=1)
            log_odds = orpo_log_odds(per_token[:n].detach(), per_token[n:].detach())
            sums = reference_free_metric_sums(
                self.metrics, sums, -nll_logps.detach().sum(), nll_tokens, log_odds
            )
        return out.loss, {"sums": sums}

    def _micro_batches(self, batch: Batch, partners: SortPartners | None = None) -> list[Batch]:
        mbs = self.settings.micro_batch_size
        pairs = batch["chosen"].shape[0]
        if pairs % mbs:
            raise ValueError(f"{pairs} pairs cannot be split into micro-batches of {mbs}")
        chosen_scored = scored_per_row(batch, "chosen_labels")
        rejected_scored = scored_per_row(batch, "rejected_labels")
        chosen_spans = scored_spans(batch, "chosen_labels")
        rejected_spans = scored_spans(batch, "rejected_labels")
        # Kept in two parts: a micro-batch's rows are its pairs' chosen rows, then their rejected.
        pack = self.settings.pack_sequences
        chosen_lengths = row_lengths(batch, "chosen_labels") if pack else None
        rejected_lengths = row_lengths(batch, "rejected_labels") if pack else None
        weights = self.label_weights(batch)
        micro = []
        for i in range(0, pairs, mbs):
            sl = slice(i, i + mbs)
            micro.append(
                {
                    "tokens": torch.cat([batch["chosen"][sl], batch["rejected"][sl]]),
                    "labels": torch.cat([batch["chosen_labels"][sl], batch["rejected_labels"][sl]]),
                    "position_ids": torch.cat(
                        [batch["position_ids"][sl], batch["position_ids"][sl]]
                    ),
                    NUM_SCORED: sum(chosen_scored[sl]) + sum(rejected_scored[sl]),
                }
            )
            if weights is not None:
                micro[-1][LABEL_WEIGHTS] = torch.cat([weights[0][sl], weights[1][sl]])
            if CHOSEN_NLL_ONLY in batch:  # the rejected rows score nothing for the NLL alone
                marks = batch[CHOSEN_NLL_ONLY][sl]
                micro[-1][NLL_ONLY] = torch.cat([marks, torch.zeros_like(marks)])
            if partners is not None:
                mine = partners.rows(sl)
                micro[-1].update({k: getattr(mine, k) for k in _PARTNERS})
            for key in REWARDS:  # the pairs' rewards from the data (RPO losses)
                if key in batch:
                    micro[-1][key] = batch[key][sl]
            if self.needs_reference:
                micro[-1]["ref_chosen"] = batch[REF_CHOSEN][sl]
                micro[-1]["ref_rejected"] = batch[REF_REJECTED][sl]
            if chosen_spans is not None and rejected_spans is not None:
                micro[-1][SCORED_SPANS] = chosen_spans[sl] + rejected_spans[sl]
            if pack:
                micro[-1][ROW_LENGTHS] = chosen_lengths[sl] + rejected_lengths[sl]
        return micro

    def get_loss_and_metric_sums(
        self, batch: Batch, forward_only: bool
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The body of `get_loss_and_metrics` before finalising: the all-reduced [2K]
        (sum, count) tensor of `self.metrics` (`DPO_METRICS`, or CPO/ORPO's) and no per-batch scalars (for exact aggregation
        over several global batches). Reads nothing back to the host."""
        s = self.settings
        step = stats_forward_step(self._loss_fn, s.vocab_size, s.logprob_chunk_size)
        partners = self.global_sort_partners(batch) if self.sorts_batch else None
        if s.prompt_nll:
            batch = with_prompt_nll(batch)
        micro = self._micro_batches(batch, partners)
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
        sums = broadcast_from_last_stage(
            local, (self.metrics.size,), torch.float64, batch["chosen"].device
        )
        data_parallel_all_reduce(sums)
        scalars: dict[str, torch.Tensor] = {}
        if self.router_stats is not None and not forward_only:
            values = self.router_stats.step_values()  # on every stage
            scalars.update(aux_scalars(values, s.router_aux_loss_coeff))
        if self.expert_load is not None and not forward_only:
            scalars.update(self.expert_load.step_values(batch["chosen"].device))
        return sums, scalars

    def finalize_metrics(
        self, sums: torch.Tensor, scalars: dict[str, torch.Tensor]
    ) -> dict[str, float]:
        """Metrics (TRL names) from (possibly accumulated) sums."""
        return add_load_metrics(add_aux_metrics(self.metrics.finalize(sums), scalars), scalars)

    def get_loss_and_metrics(
        self, batch: Batch, forward_only: bool
    ) -> tuple[float, dict[str, float]]:
        """DPO loss and metrics over this global batch (training step body or validation)."""
        metrics = self.finalize_metrics(*self.get_loss_and_metric_sums(batch, forward_only))
        return metrics["loss"], metrics
