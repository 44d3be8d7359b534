"""KTOTrainer: `DPOTrainer.fit()` with KTO's reference pass (samples and KL rows)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from megatron_kto.algorithms.dpo import DPOTrainer
from megatron_kto.logging.throughput import FWD_BWD_MULTIPLIER, kto_pass_tokens
from megatron_kto.models.kto_model import REF_KL, REF_SAMPLES
from megatron_kto.models.schedule import Batch


class KTOTrainer(DPOTrainer):
    """Trains a `MegatronGPTKTOModel`; everything but the batch preparation is `DPOTrainer`'s."""

    #: The sample rows (the KL rows pair other examples' completions).
    example_blocks = 1

    def augment_dataloader(self, dataloader: Iterable[Batch]) -> Iterator[Batch]:
        """Attach reference log-probs to each global batch, split into sample and KL halves.

        Moves each batch to the device and adds `ref_policy_log_probs_samples` [B] and
        `ref_policy_log_probs_kl` [B], computed in one forward-only pass of the reference over
        the 2B rows (only the former when the loss ignores z₀: no KL rows are built then). The
        loop is `DPOTrainer`'s; the split is `attach_reference`.
        """
        return super().augment_dataloader(dataloader)

    def attach_reference(self, batch: Batch, ref: torch.Tensor) -> None:
        """Store the reference log-probs of the sample rows, then of the KL rows (if any)."""
        rows = batch["samples"].shape[0]
        batch[REF_SAMPLES] = ref[:rows]
        if self.model.settings.uses_kl_rows:
            batch[REF_KL] = ref[rows : 2 * rows]

    def reference_logps(self, batch: Batch) -> torch.Tensor:
        """The reference log-probs of the sample rows, then of the KL rows (if any)."""
        if self.model.settings.uses_kl_rows:
            return torch.cat([batch[REF_SAMPLES], batch[REF_KL]])
        return batch[REF_SAMPLES]

    def step_cost(self, batch: Batch) -> tuple[float, float]:
        """KTO step cost: reference fwd over samples+KL (1x each), policy fwd over KL (1x),
        policy fwd+bwd over samples (3x) — of the real (unpadded) rows; no KL term when the loss
        ignores z₀ (the KL rows are then neither built nor run)."""
        rows = [batch["sample_lengths"]]
        if self.model.settings.uses_kl_rows:
            rows.append(batch["kl_sample_lengths"])
        flops = [self.model_flops.rows(r) if self.model_flops else 0.0 for r in rows] + [0.0]
        forward_only, forward_backward = kto_pass_tokens(flops[0], flops[1])
        tokens = sum(float(r.sum()) for r in rows)
        return tokens, forward_only + FWD_BWD_MULTIPLIER * forward_backward
