"""The DPO loss catalogue (TRL 1.16's per-pair loss types) against values worked out by hand.

Throughout β = 0.5 and L3 = ln 3, so σ(L3) = 3/4, σ(−L3) = 1/4, σ(0) = 1/2. A pair is given by
its log-ratios c = π_c − ref_c and r = π_r − ref_r (h = c − r) on top of arbitrary references.
Parity with TRL's own code on random inputs is in tests/test_losses_trl_parity.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_kto.losses import DPO_LOSS_TYPES, dpo_loss, dpo_total_loss

L3 = math.log(3.0)
BETA = 0.5


def _pairs(c: list[float], r: list[float]) -> tuple[torch.Tensor, ...]:
    ref_c = torch.linspace(-8.0, -3.0, len(c), dtype=torch.float64)
    ref_r = torch.linspace(-9.0, -5.0, len(r), dtype=torch.float64)
    c_t, r_t = torch.tensor(c, dtype=torch.float64), torch.tensor(r, dtype=torch.float64)
    return ref_c + c_t, ref_r + r_t, ref_c, ref_r


def _f64(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _losses(c, r, loss_type, **kw) -> torch.Tensor:
    return dpo_loss(*_pairs(c, r), beta=BETA, loss_type=loss_type, **kw).losses


def test_exo_pair_hand_values() -> None:
    """ε = 1/4: σ(x)(log σ(x) − log ¾) + σ(−x)(log σ(−x) − log ¼), x = βh.

    h = 2 L3 → x = L3: ¾(log ¾ − log ¾) + ¼(log ¼ − log ¼) = 0 (the model's pair distribution
    equals the target [1 − ε, ε]).
    h = 0 → x = 0: ½(log ½ − log ¾) + ½(log ½ − log ¼) = ½ log(2/3) + ½ log 2 = ½ log(4/3).
    """
    out = _losses([L3, 0.0], [-L3, 0.0], "exo_pair", label_smoothing=0.25)
    torch.testing.assert_close(out, _f64([0.0, 0.5 * math.log(4 / 3)]))


def test_nca_pair_hand_values() -> None:
    """−log σ(βc) − ½ log σ(−βc) − ½ log σ(−βr).

    c = 2 L3, r = −2 L3 → βc = L3, βr = −L3: −log ¾ − ½ log ¼ − ½ log ¾ = 1.5 log(4/3) + log 2.
    c = r = 0: log 2 + ½ log 2 + ½ log 2 = 2 log 2.
    """
    out = _losses([2 * L3, 0.0], [-2 * L3, 0.0], "nca_pair")
    torch.testing.assert_close(out, _f64([1.5 * math.log(4 / 3) + math.log(2), 2 * math.log(2)]))


def test_robust_hand_values() -> None:
    """ε = 1/4: (−(1 − ε) log σ(x) + ε log σ(−x)) / (1 − 2ε), x = βh.

    h = 2 L3 → x = L3: (−¾ log ¾ + ¼ log ¼) / ½ = 1.5 log(4/3) − ½ log 4 = 1.5 log(4/3) − log 2.
    h = 0: (¾ log 2 − ¼ log 2) / ½ = log 2.  At ε = 0 it is sigmoid: h = 2 L3 → log(4/3).
    """
    out = _losses([L3, 0.0], [-L3, 0.0], "robust", label_smoothing=0.25)
    torch.testing.assert_close(out, _f64([1.5 * math.log(4 / 3) - math.log(2), math.log(2)]))
    plain = _losses([L3], [-L3], "robust")
    torch.testing.assert_close(plain, _f64([math.log(4 / 3)]))


def test_sppo_hard_hand_values() -> None:
    """(c − 1/(2β))² + (r + 1/(2β))² with 1/(2β) = 1: (1, −1) → 0; (3, 1) → 4 + 4 = 8;
    (0, 0) → 1 + 1 = 2."""
    out = _losses([1.0, 3.0, 0.0], [-1.0, 1.0, 0.0], "sppo_hard")
    torch.testing.assert_close(out, _f64([0.0, 8.0, 2.0]))


def test_apo_zero_hand_values() -> None:
    """1 − σ(βc) + σ(βr): (2 L3, 2 L3) → 1 − ¾ + ¾ = 1; (2 L3, −2 L3) → 1 − ¾ + ¼ = ½;
    (0, 0) → 1 − ½ + ½ = 1."""
    out = _losses([2 * L3, 2 * L3, 0.0], [2 * L3, -2 * L3, 0.0], "apo_zero")
    torch.testing.assert_close(out, _f64([1.0, 0.5, 1.0]))


def test_apo_down_hand_values() -> None:
    """σ(βc) + 1 − σ(β(c − r)): (2 L3, 0) → ¾ + 1 − ¾ = 1; (0, −2 L3) → ½ + 1 − ¾ = ¾;
    (−2 L3, −2 L3) → ¼ + 1 − ½ = ¾."""
    out = _losses([2 * L3, 0.0, -2 * L3], [0.0, -2 * L3, -2 * L3], "apo_down")
    torch.testing.assert_close(out, _f64([1.0, 0.75, 0.75]))


def test_discopop_hand_values() -> None:
    """(1 − m)(−log σ(x)) + m·exp(−x), m = σ(x/τ), x = βh, τ = 1.

    h = 2 L3 → x = L3, m = ¾: ¼ log(4/3) + ¾ · ⅓ = ¼ log(4/3) + ¼.
    h = 0 → m = ½: ½ log 2 + ½ (for any τ).
    h = −2 L3 → x = −L3, m = ¼: ¾ log 4 + ¼ · 3 = 1.5 log 2 + ¾.
    """
    out = _losses([L3, 0.0, -L3], [-L3, 0.0, L3], "discopop", discopop_tau=1.0)
    expected = [0.25 * math.log(4 / 3) + 0.25, 0.5 * math.log(2) + 0.5, 1.5 * math.log(2) + 0.75]
    torch.testing.assert_close(out, _f64(expected))
    default_tau = _losses([0.0], [0.0], "discopop")
    torch.testing.assert_close(default_tau, _f64([0.5 * math.log(2) + 0.5]))


def test_sigmoid_norm_hand_values() -> None:
    """−log σ(β(c/n_c − r/n_r)) with the log-ratio sums and the token counts.

    c = 4 L3 over 2 tokens, r = 0 over 3 → h = 2 L3, x = L3 → log(4/3) (sigmoid on the sums would
    give x = 2 L3 → log(10/9)); c = 0 over 1, r = 6 L3 over 3 → h = −2 L3 → log 4.
    Passing per-token means with average_log_probs gives the same numbers.
    """
    pc, pr, rc, rr = _pairs([4 * L3, 0.0], [0.0, 6 * L3])
    n_c, n_r = torch.tensor([2, 1]), torch.tensor([3, 3])
    kw = dict(beta=BETA, loss_type="sigmoid_norm", chosen_num_tokens=n_c, rejected_num_tokens=n_r)
    expected = _f64([math.log(4 / 3), math.log(4)])
    torch.testing.assert_close(dpo_loss(pc, pr, rc, rr, **kw).losses, expected)
    means = (pc / n_c, pr / n_r, rc / n_c, rr / n_r)
    torch.testing.assert_close(dpo_loss(*means, average_log_probs=True, **kw).losses, expected)


def test_sft_and_weighted_mixture_hand_values() -> None:
    """loss_type [sigmoid, sft] with weights [1, ½]; chosen log-probs −6 over 3 tokens and −9
    over 3 → NLL per token 2 and 3; h = 0 → sigmoid log 2.
    Per pair: log 2 + ½·2 = log 2 + 1 and log 2 + ½·3 = log 2 + 1.5."""
    pc, pr = _f64([-6.0, -9.0]), _f64([-7.0, -5.0])
    n = torch.tensor([3, 3])
    kw = dict(beta=BETA, chosen_num_tokens=n, rejected_num_tokens=torch.tensor([2, 4]))
    sft = dpo_loss(pc, pr, pc.clone(), pr.clone(), loss_type="sft", **kw).losses
    torch.testing.assert_close(sft, _f64([2.0, 3.0]))
    mixed = dpo_total_loss(
        pc, pr, pc.clone(), pr.clone(), loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5], **kw
    )
    torch.testing.assert_close(mixed.dpo_losses, _f64([math.log(2) + 1.0, math.log(2) + 1.5]))
    assert mixed.loss.item() == pytest.approx(math.log(2) + 1.25)


def test_single_type_equals_unmixed_and_weights_scale() -> None:
    """A one-entry list is the plain loss; weights [2] double it; [a, b] add up."""
    g = torch.Generator().manual_seed(3)
    args = tuple(-20 * torch.rand(6, generator=g, dtype=torch.float64) for _ in range(4))
    plain = dpo_loss(*args, beta=0.1, loss_type="hinge").losses
    torch.testing.assert_close(dpo_loss(*args, beta=0.1, loss_type=["hinge"]).losses, plain)
    doubled = dpo_loss(*args, beta=0.1, loss_type=["hinge"], loss_weights=[2.0]).losses
    torch.testing.assert_close(doubled, 2 * plain)
    nca = dpo_loss(*args, beta=0.1, loss_type="nca_pair").losses
    both = dpo_loss(*args, beta=0.1, loss_type=["hinge", "nca_pair"], loss_weights=[0.3, 0.7])
    torch.testing.assert_close(both.losses, 0.3 * plain + 0.7 * nca)


def test_catalogue_errors_are_one_line_and_explicit() -> None:
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="unknown DPO loss_type 'bco'; supported: ") as e:
        dpo_loss(x, x, x, x, beta=0.1, loss_type=["sigmoid", "bco"])
    assert "\n" not in str(e.value) and all(name in str(e.value) for name in DPO_LOSS_TYPES)
    with pytest.raises(ValueError, match="exo_pair"):
        dpo_loss(x, x, x, x, beta=0.1, loss_type="exo_pair")
    with pytest.raises(ValueError, match="label_smoothing=0.1 is not read"):
        dpo_loss(x, x, x, x, beta=0.1, loss_type=["apo_zero", "sft"], label_smoothing=0.1)
    with pytest.raises(ValueError, match="loss_weights has 1 entries"):
        dpo_loss(x, x, x, x, beta=0.1, loss_type=["sigmoid", "ipo"], loss_weights=[1.0])
    with pytest.raises(ValueError, match="needs chosen_num_tokens"):
        dpo_loss(x, x, x, x, beta=0.1, loss_type="sigmoid_norm")
    with pytest.raises(ValueError, match="discopop_tau"):
        dpo_loss(x, x, x, x, beta=0.1, loss_type="discopop", discopop_tau=0.0)
    # ε is read by one entry of the list: accepted.
    dpo_loss(x, x, x, x, beta=0.1, loss_type=["robust", "hinge"], label_smoothing=0.1)
