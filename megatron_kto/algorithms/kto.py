"""KTOTrainer: `DPOTrainer.fit()` with KTO's reference pass (samples and KL rows)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from megatron_kto.algorithms.dpo import DPOTrainer
from megatron_kto.logging.throughput import FWD_BWD_MULTIPLIER, kto_pass_tokens
from megatron_kto.models.kto_model import REF_KL, REF_SAMPLES
from megatron_kto.models.schedule import Batch, to_device


class KTOTrainer(DPOTrainer):
    """Trains a `MegatronGPTKTOModel`; everything but the batch preparation is `DPOTrainer`'s."""

    def augment_dataloader(self, dataloader: Iterable[Batch]) -> Iterator[Batch]:
        """Attach reference log-probs to each global batch, split into sample and KL halves.

        Adds `ref_policy_log_probs_samples` [B] and `ref_policy_log_probs_kl` [B], computed in one
        forward-only pass of the reference over the 2B rows; only the former when the loss
        ignores z₀ (no KL rows).
        """
        for batch in dataloader:
            batch = to_device(batch, self.device)
            ref = self.model.get_ref_policy_logprobs(batch)
            rows = batch["samples"].shape[0]
            batch[REF_SAMPLES] = ref[:rows]
            if self.model.settings.uses_kl_rows:
                batch[REF_KL] = ref[rows : 2 * rows]
            yield batch

    def step_cost_tokens(self, batch: Batch) -> tuple[float, float]:
        """KTO step cost: reference fwd over samples+KL (1x each), policy fwd over KL (1x),
        policy fwd+bwd over samples (3x) — in real (unpadded) tokens; no KL term when the loss
        ignores z₀ (the KL rows are then neither built nor run)."""
        samples = int(batch["sample_lengths"].sum())
        kl = int(batch["kl_sample_lengths"].sum()) if self.model.settings.uses_kl_rows else 0
        forward_only, forward_backward = kto_pass_tokens(samples, kl)
        return float(samples + kl), forward_only + FWD_BWD_MULTIPLIER * forward_backward
