"""KTO loss math against numbers worked out by hand and against the paper formula."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_kto.losses import kl_reference_point, kto_loss, kto_total_loss, sft_nll

LN3 = math.log(3.0)  # σ(ln 3) = 1 / (1 + 1/3) = 3/4, so 1 − σ(ln 3) = 1/4.


def _hand_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """β = 0.5, z₀ = 1, four rows (D = desirable, U = undesirable), ref log-probs chosen freely.

    row 0  D  r = 1            β(r − z₀) = 0     → 1 − σ(0)      = 1/2
    row 1  U  r = 1            β(z₀ − r) = 0     → 1 − σ(0)      = 1/2
    row 2  D  r = 1 + 2 ln 3   β(r − z₀) = ln 3  → 1 − σ(ln 3)   = 1/4
    row 3  U  r = 1 − 2 ln 3   β(z₀ − r) = ln 3  → 1 − σ(ln 3)   = 1/4
    """
    ref = torch.tensor([-5.0, -10.0, -6.0, -7.0], dtype=torch.float64)
    r = torch.tensor([1.0, 1.0, 1.0 + 2 * LN3, 1.0 - 2 * LN3], dtype=torch.float64)
    desirable = torch.tensor([True, False, True, False])
    return ref + r, ref, desirable


def test_kto_hand_values_with_weights() -> None:
    """λ_D = 1, λ_U = 2 on the hand batch.

    losses  = [1·1/2, 2·1/2, 1·1/4, 2·1/4] = [0.5, 1.0, 0.25, 0.5]
    rewards = β·r = [0.5, 0.5, 0.5 + ln 3, 0.5 − ln 3]
    mean    = (0.5 + 1.0 + 0.25 + 0.5) / 4 = 2.25 / 4 = 0.5625
    """
    policy, ref, desirable = _hand_batch()
    out = kto_loss(
        policy, ref, desirable, kl=1.0, beta=0.5, desirable_weight=1.0, undesirable_weight=2.0
    )
    torch.testing.assert_close(out.losses, torch.tensor([0.5, 1.0, 0.25, 0.5], dtype=torch.float64))
    torch.testing.assert_close(
        out.rewards, torch.tensor([0.5, 0.5, 0.5 + LN3, 0.5 - LN3], dtype=torch.float64)
    )
    total = kto_total_loss(
        policy,
        ref,
        desirable,
        kl=torch.tensor(1.0),
        beta=0.5,
        desirable_weight=1.0,
        undesirable_weight=2.0,
    )
    assert total.loss.item() == pytest.approx(0.5625)


def test_apo_zero_unpaired_hand_values() -> None:
    """β = 0.5, z₀ = 5 must be ignored.

    row 0  D  r = 0        1 − σ(0)      = 1/2
    row 1  U  r = 0        σ(0)          = 1/2
    row 2  D  r = 2 ln 3   1 − σ(ln 3)   = 1/4
    row 3  U  r = 2 ln 3   σ(ln 3)       = 3/4
    """
    ref = torch.tensor([-3.0, -3.0, -4.0, -4.0])
    policy = ref + torch.tensor([0.0, 0.0, 2 * LN3, 2 * LN3])
    desirable = torch.tensor([True, False, True, False])
    out = kto_loss(policy, ref, desirable, kl=5.0, beta=0.5, loss_type="apo_zero_unpaired")
    torch.testing.assert_close(out.losses, torch.tensor([0.5, 0.5, 0.25, 0.75]))


def test_kl_reference_point_mean_and_clamp() -> None:
    """z₀ = max(0, sum / count): 6/4 = 1.5; −3/2 = −1.5 → 0; count 0 → 0 (not NaN)."""
    assert kl_reference_point(torch.tensor(6.0), torch.tensor(4)).item() == pytest.approx(1.5)
    assert kl_reference_point(-3.0, 2).item() == 0.0
    assert kl_reference_point(torch.tensor(5.0), torch.tensor(0.0)).item() == 0.0
    assert kl_reference_point(torch.tensor(0.0), 0).item() == 0.0


def test_kl_reference_point_is_detached() -> None:
    s = torch.tensor(3.0, requires_grad=True)
    z0 = kl_reference_point(s * 2, 3)
    assert not z0.requires_grad
    assert z0.item() == pytest.approx(2.0)
    assert z0.dim() == 0


def test_z0_clamping_changes_the_loss() -> None:
    """A negative mean KL is clamped: the loss with z₀ from a negative sum equals z₀ = 0.

    desirable r = 0, β = 1: 1 − σ(0 − 0) = 1/2 (it would be 1 − σ(2) ≈ 0.119 with z₀ = −2).
    """
    z0 = kl_reference_point(-4.0, 2)
    out = kto_loss(torch.tensor([-1.0]), torch.tensor([-1.0]), torch.tensor([True]), z0, beta=1.0)
    assert out.losses.item() == pytest.approx(0.5)


def test_gradient_flows_to_policy_only() -> None:
    """β = 0.5, λ_D = 1, λ_U = 2, mean over B = 4 (hand batch, z₀ = 1).

    d/dr of λ_D·σ(−β(r − z₀)) at β(r − z₀) = 0 is −λ_D·β·σ(0)(1 − σ(0)) = −0.5·0.25 = −0.125,
    d/dr of λ_U·σ(−β(z₀ − r)) at 0 is +λ_U·β·0.25 = +0.25; divided by B = 4: −0.03125, 0.0625.
    Rows 2 and 3 sit at σ = 3/4: −1·0.5·(3/16)/4 = −0.0234375 and +2·0.5·(3/16)/4 = 0.046875.
    The reference log-probs and z₀ get no gradient even if they require one.
    """
    policy, ref, desirable = _hand_batch()
    policy = policy.clone().requires_grad_(True)
    ref = ref.clone().requires_grad_(True)
    z0 = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    out = kto_total_loss(
        policy, ref, desirable, z0, beta=0.5, desirable_weight=1.0, undesirable_weight=2.0
    )
    out.loss.backward()
    expected = torch.tensor([-0.03125, 0.0625, -0.0234375, 0.046875], dtype=torch.float64)
    torch.testing.assert_close(policy.grad, expected)
    assert ref.grad is None
    assert z0.grad is None
    assert not out.rewards.requires_grad


@pytest.mark.parametrize("only_desirable", [True, False])
def test_one_class_batch_is_finite(only_desirable: bool) -> None:
    policy = torch.tensor([-3.0, -5.0, -2.0], requires_grad=True)
    ref = torch.tensor([-3.5, -4.0, -2.0])
    desirable = torch.full((3,), only_desirable)
    out = kto_total_loss(
        policy,
        ref,
        desirable,
        kl_reference_point(0.3, 3),
        beta=0.1,
        sft_loss_weight=1.0,
        num_tokens=torch.tensor([3, 5, 2]),
    )
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert torch.isfinite(policy.grad).all()


def test_sft_nll_hand_values() -> None:
    """NLL per token: −(−6)/3 = 2 (desirable); undesirable → 0; zero tokens → 0, not NaN."""
    logps = torch.tensor([-6.0, -9.0, 0.0])
    nll = sft_nll(logps, torch.tensor([3, 3, 0]), torch.tensor([True, False, True]))
    torch.testing.assert_close(nll, torch.tensor([2.0, 0.0, 0.0]))


def test_total_loss_with_sft_term() -> None:
    """β = 1, z₀ = 0, both rows r = 0 → KTO losses [1/2, 1/2].

    SFT: row 0 desirable, logp −6 over 3 tokens → 2; row 1 undesirable → 0.
    weight 0.5: per-example [0.5 + 0.5·2, 0.5] = [1.5, 0.5]; mean = 1.0.
    d loss / d policy_0 = (−1·0.25 + 0.5·(−1/3)) / 2 = (−0.25 − 1/6) / 2 = −5/24.
    """
    policy = torch.tensor([-6.0, -9.0], requires_grad=True)
    ref = torch.tensor([-6.0, -9.0])
    out = kto_total_loss(
        policy,
        ref,
        torch.tensor([True, False]),
        0.0,
        beta=1.0,
        sft_loss_weight=0.5,
        num_tokens=torch.tensor([3, 4]),
    )
    torch.testing.assert_close(out.per_example, torch.tensor([1.5, 0.5]))
    torch.testing.assert_close(out.sft_terms, torch.tensor([2.0, 0.0]))
    assert out.loss.item() == pytest.approx(1.0)
    out.loss.backward()
    assert policy.grad[0].item() == pytest.approx(-5.0 / 24.0)


def test_normalizer_replaces_batch_size() -> None:
    """Per-example [1/2, 1/2] (r = z₀ = 0); Σ = 1; normalizer 8 → 1/8."""
    x = torch.tensor([-1.0, -2.0])
    out = kto_total_loss(x, x, torch.tensor([True, False]), 0.0, beta=1.0, normalizer=8)
    assert out.loss.item() == pytest.approx(0.125)


def test_errors_are_explicit() -> None:
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="loss_type"):
        kto_loss(x, x, x.bool(), 0.0, beta=0.1, loss_type="sigmoid")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ref_logps"):
        kto_loss(x, torch.zeros(2), x.bool(), 0.0, beta=0.1)
    with pytest.raises(ValueError, match="1-D"):
        kto_loss(torch.zeros(3, 1), x, x.bool(), 0.0, beta=0.1)
    with pytest.raises(ValueError, match="num_tokens"):
        kto_total_loss(x, x, x.bool(), 0.0, beta=0.1, sft_loss_weight=1.0)
    with pytest.raises(ValueError, match="beta"):
        kto_loss(x, x, x.bool(), 0.0, beta=0.0)


def test_low_precision_inputs_are_upcast() -> None:
    x = torch.tensor([-1.0, -2.0], dtype=torch.bfloat16)
    out = kto_loss(x, x, torch.tensor([True, False]), 0.0, beta=0.1)
    assert out.losses.dtype == torch.float32


def _paper_kto(policy, ref, desirable, policy_kl, ref_kl, beta, lam_d, lam_u, loss_type):
    """Eq. 7 of the KTO paper / eq. 7 of APO, written with math.exp on Python floats."""

    def sigma(x: float) -> float:
        return 1.0 / (1.0 + math.exp(-x))

    z0 = max(0.0, sum(p - q for p, q in zip(policy_kl, ref_kl)) / len(policy_kl))
    losses = []
    for p, q, d in zip(policy, ref, desirable):
        r = p - q
        if loss_type == "kto":
            losses.append(
                lam_d * (1 - sigma(beta * (r - z0))) if d else lam_u * (1 - sigma(beta * (z0 - r)))
            )
        else:
            losses.append(lam_d * (1 - sigma(beta * r)) if d else lam_u * sigma(beta * r))
    return losses, z0


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_paper_formula_on_random_inputs(loss_type: str, seed: int) -> None:
    """Independent of TRL: the Python-float transcription of the paper's formula."""
    g = torch.Generator().manual_seed(seed)
    b = 9
    policy = -20 * torch.rand(b, generator=g, dtype=torch.float64)
    ref = -20 * torch.rand(b, generator=g, dtype=torch.float64)
    policy_kl = -20 * torch.rand(b, generator=g, dtype=torch.float64)
    ref_kl = policy_kl - 3 * torch.randn(b, generator=g, dtype=torch.float64)
    desirable = torch.rand(b, generator=g) > 0.4
    beta, lam_d, lam_u = 0.3, 1.0, 1.33

    expected, z0_expected = _paper_kto(
        policy.tolist(),
        ref.tolist(),
        desirable.tolist(),
        policy_kl.tolist(),
        ref_kl.tolist(),
        beta,
        lam_d,
        lam_u,
        loss_type,
    )
    z0 = kl_reference_point((policy_kl - ref_kl).sum(), b)
    assert z0.item() == pytest.approx(z0_expected, abs=1e-12)
    out = kto_total_loss(policy, ref, desirable, z0, beta, lam_d, lam_u, loss_type)
    torch.testing.assert_close(out.kto_losses, torch.tensor(expected, dtype=torch.float64))
    assert out.loss.item() == pytest.approx(sum(expected) / b, abs=1e-12)


