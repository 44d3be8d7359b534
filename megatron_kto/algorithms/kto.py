"""KTOTrainer: `DPOTrainer.fit()` with KTO's reference pass (samples and KL rows)."""

from __future__ import annotations

import torch

from megatron_kto.algorithms.dpo import DPOTrainer
from megatron_kto.logging.throughput import FWD_BWD_MULTIPLIER, kto_pass_tokens
from megatron_kto.models.kto_model import REF_KL, REF_SAMPLES
from megatron_kto.models.schedule import Batch


class KTOTrainer(DPOTrainer):
    """Trains a `MegatronGPTKTOModel`; everything but the batch preparation is `DPOTrainer`'s."""

    def attach_reference(self, batch: Batch, ref: torch.Tensor) -> None:
        """Store the reference log-probs of the 2B rows (one forward-only pass of the reference
        over samples and KL rows), split into `ref_policy_log_probs_samples` [B] and
        `ref_policy_log_probs_kl` [B]."""
        batch[REF_SAMPLES], batch[REF_KL] = ref.chunk(2)

    def step_cost_tokens(self, batch: Batch) -> tuple[float, float]:
        """KTO step cost: reference fwd over samples+KL (1x each), policy fwd over KL (1x),
        policy fwd+bwd over samples (3x) — in real (unpadded) tokens."""
        samples = int(batch["sample_lengths"].sum())
        kl = int(batch["kl_sample_lengths"].sum())
        forward_only, forward_backward = kto_pass_tokens(samples, kl)
        return float(samples + kl), forward_only + FWD_BWD_MULTIPLIER * forward_backward
