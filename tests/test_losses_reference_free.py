"""The reference-free objectives (CPO, SimPO, ORPO) against hand-worked numbers and TRL 1.16.

Two pairs, float64, no reference (the log-ratios are the policy log-probs), β = 0.1, α = 1,
γ = 0.5, ε = 0:

    pair   π_c   n_c   π_r   n_r   ℓ_c = π_c/n_c   ℓ_r = π_r/n_r
    1      −3    2     −4    4     −1.5            −1
    2      −5    4     −4.5  3     −1.25           −1.5

NLL (TRL's token-weighted mean over the pairs) = (3 + 5) / (2 + 4) = 4/3, added to every pair.

- CPO, x = β(π_c − π_r): pair 1 x = 0.1, −log σ(0.1) = log(1 + e^−0.1) = 0.644397 → 1.977730;
  pair 2 x = −0.05, log(1 + e^0.05) = 0.718460 → 2.051793.
- SimPO, y = β(ℓ_c − ℓ_r) − γ: pair 1 y = −0.05 − 0.5 = −0.55, log(1 + e^0.55) = 1.005493
  → 2.338826.
- ORPO, log odds(ℓ) = ℓ − log(1 − e^ℓ): pair 1 −1.5 + 0.252468 = −1.247532 and −1 + 0.458675
  = −0.541325, o = −0.706207; β·log(1 + e^0.706207) = 0.1 × 1.107340 = 0.110734 → 1.444067.

TRL's own ``CPOTrainer.cpo_loss`` / ``ORPOTrainer.odds_ratio_loss`` run unmodified on a minimal
stand-in ``self``; their NLL is ``nn.CrossEntropyLoss`` (mean over the unmasked label tokens) on
the same logits, as their ``concatenated_forward`` computes it.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from megatron_kto.config.validate import ConfigError
from megatron_kto.entry import compose_run_config
from megatron_kto.losses.dpo import dpo_total_loss
from megatron_kto.losses.dpo_types import orpo_log_odds
from megatron_kto.losses.metrics import (
    CPO_METRICS,
    ORPO_METRICS,
    dpo_metric_sums,
    reference_free_metric_sums,
)

F64 = torch.float64
PC, PR = torch.tensor([-3.0, -5.0], dtype=F64), torch.tensor([-4.0, -4.5], dtype=F64)
NC, NR = torch.tensor([2.0, 4.0], dtype=F64), torch.tensor([4.0, 3.0], dtype=F64)


def _total(loss_type: str, **kw):
    return dpo_total_loss(
        PC, PR, None, None, 0.1, loss_type=loss_type, chosen_num_tokens=NC,
        rejected_num_tokens=NR, **kw,
    )  # fmt: skip


@pytest.mark.parametrize(
    "loss_type,expected",
    [
        ("cpo", [1.977730, 2.051793]),
        ("simpo", [2.338826, 2.291922]),
        ("orpo", [1.444067, 1.387290]),
    ],
)
def test_hand_values(loss_type, expected):
    out = _total(loss_type)
    torch.testing.assert_close(
        out.per_example, torch.tensor(expected, dtype=F64), atol=2e-6, rtol=0
    )
    torch.testing.assert_close(out.loss, out.per_example.mean())


def test_alpha_zero_simpo_is_the_paper_and_means_give_the_same_loss():
    nll = 4 / 3
    plain = _total("simpo", cpo_alpha=0.0).per_example
    torch.testing.assert_close(plain, _total("simpo").per_example - nll)
    means = dpo_total_loss(
        PC / NC, PR / NR, None, None, 0.1, loss_type="simpo", chosen_num_tokens=NC,
        rejected_num_tokens=NR, average_log_probs=True,
    )  # fmt: skip
    torch.testing.assert_close(means.per_example, _total("simpo").per_example)
    torch.testing.assert_close(means.chosen_rewards, 0.1 * PC / NC)  # TRL: β × mean log-prob


def test_orpo_nll_over_the_prompt_reads_its_own_sums():
    """TRL's ORPO NLL (``chosen_nll_logps``): the chosen rows' whole sums, prompt included —
    say −7 over 5 tokens and −9 over 6: NLL 16/11 replaces 4/3; the odds ratio is unchanged."""
    full = _total("orpo", chosen_nll_logps=torch.tensor([-7.0, -9.0], dtype=F64),
                  chosen_nll_num_tokens=torch.tensor([5.0, 6.0], dtype=F64))  # fmt: skip
    torch.testing.assert_close(full.per_example, _total("orpo").per_example - 4 / 3 + 16 / 11)


def test_reference_based_types_still_need_a_reference():
    with pytest.raises(ValueError, match="needs reference log-probs"):
        dpo_total_loss(PC, PR, None, None, 0.1, loss_type="sigmoid")


# ----------------------------------------------------------------------------- TRL parity

trl = pytest.importorskip("trl")
from trl.experimental.cpo import CPOTrainer  # noqa: E402
from trl.experimental.orpo import ORPOTrainer  # noqa: E402

B, T, V, PROMPT = 3, 7, 11, 2


def _batch(seed: int):
    """Random logits [2B, T, V] (chosen rows, then rejected) and labels with a 2-token prompt
    and completions of different lengths (−100 elsewhere)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2 * B, T, V, generator=g, dtype=F64)
    labels = torch.randint(0, V, (2 * B, T), generator=g)
    ends = torch.tensor([7, 5, 6, 4, 7, 3])
    pos = torch.arange(T).unsqueeze(0)
    labels[(pos < PROMPT) | (pos >= ends.unsqueeze(1))] = -100
    return logits.requires_grad_(), labels


