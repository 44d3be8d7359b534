"""DPO / IPO / hinge loss math against numbers worked out by hand and the paper formulas."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_kto.losses import dpo_loss, dpo_total_loss

LN3 = math.log(3.0)  # σ(ln 3) = 3/4, σ(−ln 3) = 1/4


def _pairs(h: list[float]) -> tuple[torch.Tensor, ...]:
    """Pairs whose logits h = (π_c − ref_c) − (π_r − ref_r) are the given values.

    π_c − ref_c = h/2 and π_r − ref_r = −h/2 on top of arbitrary reference log-probs.
    """
    h_t = torch.tensor(h, dtype=torch.float64)
    ref_c = torch.linspace(-8.0, -3.0, len(h), dtype=torch.float64)
    ref_r = torch.linspace(-9.0, -5.0, len(h), dtype=torch.float64)
    return ref_c + h_t / 2, ref_r - h_t / 2, ref_c, ref_r


def test_sigmoid_hand_values() -> None:
    """β = 0.5; h = 0 → −log σ(0) = log 2; h = 2 ln 3 → βh = ln 3 → −log(3/4) = log(4/3);
    h = −2 ln 3 → −log(1/4) = log 4. Rewards: β·(±h/2) = ±h/4."""
    pc, pr, rc, rr = _pairs([0.0, 2 * LN3, -2 * LN3])
    out = dpo_loss(pc, pr, rc, rr, beta=0.5)
    expected = torch.tensor([math.log(2), math.log(4 / 3), math.log(4)], dtype=torch.float64)
    torch.testing.assert_close(out.losses, expected)
    torch.testing.assert_close(
        out.chosen_rewards, torch.tensor([0.0, LN3 / 2, -LN3 / 2], dtype=torch.float64)
    )
    torch.testing.assert_close(out.rejected_rewards, -out.chosen_rewards)


def test_sigmoid_label_smoothing_hand_values() -> None:
    """Conservative DPO, β = 0.5, ε = 0.1: L = −0.9·log σ(βh) − 0.1·log σ(−βh).

    h = 0:        0.9·log 2 + 0.1·log 2 = log 2
    h = 2 ln 3:   −0.9·log(3/4) − 0.1·log(1/4) = 0.9·log(4/3) + 0.1·log 4
    """
    pc, pr, rc, rr = _pairs([0.0, 2 * LN3])
    out = dpo_loss(pc, pr, rc, rr, beta=0.5, label_smoothing=0.1)
    expected = torch.tensor(
        [math.log(2), 0.9 * math.log(4 / 3) + 0.1 * math.log(4)], dtype=torch.float64
    )
    torch.testing.assert_close(out.losses, expected)


def test_ipo_hand_values() -> None:
    """β = 0.5 → 1/(2β) = 1; (h − 1)²: h = 1 → 0, h = 3 → 4, h = 0 → 1, h = −1 → 4."""
    pc, pr, rc, rr = _pairs([1.0, 3.0, 0.0, -1.0])
    out = dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="ipo")
    torch.testing.assert_close(out.losses, torch.tensor([0.0, 4.0, 1.0, 4.0], dtype=torch.float64))


def test_hinge_hand_values() -> None:
    """β = 0.5; max(0, 1 − βh): h = 0 → 1, h = 2 → 0, h = 4 → 0, h = −2 → 2, h = 1 → 0.5."""
    pc, pr, rc, rr = _pairs([0.0, 2.0, 4.0, -2.0, 1.0])
    out = dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="hinge")
    torch.testing.assert_close(
        out.losses, torch.tensor([1.0, 0.0, 0.0, 2.0, 0.5], dtype=torch.float64)
    )


def test_gradient_flows_to_policy_only() -> None:
    """sigmoid, β = 0.5, h = 0, B = 2: dL/dπ_c = −β·σ(−βh) = −0.25, dL/dπ_r = +0.25,
    then the mean over B = 2 halves them: ∓0.125. The reference gets no gradient."""
    pc, pr, rc, rr = (t.clone().requires_grad_(True) for t in _pairs([0.0, 0.0]))
    out = dpo_total_loss(pc, pr, rc, rr, beta=0.5)
    out.loss.backward()
    torch.testing.assert_close(pc.grad, torch.full((2,), -0.125, dtype=torch.float64))
    torch.testing.assert_close(pr.grad, torch.full((2,), 0.125, dtype=torch.float64))
    assert rc.grad is None and rr.grad is None
    assert not out.chosen_rewards.requires_grad


def test_sft_term_on_chosen() -> None:
    """β = 1, h = 0 → DPO loss log 2 per pair. Chosen logps −6 and −4 over 3 and 2 tokens
    → NLL per token 2 and 2; weight 0.5 → per-example log 2 + 1; mean = log 2 + 1."""
    pc = torch.tensor([-6.0, -4.0])
    pr = torch.tensor([-7.0, -5.0])
    out = dpo_total_loss(
        pc,
        pr,
        pc.clone(),
        pr.clone(),
        beta=1.0,
        sft_loss_weight=0.5,
        chosen_num_tokens=torch.tensor([3, 2]),
    )
    torch.testing.assert_close(out.sft_terms, torch.tensor([2.0, 2.0]))
    assert out.loss.item() == pytest.approx(math.log(2) + 1.0)


def test_errors_are_explicit() -> None:
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(x, x, x, x, beta=0.1, loss_type="kto")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(x, x, x, x, beta=0.1, loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(x, x, x, x, beta=0.1, label_smoothing=0.5)
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(x, x, x, x, beta=0.0, loss_type="ipo")
    with pytest.raises(ValueError, match="ref_rejected_logps"):
        dpo_loss(x, x, x, torch.zeros(3), beta=0.1)
    with pytest.raises(ValueError, match="chosen_num_tokens"):
        dpo_total_loss(x, x, x, x, beta=0.1, sft_loss_weight=1.0)


def _paper_dpo(pc, pr, rc, rr, beta, loss_type, eps):
    """The loss formulas of the DPO / cDPO / IPO / SLiC papers on Python floats."""

    def log_sigma(x: float) -> float:
        return -math.log1p(math.exp(-x))

    out = []
    for a, b, c, d in zip(pc, pr, rc, rr):
        h = (a - c) - (b - d)
        if loss_type == "sigmoid":
            out.append(-(1 - eps) * log_sigma(beta * h) - eps * log_sigma(-beta * h))
        elif loss_type == "ipo":
            out.append((h - 1 / (2 * beta)) ** 2)
        else:
            out.append(max(0.0, 1 - beta * h))
    return out


@pytest.mark.parametrize(
    "loss_type,eps", [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0), ("hinge", 0.0)]
)
def test_matches_paper_formula_on_random_inputs(loss_type: str, eps: float) -> None:
    """Independent of TRL: a Python-float transcription of each paper's loss."""
    g = torch.Generator().manual_seed(7)
    pc, pr, rc, rr = (-30 * torch.rand(11, generator=g, dtype=torch.float64) for _ in range(4))
    beta = 0.2
    expected = _paper_dpo(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist(), beta, loss_type, eps)
    out = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type=loss_type, label_smoothing=eps)
    torch.testing.assert_close(out.losses, torch.tensor(expected, dtype=torch.float64))


