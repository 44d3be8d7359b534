"""`reference_policy=adapters_off`: under LoRA the reference is the policy with its adapters off.

No reference weights are held anywhere: the base weights are frozen, so the policy chunks with
every adapter disabled *are* the reference model, and they run through the same packed,
chunked forward as the policy.
"""

from __future__ import annotations

import torch

from megatron_kto.models.reference import ForwardFn
from megatron_kto.peft.wiring import adapters_disabled


class AdaptersOffReference:
    """The policy chunks with adapters disabled (a `models.reference.ReferencePolicy`)."""

    def __init__(self, policy_chunks: list[torch.nn.Module]):
        self._policy = policy_chunks

    def log_probs(self, batch: dict[str, torch.Tensor], forward: ForwardFn) -> torch.Tensor:
        """Run `forward` on the policy chunks with their adapters off."""
        with adapters_disabled(self._policy) as chunks:
            return forward(chunks)
