"""``bco_pair``, ``aot`` and ``aot_unpaired`` against values worked out by hand (float64), and the
sorting losses' global-batch partners: split into micro-batches, the loss and its gradient are
the whole batch's. TRL 1.16's own code on random inputs: tests/test_losses_trl_parity.py.

β = 0.5 and L3 = ln 3 throughout, so σ(L3) = 3/4, σ(0) = 1/2 and d/dz[−log σ(z)] = σ(z) − 1.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_kto.losses import dpo_loss, dpo_total_loss
from megatron_kto.losses.batch_sort import sort_partners

L3 = math.log(3.0)
BETA = 0.5


def _f64(values: list[float], grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=grad)


def test_bco_pair_hand_values() -> None:
    """TRL 1.16's bco_pair: −log σ(βc) − log σ(−βr) (no running mean).

    (c, r) = (2 L3, −2 L3): βc = L3, −βr = L3 → 2 log(4/3); (0, 0) → 2 log 2.
    """
    ref_c, ref_r = _f64([-5.0, -7.0]), _f64([-6.0, -4.0])
    out = dpo_loss(
        ref_c + _f64([2 * L3, 0.0]), ref_r + _f64([-2 * L3, 0.0]), ref_c, ref_r, BETA, "bco_pair"
    )
    torch.testing.assert_close(out.losses, _f64([2 * math.log(4 / 3), 2 * math.log(2)]))


def test_aot_pairs_sorted_policy_and_reference_margins() -> None:
    """x = π_c − π_r = (4 L3, 0), y = ref_c − ref_r = (0, 2 L3); sorted x = (0, 4 L3), sorted
    y = (0, 2 L3), so the deltas are (0, 2 L3) and β·delta = (0, L3): pair 2 (x = 0, rank 0) has
    −log ½ = log 2, pair 1 (rank 1) −log ¾ = log(4/3). Unsorted the pairs would read βh = (2 L3,
    −L3) instead. d loss_i/dπ_c,i = β(σ(β·delta) − 1): pair 1 −⅛, pair 2 −¼; π_r the negative.
    """
    ref_c, ref_r = _f64([-3.0, -5.0 + 2 * L3]), _f64([-3.0, -5.0])
    pc, pr = _f64([-2.0 + 4 * L3, -6.0], grad=True), _f64([-2.0, -6.0], grad=True)
    out = dpo_loss(pc, pr, ref_c, ref_r, BETA, "aot")
    torch.testing.assert_close(out.losses, _f64([math.log(4 / 3), math.log(2)]))
    out.losses.sum().backward()
    torch.testing.assert_close(pc.grad, _f64([-1 / 8, -1 / 4]))
    torch.testing.assert_close(pr.grad, _f64([1 / 8, 1 / 4]))


def test_aot_unpaired_sorts_chosen_and_rejected_separately() -> None:
    """c = (2 L3, 0), r = (0, −2 L3): sorted c = (0, 2 L3), sorted r = (−2 L3, 0); both deltas
    are 2 L3 (β·delta = L3): log(4/3) each. Every c_i gets β(¾ − 1) = −⅛, every r_i +⅛. With ε =
    ¼: −¾ log ¾ − ¼ log ¼ each."""
    ref_c, ref_r = _f64([-4.0, -6.0]), _f64([-5.0, -3.0])
    pc = (ref_c + _f64([2 * L3, 0.0])).requires_grad_(True)
    pr = (ref_r + _f64([0.0, -2 * L3])).requires_grad_(True)
    out = dpo_loss(pc, pr, ref_c, ref_r, BETA, "aot_unpaired")
    torch.testing.assert_close(out.losses, _f64([math.log(4 / 3)] * 2))
    out.losses.sum().backward()
    torch.testing.assert_close(pc.grad, _f64([-1 / 8, -1 / 8]))
    torch.testing.assert_close(pr.grad, _f64([1 / 8, 1 / 8]))
    smoothed = dpo_loss(pc, pr, ref_c, ref_r, BETA, "aot_unpaired", label_smoothing=0.25)
    value = -0.75 * math.log(0.75) - 0.25 * math.log(0.25)
    torch.testing.assert_close(smoothed.losses, _f64([value, value]))


@pytest.mark.parametrize(
    "loss_type", [["aot"], ["aot_unpaired"], ["aot", "aot_unpaired", "sigmoid"]]
)
def test_micro_batches_with_global_partners_equal_the_whole_batch(loss_type) -> None:
    """8 pairs in 4 micro-batches of 2, each given its share of the global batch's partners:
    the summed loss and the gradients are the whole batch's (sorting per micro-batch is not)."""
    g = torch.Generator().manual_seed(0)
    b, beta, eps = 8, 0.3, 0.1
    pc0, pr0 = (
        -10 * torch.rand(b, generator=g, dtype=torch.float64),
        -10 * torch.rand(b, generator=g, dtype=torch.float64),
    )
    rc, rr = (
        pc0 + torch.randn(b, generator=g, dtype=torch.float64),
        pr0 + torch.randn(b, generator=g, dtype=torch.float64),
    )

    def run(slices, partners):
        pc, pr = pc0.clone().requires_grad_(True), pr0.clone().requires_grad_(True)
        total = sum(
            dpo_total_loss(
                pc[sl],
                pr[sl],
                rc[sl],
                rr[sl],
                beta,
                loss_type=loss_type,
                label_smoothing=eps,
                normalizer=b,
                sort_partners=partners.rows(sl) if partners is not None else None,
            ).loss
            for sl in slices
        )
        total.backward()
        return total.detach(), pc.grad, pr.grad

    whole = run([slice(0, b)], None)
    micro = [slice(i, i + 2) for i in range(0, b, 2)]
    split = run(micro, sort_partners(pc0, pr0, rc, rr))
    for a, w in zip(split, whole, strict=True):
        torch.testing.assert_close(a, w, rtol=1e-12, atol=1e-14)
    local = run(micro, None)  # each micro-batch sorted on its own: a different objective
    assert not torch.allclose(local[1], whole[1])
