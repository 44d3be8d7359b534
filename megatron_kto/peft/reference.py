"""`reference_policy=adapters_off`: under LoRA the reference is the policy chunks themselves,
computing with the starting adapter instead of the trained one.

No reference weights are held beside the policy's: the base weights are frozen, so the policy
chunks with every adapter disabled *are* the base model, and with the frozen copy of an imported
starting adapter (`model.peft.reference=start`, see `wiring.freeze_starting_adapter_copy`) they are the
starting policy. Either way the reference runs through the same packed, chunked forward as the
policy.
"""

from __future__ import annotations

import torch

from megatron_kto.models.reference import ForwardFn
from megatron_kto.peft.wiring import reference_adapters


class AdaptersOffReference:
    """The policy chunks with their adapters off, or switched to the frozen starting adapter
    (a `models.reference.ReferencePolicy`)."""

    def __init__(self, policy_chunks: list[torch.nn.Module]):
        self._policy = policy_chunks

    def log_probs(self, batch: dict[str, torch.Tensor], forward: ForwardFn) -> torch.Tensor:
        """Run `forward` on the policy chunks as the reference policy."""
        with reference_adapters(self._policy) as chunks:
            return forward(chunks)
