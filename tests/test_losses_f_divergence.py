"""f-DPO regularisers (`model.dpo.f_divergence_type`) against values worked out by hand, and the
refused combinations (as a pure check and through the config).

Scores s(u) of a log-ratio u (`losses.f_divergence`): forward_kl 1 − e^(−u); js_divergence
log 2 + log σ(u); alpha_divergence (e^((α−1)u) − 1)/(α − 1). L2 = ln 2, L3 = ln 3. Parity with
TRL 1.16's own code on random inputs is in tests/test_losses_trl_parity.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_kto.config.validate import ConfigError, validate
from megatron_kto.entry import compose_run_config
from megatron_kto.losses import dpo_loss
from megatron_kto.losses.dpo_types import DPOLossConfigError
from megatron_kto.losses.f_divergence import check_f_divergence, f_divergence_scores

L2, L3 = math.log(2.0), math.log(3.0)
U = torch.tensor([0.0, L2, -L2, L3], dtype=torch.float64)


def _f64(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _losses(c: list[float], r: list[float], beta: float, **kw) -> torch.Tensor:
    ref_c = torch.linspace(-8.0, -3.0, len(c), dtype=torch.float64)
    ref_r = torch.linspace(-9.0, -5.0, len(r), dtype=torch.float64)
    return dpo_loss(ref_c + _f64(c), ref_r + _f64(r), ref_c, ref_r, beta=beta, **kw).losses


def test_scores_hand_values() -> None:
    """u = 0, L2, −L2, L3:
    forward_kl 1 − 1/t: 0, ½, −1, ⅔;
    js_divergence log(2t/(t+1)): 0, log(4/3), log(2/3), log(3/2);
    alpha ½, 2(1 − t^(−½)): 0, 2 − √2, 2 − 2√2, 2 − 2/√3;  alpha 2, t − 1: 0, 1, −½, 2;
    alpha 1 is reverse_kl (u itself), alpha 0 is forward_kl."""
    cases = {
        ("forward_kl", 0.5): [0.0, 0.5, -1.0, 2 / 3],
        ("js_divergence", 0.5): [0.0, math.log(4 / 3), math.log(2 / 3), math.log(3 / 2)],
        ("alpha_divergence", 0.5): [0.0, 2 - math.sqrt(2), 2 - 2 * math.sqrt(2), 2 - 2 / 3**0.5],
        ("alpha_divergence", 2.0): [0.0, 1.0, -0.5, 2.0],
        ("alpha_divergence", 0.0): [0.0, 0.5, -1.0, 2 / 3],
    }
    for (kind, alpha), expected in cases.items():
        torch.testing.assert_close(f_divergence_scores(U, kind, alpha), _f64(expected))
    assert f_divergence_scores(U, "reverse_kl") is U
    assert f_divergence_scores(U, "alpha_divergence", 1.0 + 1e-7) is U


def test_alpha_exponent_is_clamped() -> None:
    """α = 3, u = 50: (α − 1)u = 100 is clamped to 80 → (e^80 − 1)/2, finite (fp16: 11)."""
    big = f_divergence_scores(_f64([50.0]), "alpha_divergence", 3.0)
    torch.testing.assert_close(big, _f64([(math.exp(80.0) - 1.0) / 2.0]))
    half = f_divergence_scores(torch.tensor([50.0], dtype=torch.float16), "alpha_divergence", 3.0)
    assert half.dtype == torch.float16 and torch.isfinite(half).all()


def test_losses_read_the_score_difference() -> None:
    """forward_kl, hinge, β = ½: c = L2, r = −L2 → s = ½, −1, Δ = 3/2 → 1 − ¾ = ¼; c = r = 0 → 1.
    js_divergence, sigmoid, β = 1: c = L3, r = −L3 → Δ = log(3/2) − log 2 + log 4 = L3 →
    −log σ(L3) = log(4/3).
    alpha ½, hinge, β = ¼: c = 2 L2, r = −2 L2 → s = 1, −2, Δ = 3 → ¼.
    The rewards stay β·u."""
    fwd = dpo_loss(
        *(_f64([-3.0 + L2, -2.0]), _f64([-5.0 - L2, -6.0]), _f64([-3.0, -2.0]), _f64([-5.0, -6.0])),
        beta=0.5,
        loss_type="hinge",
        f_divergence_type="forward_kl",
    )
    torch.testing.assert_close(fwd.losses, _f64([0.25, 1.0]))
    torch.testing.assert_close(fwd.chosen_rewards, _f64([0.5 * L2, 0.0]))
    torch.testing.assert_close(fwd.rejected_rewards, _f64([-0.5 * L2, 0.0]))
    js = _losses([L3], [-L3], 1.0, loss_type="sigmoid", f_divergence_type="js_divergence")
    torch.testing.assert_close(js, _f64([math.log(4 / 3)]))
    alpha = _losses(
        [2 * L2], [-2 * L2], 0.25, loss_type="hinge", f_divergence_type="alpha_divergence"
    )
    torch.testing.assert_close(alpha, _f64([0.25]))


def test_per_token_losses_divide_the_score_and_sft_ignores_it() -> None:
    """sigmoid_norm, forward_kl, β = 2 L3: c = L2 over 2 tokens → ½/2 = ¼; r = −L2 over 4 →
    −1/4; Δ = ½ → x = L3 → log(4/3) (TRL: s(u)/n). sft reads no log-ratio: unchanged."""
    pc, pr, rc, rr = _f64([-3.0 + L2]), _f64([-5.0 - L2]), _f64([-3.0]), _f64([-5.0])
    kw = dict(chosen_num_tokens=torch.tensor([2]), rejected_num_tokens=torch.tensor([4]))
    norm = dpo_loss(
        pc, pr, rc, rr, beta=2 * L3, loss_type="sigmoid_norm", f_divergence_type="forward_kl", **kw
    )
    torch.testing.assert_close(norm.losses, _f64([math.log(4 / 3)]))
    sft = dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type="sft", f_divergence_type="forward_kl", **kw)
    torch.testing.assert_close(sft.losses, -pc / 2)


@pytest.mark.parametrize(
    "loss_types,kind,alpha,field,text",
    [
        (("apo_zero",), "js_divergence", 0.5, "f_divergence_type", "not to apo_zero"),
        (("sigmoid", "nca_pair"), "forward_kl", 0.5, "f_divergence_type", "not to nca_pair"),
        (("sigmoid",), "kl", 0.5, "f_divergence_type", "unknown f_divergence_type 'kl'"),
        (("sigmoid",), "reverse_kl", 0.3, "f_alpha_divergence_coef", "read only with"),
        (("sigmoid",), "alpha_divergence", math.nan, "f_alpha_divergence_coef", "finite"),
    ],
)
def test_refusals_are_one_line_naming_the_key(loss_types, kind, alpha, field, text) -> None:
    with pytest.raises(DPOLossConfigError, match=text) as e:
        check_f_divergence(loss_types, kind, alpha)
    assert e.value.field == field and "\n" not in str(e.value)
    if text.startswith("not to"):
        assert "discopop, exo_pair, hinge, ipo, robust, sft, sigmoid, sigmoid_norm" in str(e.value)


def test_config_keys_are_checked_with_the_objective() -> None:
    with pytest.raises(ConfigError, match="^model.dpo.f_divergence_type: .*not to apo_zero"):
        compose_run_config(
            "gpt_dpo",
            ["model.dpo.loss_type=[sigmoid,apo_zero]", "model.dpo.f_divergence_type=forward_kl"],
            "dpo",
        )
    with pytest.raises(ConfigError, match="^model.dpo.f_alpha_divergence_coef: "):
        compose_run_config("gpt_dpo", ["model.dpo.f_alpha_divergence_coef=0.2"], "dpo")
    ok = compose_run_config(
        "gpt_dpo",
        [
            "model.dpo.loss_type=[robust,sft]",
            "model.dpo.f_divergence_type=alpha_divergence",
            "model.dpo.f_alpha_divergence_coef=0.3",
        ],
        "dpo",
    )
    validate(ok.cfg, 1, "dpo")