def _trl_stub(loss_type: str, **attrs):
    return types.SimpleNamespace(
        alpha=0.0,
        beta=0.2,
        label_smoothing=attrs.pop("label_smoothing", 0.0),
        loss_type=loss_type,
        simpo_gamma=0.7,
        accelerator=types.SimpleNamespace(device=torch.device("cpu")),
        **attrs,
    )


def _trl_nll(logits, labels):
    # concatenated_forward's cross entropy: shift, mean over the unmasked tokens of the chosen rows
    return torch.nn.CrossEntropyLoss()(logits[:B, :-1].reshape(-1, V), labels[:B, 1:].reshape(-1))


def _ours(logits, labels, loss_type, average, **kw):
    shifted, target = logits[:, :-1], labels[:, 1:]
    mask = target != -100
    per_token = torch.gather(F.log_softmax(shifted, -1), 2, target.clamp(min=0).unsqueeze(2))
    sums = (per_token.squeeze(2) * mask).sum(1)
    counts = mask.sum(1).to(F64)
    logps = sums / counts if average else sums
    return dpo_total_loss(
        logps[:B], logps[B:], None, None, 0.2, loss_type=loss_type, chosen_num_tokens=counts[:B],
        rejected_num_tokens=counts[B:], average_log_probs=average, simpo_gamma=0.7, **kw,
    ), logps, counts  # fmt: skip


