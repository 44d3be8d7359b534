"""Sorted partners of TRL's ``aot`` / ``aot_unpaired``: losses whose pairs are matched by rank
over the whole global batch, written so each pair's loss can be computed where the pair is.

TRL 1.16 (``DPOTrainer._compute_loss``) sorts over the batch it is given:

- ``aot`` (Melnyk et al. 2024, AOT paired): x = π_c − π_r (policy), y = ref_c − ref_r, both
  sorted; loss_k = ℓ(β(x_(k) − y_(k))).
- ``aot_unpaired``: c = π_c − ref_c and r = π_r − ref_r sorted separately; loss_k =
  ℓ(β(c_(k) − r_(k))).

with ℓ(z) = −(1 − ε)·log σ(z) − ε·log σ(−z), and the step's loss the mean over k.

The sort is over the **global** batch (every micro-batch of every data-parallel rank), so a run's
loss does not depend on how the batch is split. A pair's position k comes from a forward-only
pass of the policy over the global batch (the ranks are constants of the step: sorting is
piecewise linear, so its gradient only needs them). With k_i the rank of pair i's own value:

- ``aot``: Σ_k ℓ(β(x_(k) − y_(k))) = Σ_i ℓ(β(x_i − y_(k_i))): pair i's term reads its own live
  x_i and one constant, ``aot_offset_i`` = y_i − y_(k_i) (so x_i − y_(k_i) = h_i + offset_i).
- ``aot_unpaired``: the term at c_i's rank reads c_i live and R_i = r_(rank of c_i) as a constant;
  the rejected value r_i meets C_i = c_(rank of r_i) in another pair's term, so pair i also adds
  ℓ(β(C_i − r_i)) − [the same, detached]: zero in value, exactly that term's gradient for r_i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SortPartners:
    """What each pair of a batch is matched with by rank (constants, [B] each).

    Attributes:
        aot_offset: y_i − y_(k_i), k_i the rank of x_i = π_c,i − π_r,i, y = ref_c − ref_r.
        unpaired_rejected: R_i = the rejected log-ratio at the rank of c_i among the chosen ones.
        unpaired_chosen: C_i = the chosen log-ratio at the rank of r_i among the rejected ones.
    """

    aot_offset: Tensor
    unpaired_rejected: Tensor
    unpaired_chosen: Tensor

    def rows(self, sl: slice) -> SortPartners:
        """The partners of pairs ``sl`` (a data-parallel rank's or a micro-batch's share)."""
        return SortPartners(
            self.aot_offset[sl], self.unpaired_rejected[sl], self.unpaired_chosen[sl]
        )


def _at_own_rank(keys: Tensor, values: Tensor) -> Tensor:
    """values sorted ascending, read at each key's rank among the keys (ties by position)."""
    order = torch.argsort(keys, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return torch.sort(values, stable=True).values[rank]


def sort_partners(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
) -> SortPartners:
    """The rank partners of every pair of a batch (the global batch, in training).

    Args:
        policy_chosen_logps, policy_rejected_logps: [B] policy log-probs (sums or per-token
            means, as the loss reads them); detached here.
        ref_chosen_logps, ref_rejected_logps: [B] reference log-probs, same units.
    """
    pc, pr = policy_chosen_logps.detach(), policy_rejected_logps.detach()
    rc, rr = ref_chosen_logps.detach().to(pc.dtype), ref_rejected_logps.detach().to(pc.dtype)
    x, y = pc - pr, rc - rr
    chosen, rejected = pc - rc, pr - rr
    return SortPartners(
        aot_offset=y - _at_own_rank(x, y),
        unpaired_rejected=_at_own_rank(chosen, rejected),
        unpaired_chosen=_at_own_rank(rejected, chosen),
    )