def test_length_normalised_rewards_hand_values() -> None:
    """preference_average_log_probs: r = (policy − ref) / tokens.

    β = 1, z₀ = 0. Row 0 (D): policy −4, ref −6, 2 tokens → r = 2/2 = 1 (summed: 2).
    Row 1 (U): policy −9, ref −6, 3 tokens → r = −3/3 = −1 (summed: −3).
    Losses: D 1 − σ(1) = σ(−1); U 1 − σ(0 − (−1)) = σ(−1). Rewards β·r = [1, −1].
    d loss / d policy_0 = −σ(1)σ(−1) · (1/2) / 2 rows.
    """
    policy = torch.tensor([-4.0, -9.0], requires_grad=True)
    out = kto_total_loss(
        policy,
        torch.tensor([-6.0, -6.0]),
        torch.tensor([True, False]),
        0.0,
        beta=1.0,
        num_tokens=torch.tensor([2, 3]),
        average_log_probs=True,
    )
    s = 1.0 / (1.0 + math.e)  # σ(−1)
    torch.testing.assert_close(out.rewards, torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(out.kto_losses, torch.tensor([s, s]))
    out.loss.backward()
    assert policy.grad[0].item() == pytest.approx(-(1 - s) * s * 0.5 / 2, rel=1e-6)
    with pytest.raises(ValueError, match="num_tokens"):
        kto_total_loss(
            policy, policy, torch.tensor([True, False]), 0.0, 1.0, average_log_probs=True
        )


def test_preference_weight_and_summed_sft_hand_values() -> None:
    """preference_loss_weight 0.5, sft_loss_weight 2, sft_average_log_probs False.

    β = 1, z₀ = 0, r = 0 for both rows → KTO losses [1/2, 1/2], weighted [1/4, 1/4].
    Summed SFT NLL: row 0 (D) −(−6) = 6 (not 6/3 = 2); row 1 (U) 0.
    per-example [1/4 + 2·6, 1/4] = [12.25, 0.25]; mean 6.25.
    """
    logps = torch.tensor([-6.0, -9.0])
    out = kto_total_loss(
        logps,
        logps,
        torch.tensor([True, False]),
        0.0,
        beta=1.0,
        sft_loss_weight=2.0,
        num_tokens=torch.tensor([3, 4]),
        sft_average_log_probs=False,
        preference_loss_weight=0.5,
    )
    torch.testing.assert_close(out.sft_terms, torch.tensor([6.0, 0.0]))
    torch.testing.assert_close(out.per_example, torch.tensor([12.25, 0.25]))
    assert out.loss.item() == pytest.approx(6.25)
    torch.testing.assert_close(out.kto_losses, torch.tensor([0.5, 0.5]))  # unweighted part


def test_sft_nll_summed() -> None:
    """average=False: −(−6) = 6 for the desirable row, whatever its length."""
    nll = sft_nll(torch.tensor([-6.0, -9.0]), torch.tensor([3, 3]), torch.tensor([True, False]),
                  average=False)  # fmt: skip
    torch.testing.assert_close(nll, torch.tensor([6.0, 0.0]))