@pytest.mark.parametrize(
    "ours_type,trl_type,eps,alpha",
    [("cpo", "sigmoid", 0.0, 1.0), ("cpo", "sigmoid", 0.1, 0.5), ("simpo", "simpo", 0.0, 1.0),
     ("simpo", "simpo", 0.1, 0.0)],
)  # fmt: skip
def test_cpo_and_simpo_match_trl(ours_type, trl_type, eps, alpha):
    logits, labels = _batch(0)
    average = trl_type == "simpo"  # TRL averages for simpo (and ipo)
    trl_logps = CPOTrainer.get_batch_logps(logits, labels, average_log_prob=average)
    stub = _trl_stub(trl_type, label_smoothing=eps)
    losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(
        stub, trl_logps[:B], trl_logps[B:]
    )
    theirs = losses.mean() + alpha * _trl_nll(logits, labels)
    (grad_theirs,) = torch.autograd.grad(theirs, logits)

    out, logps, _ = _ours(logits, labels, ours_type, average, label_smoothing=eps, cpo_alpha=alpha)
    (grad_ours,) = torch.autograd.grad(out.loss, logits)
    torch.testing.assert_close(out.loss, theirs, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad_ours, grad_theirs, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(out.chosen_rewards, chosen_rewards)
    torch.testing.assert_close(out.rejected_rewards, rejected_rewards)
    torch.testing.assert_close(logps.detach(), trl_logps.detach())


def test_orpo_matches_trl_and_its_metrics():
    """ORPO on TRL's odds_ratio_loss; the NLL on the chosen completion tokens (TRL's covers the
    prompt tokens too — the one documented difference, README "Objectives")."""
    logits, labels = _batch(1)
    trl_logps = ORPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    stub = _trl_stub("orpo")
    losses, chosen_rewards, rejected_rewards, log_odds_ratio, log_odds_chosen = (
        ORPOTrainer.odds_ratio_loss(stub, trl_logps[:B], trl_logps[B:])
    )
    nll = _trl_nll(logits, labels)
    theirs = nll - losses.mean()
    (grad_theirs,) = torch.autograd.grad(theirs, logits, retain_graph=True)

    out, logps, counts = _ours(logits, labels, "orpo", True)
    (grad_ours,) = torch.autograd.grad(out.loss, logits)
    # TRL's odds_ratio_loss casts the log-probs to float32 (`.float()`): fp32 round-off.
    torch.testing.assert_close(out.loss, theirs, rtol=1e-7, atol=0)
    torch.testing.assert_close(grad_ours, grad_theirs, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(out.chosen_rewards, chosen_rewards.double())

    # The metric sums the model logs, finalised: TRL's names and values.
    logps = logps.detach()
    base = dpo_metric_sums(
        out.chosen_rewards, out.rejected_rewards, logps[:B], logps[B:], torch.zeros(B),
        counts[:B], torch.zeros(B), counts[B:], out.per_example,
    )  # fmt: skip
    log_odds = orpo_log_odds(logps[:B], logps[B:])
    nll_sum = -(logps[:B] * counts[:B]).sum()
    m = ORPO_METRICS.finalize(
        reference_free_metric_sums(ORPO_METRICS, base, nll_sum, counts[:B], log_odds)
    )
    expected = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).double().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": trl_logps[:B].mean(),
        "logps/rejected": trl_logps[B:].mean(),
        "nll_loss": nll,
        "log_odds_ratio": log_odds_ratio,
        "log_odds_chosen": log_odds_chosen,
    }
    for name, value in expected.items():
        assert m[name] == pytest.approx(float(value), rel=1e-6, abs=1e-9), name
    assert set(CPO_METRICS.names) < set(ORPO_METRICS.names)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "overrides,fragment",
    [
        (["model.dpo.loss_type=[simpo,sigmoid]"], "mixes reference-free ['simpo']"),
        (["model.dpo.loss_type=sigmoid", "model.dpo.reference_policy=none"], "'none' only with"),
        (["model.dpo.loss_type=cpo", "model.dpo.cpo_alpha=-1"], "cpo_alpha must be >= 0"),
        (["model.dpo.loss_type=orpo", "model.dpo.label_smoothing=0.1"], "not read by"),
        (["model.dpo.loss_type=simpo", "model.dpo.reference_policy=seperate"], "must be one of"),
        (["model.dpo.ld_alpha=1.5"], "ld_alpha: must be in [0, 1]"),
        (["model.dpo.loss_type=simpo", "model.dpo.ld_alpha=0.5"], "LD-DPO weights DPO's"),
        (["model.dpo.loss_type=[sigmoid,sft]", "model.dpo.ld_alpha=0.5"], "not with an SFT"),
        (["model.dpo.ld_alpha=0.5", "model.dpo.sft_loss_weight=0.1"], "not with an SFT"),
        (["model.dpo.loss_type=aot", "model.dpo.f_divergence_type=forward_kl"], "not to aot"),
    ],
)
def test_config_refusals_are_one_line(overrides, fragment):
    with pytest.raises(ConfigError, match="^model.dpo.") as e:
        compose_run_config("gpt_dpo", overrides, "dpo")
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_a_reference_free_loss_resolves_to_no_reference_and_notes_a_stated_one():
    prepared = compose_run_config("gpt_dpo", ["model.dpo.loss_type=simpo"], "dpo")
    assert prepared.cfg.model.dpo.reference_policy == "none"
    stated = compose_run_config(
        "gpt_dpo", ["model.dpo.loss_type=orpo", "model.dpo.reference_policy=separate"], "dpo"
    )
    assert stated.cfg.model.dpo.reference_policy == "none"
    assert any("reference_policy=separate is not used" in n for n in stated.notes)
    with pytest.raises(ConfigError, match="^model.kto.reference_policy: "):
        compose_run_config("gpt_kto", ["model.kto.reference_policy=none"], "kto")


def test_memory_plan_has_no_reference():
    """The start-up plan of a reference-free run holds no reference memory (device or host)."""
    from megatron_kto.planning.memory import run_inputs, startup_lines, worst_rank

    def plan(overrides):
        prepared = compose_run_config("gpt_dpo", overrides, "dpo")
        cfg, arch = prepared.cfg, prepared.architecture
        dims, x, strategy, lora = run_inputs(cfg, arch, 1, "cpu", "dpo")
        lines = startup_lines(cfg, arch, 1, torch.device("cpu"), "dpo")
        return worst_rank(arch, dims, x, strategy, False, lora), strategy, lines

    free, strategy, lines = plan(["model.dpo.loss_type=simpo"])
    assert strategy == "none" and free.reference == free.reference_host == 0
    assert "no reference model (reference-free loss)" in lines[1]
    separate, _, _ = plan(["model.dpo.reference_policy=separate"])
    assert separate.reference > 0 and separate.peak == free.peak + separate.reference