def test_preference_weight_and_sft_averaging_hand_values() -> None:
    """preference_loss_weight 0.5; the SFT NLL summed, from length-normalised inputs.

    β = 1, chosen = rejected log-ratio → DPO loss log 2 per pair, weighted (log 2)/2.
    Inputs are per-token means (average_log_probs): chosen −2 over 3 tokens, −2 over 2 → sums
    −6 and −4, so the summed NLL (sft_average_log_probs False) is [6, 4]; weight 0.5 →
    per-example [(log 2)/2 + 3, (log 2)/2 + 2]; averaged per token instead it is [2, 2].
    """
    pc, pr = torch.tensor([-2.0, -2.0]), torch.tensor([-3.0, -1.0])
    kwargs = dict(beta=1.0, sft_loss_weight=0.5, chosen_num_tokens=torch.tensor([3, 2]),
                  average_log_probs=True, preference_loss_weight=0.5)  # fmt: skip
    summed = dpo_total_loss(pc, pr, pc.clone(), pr.clone(), sft_average_log_probs=False, **kwargs)
    torch.testing.assert_close(summed.sft_terms, torch.tensor([6.0, 4.0]))
    half_log2 = math.log(2) / 2
    torch.testing.assert_close(summed.per_example, torch.tensor([half_log2 + 3, half_log2 + 2]))
    averaged = dpo_total_loss(pc, pr, pc.clone(), pr.clone(), **kwargs)
    torch.testing.assert_close(averaged.sft_terms, torch.tensor([2.0, 2.0]))
