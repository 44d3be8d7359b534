"""Equality with TRL 1.16's own KTO / DPO loss code on random inputs.

TRL 1.16 has no standalone ``kto_loss`` / ``dpo_loss`` method: the loss and metric code is inline
in ``KTOTrainer._compute_loss`` / ``DPOTrainer._compute_loss``. We run those methods unmodified
with a minimal stand-in ``self`` and a fake model whose outputs are the per-token log-probs we
choose, with ``precompute_ref_logps=True`` so the reference log-probs come from the batch. The
same per-token tensors go through our functions; losses, gradients and metrics must agree.

Only the TRL attributes the code path reads are set on the stand-in; if a TRL release reads
more, the test fails loudly with an AttributeError rather than silently comparing less.
"""

from __future__ import annotations

import types
from collections import defaultdict

import pytest
import torch

from megatron_kto.losses import (
    KTO_METRICS,
    dpo_metric_sums,
    dpo_total_loss,
    finalize_dpo_metrics,
    finalize_kto_metrics,
    kl_reference_point,
    kto_metric_sums,
    kto_total_loss,
)

trl = pytest.importorskip("trl")
from trl.trainer.dpo_trainer import DPOTrainer  # noqa: E402
from trl.trainer.kto_trainer import KTOTrainer  # noqa: E402

PROMPT_LEN = 2
SEQ_LEN = 9


def _completion_mask(n_tokens: torch.Tensor) -> torch.Tensor:
    """[B, SEQ_LEN] mask: PROMPT_LEN prompt tokens, then n_i completion tokens, then padding."""
    pos = torch.arange(SEQ_LEN).unsqueeze(0)
    return ((pos >= PROMPT_LEN) & (pos < PROMPT_LEN + n_tokens.unsqueeze(1))).long()


class _FakeModel:
    """Stands in for TRL's model call: returns fixed per-token outputs, chosen by token id."""

    def __init__(self, outputs_by_token: dict[int, types.SimpleNamespace]) -> None:
        self.outputs_by_token = outputs_by_token

    def __call__(self, input_ids: torch.Tensor, **_: object) -> types.SimpleNamespace:
        return self.outputs_by_token[int(input_ids[0, 0])]


def _outputs(log_probs: torch.Tensor, mean_logits: torch.Tensor) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        log_probs=log_probs,
        mean_logits=mean_logits,
        entropy=torch.zeros_like(mean_logits),
        is_top1=torch.zeros_like(mean_logits, dtype=torch.bool),
    )


def _stub_self(**attrs: object) -> types.SimpleNamespace:
    identity = lambda x: x  # noqa: E731 - single-process accelerate gathers are the identity
    return types.SimpleNamespace(
        model=types.SimpleNamespace(training=True),
        accelerator=types.SimpleNamespace(
            device=torch.device("cpu"), gather_for_metrics=identity, gather=identity
        ),
        aux_loss_enabled=False,
        precompute_ref_logps=True,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
        **attrs,
    )


def _kto_case(seed: int, labels: list[bool], kl_shift: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b = len(labels)
    n = torch.randint(1, SEQ_LEN - PROMPT_LEN + 1, (b,), generator=g)
    n_kl = torch.randint(1, SEQ_LEN - PROMPT_LEN + 1, (b,), generator=g)
    mask = _completion_mask(n)[:, 1:].double()
    kl_mask = _completion_mask(n_kl)[:, 1:].double()
    per_token = -3 * torch.rand(b, SEQ_LEN - 1, generator=g, dtype=torch.float64)
    kl_per_token = -3 * torch.rand(b, SEQ_LEN - 1, generator=g, dtype=torch.float64)
    kl_logps = (kl_per_token * kl_mask).sum(-1)
    return {
        "n": n,
        "n_kl": n_kl,
        "mask": mask,
        "kl_mask": kl_mask,
        "per_token": per_token,
        "kl_per_token": kl_per_token,
        "ref_logps": (per_token * mask).sum(-1) + torch.randn(b, generator=g, dtype=torch.float64),
        # kl_shift > 0 makes the mean KL positive; < 0 exercises the clamp at 0.
        "ref_kl_logps": kl_logps - kl_shift + torch.randn(b, generator=g, dtype=torch.float64),
        "mean_logits": torch.randn(b, SEQ_LEN - 1, generator=g, dtype=torch.float64),
        "labels": torch.tensor(labels),
    }


def _run_trl_kto(case, loss_type, beta, lam_d, lam_u):
    b = case["labels"].shape[0]
    leaf = case["per_token"].clone().requires_grad_(True)
    model = _FakeModel(
        {
            1: _outputs(leaf * case["mask"], case["mean_logits"]),
            2: _outputs(case["kl_per_token"] * case["kl_mask"], case["mean_logits"]),
        }
    )
    batch = {
        "input_ids": torch.ones(b, SEQ_LEN, dtype=torch.long),
        "attention_mask": torch.ones(b, SEQ_LEN, dtype=torch.long),
        "completion_mask": _completion_mask(case["n"]),
        "KL_input_ids": torch.full((b, SEQ_LEN), 2, dtype=torch.long),
        "KL_attention_mask": torch.ones(b, SEQ_LEN, dtype=torch.long),
        "KL_completion_mask": _completion_mask(case["n_kl"]),
        "label": case["labels"],
        "ref_logps": case["ref_logps"],
        "ref_KL_logps": case["ref_kl_logps"],
    }
    stub = _stub_self(
        calculate_KL=True,
        loss_type=loss_type,
        beta=beta,
        desirable_weight=lam_d,
        undesirable_weight=lam_u,
    )
    stub._compute_kl_logps = types.MethodType(KTOTrainer._compute_kl_logps, stub)
    loss = KTOTrainer._compute_loss(stub, model, batch, return_outputs=False)
    loss.backward()
    metrics = {k: v[-1] for k, v in stub._metrics["train"].items()}
    return loss.detach(), leaf.grad, metrics


def _run_ours_kto(case, loss_type, beta, lam_d, lam_u, micro_batches):
    """Split the batch into micro-batches (as pipeline schedule + data-parallel ranks would),
    sum the fixed-size metric tensors, and normalise the loss by the global batch size."""
    b = case["labels"].shape[0]
    leaf = case["per_token"].clone().requires_grad_(True)
    policy_logps = (leaf * case["mask"]).sum(-1)
    kl_logps = (case["kl_per_token"] * case["kl_mask"]).sum(-1)
    z0 = kl_reference_point((kl_logps - case["ref_kl_logps"]).sum(), b)
    logits_sum = (case["mean_logits"] * case["mask"]).sum(-1)
    num_tokens = case["mask"].sum(-1)

    total = torch.zeros((), dtype=torch.float64)
    sums = KTO_METRICS.zeros()
    for idx in torch.arange(b).chunk(micro_batches):
        out = kto_total_loss(
            policy_logps[idx],
            case["ref_logps"][idx],
            case["labels"][idx],
            z0,
            beta,
            lam_d,
            lam_u,
            loss_type,
            normalizer=b,
        )
        total = total + out.loss
        sums += kto_metric_sums(
            out.rewards,
            policy_logps[idx],
            case["labels"][idx],
            logits_sum[idx],
            num_tokens[idx],
            out.per_example,
        )
    total.backward()
    return total.detach(), leaf.grad, finalize_kto_metrics(sums, z0)


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
@pytest.mark.parametrize(
    "seed,labels,kl_shift",
    [
        (0, [True, False, True, True, False, False, True, False], 2.0),
        (1, [True, True, False, True, False, True, True], -2.0),  # negative KL → clamp
        (2, [False, True, False, False, True], 1.0),
        (3, [True, True, True, True], 1.0),  # one-class batches
        (4, [False, False, False], 1.0),
    ],
)
def test_kto_matches_trl(loss_type: str, seed: int, labels: list[bool], kl_shift: float) -> None:
    beta, lam_d, lam_u = 0.1, 1.0, 1.33
    case = _kto_case(seed, labels, kl_shift)
    trl_loss, trl_grad, trl_metrics = _run_trl_kto(case, loss_type, beta, lam_d, lam_u)
    our_loss, our_grad, our_metrics = _run_ours_kto(
        case, loss_type, beta, lam_d, lam_u, micro_batches=2
    )
    torch.testing.assert_close(our_loss, trl_loss.to(our_loss.dtype))
    torch.testing.assert_close(our_grad, trl_grad)
    # TRL omits the metrics of a missing class (and margins then); all it reports must match.
    expected = {"kl"}
    for cls, present in (("chosen", any(labels)), ("rejected", not all(labels))):
        if present:
            expected |= {f"rewards/{cls}", f"logps/{cls}", f"logits/{cls}"}
    if any(labels) and not all(labels):
        expected.add("rewards/margins")
    assert expected <= set(trl_metrics)
    for name in expected:
        assert our_metrics[name] == pytest.approx(trl_metrics[name], rel=1e-9, abs=1e-12), name
    if kl_shift < 0:
        assert our_metrics["kl"] == 0.0


def _dpo_case(seed: int, b: int, equal_lengths: bool):
    g = torch.Generator().manual_seed(seed)
    if equal_lengths:
        n = torch.full((2 * b,), 4)
    else:
        n = torch.randint(1, SEQ_LEN - PROMPT_LEN + 1, (2 * b,), generator=g)
    mask = _completion_mask(n)[:, 1:].double()
    per_token = -3 * torch.rand(2 * b, SEQ_LEN - 1, generator=g, dtype=torch.float64)
    ref = (per_token * mask).sum(-1) + 2 * torch.randn(2 * b, generator=g, dtype=torch.float64)
    mean_logits = torch.randn(2 * b, SEQ_LEN - 1, generator=g, dtype=torch.float64)
    return {"n": n, "mask": mask, "per_token": per_token, "ref": ref, "mean_logits": mean_logits}


def _run_trl_dpo(
    case,
    loss_types,
    loss_weights,
    beta,
    label_smoothing=0.0,
    discopop_tau=0.05,
    f_divergence_type="reverse_kl",
    f_alpha_divergence_coef=0.5,
    ld_alpha=None,
):
    two_b = case["n"].shape[0]
    leaf = case["per_token"].clone().requires_grad_(True)
    model = _FakeModel({1: _outputs(leaf * case["mask"], case["mean_logits"])})
    ref_chosen, ref_rejected = case["ref"].chunk(2)
    inputs = {
        "input_ids": torch.ones(two_b, SEQ_LEN, dtype=torch.long),
        "attention_mask": torch.ones(two_b, SEQ_LEN, dtype=torch.long),
        "completion_mask": _completion_mask(case["n"]),
        "ref_chosen_logps": ref_chosen,
        "ref_rejected_logps": ref_rejected,
    }
    stub = _stub_self(
        beta=beta,
        loss_types=loss_types,
        loss_weights=loss_weights,
        label_smoothing=label_smoothing,
        args=types.SimpleNamespace(discopop_tau=discopop_tau),
        ld_alpha=ld_alpha,
        f_divergence_type=f_divergence_type,
        f_alpha_divergence_coef=f_alpha_divergence_coef,
        use_weighting=False,
    )
    loss = DPOTrainer._compute_loss(stub, model, inputs, return_outputs=False)
    loss.backward()
    return loss.detach(), leaf.grad, {k: v[-1] for k, v in stub._metrics["train"].items()}


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo"])
@pytest.mark.parametrize("seed", [0, 1])
def test_dpo_matches_trl(loss_type: str, seed: int) -> None:
    beta, b = 0.1, 5
    case = _dpo_case(seed, b, equal_lengths=False)
    trl_loss, trl_grad, trl_metrics = _run_trl_dpo(case, [loss_type], [1.0], beta)

    leaf = case["per_token"].clone().requires_grad_(True)
    logps = (leaf * case["mask"]).sum(-1)
    ref = case["ref"]
    n_tokens = case["mask"].sum(-1)
    if loss_type == "ipo":
        # TRL's IPO is length-normalised; ours is when the caller passes per-token means.
        logps, ref = logps / n_tokens, ref / n_tokens
    pc, pr = logps.chunk(2)
    rc, rr = ref.chunk(2)
    out = dpo_total_loss(pc, pr, rc, rr, beta=beta, loss_type=loss_type)
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach(), trl_loss.to(torch.float64))
    torch.testing.assert_close(leaf.grad, trl_grad)

    if loss_type != "ipo":  # TRL's IPO metrics use un-normalised log-ratios, ours the inputs
        logits_sum = (case["mean_logits"] * case["mask"]).sum(-1)
        ls_c, ls_r = logits_sum.chunk(2)
        nt_c, nt_r = n_tokens.chunk(2)
        m = finalize_dpo_metrics(
            dpo_metric_sums(
                out.chosen_rewards,
                out.rejected_rewards,
                pc,
                pr,
                ls_c,
                nt_c,
                ls_r,
                nt_r,
                out.per_example,
            )
        )
        for name in (
            "rewards/chosen",
            "rewards/rejected",
            "rewards/accuracies",
            "rewards/margins",
            "logps/chosen",
            "logps/rejected",
            "logits/chosen",
            "logits/rejected",
        ):
            # TRL averages accuracies in float32, hence the looser tolerance.
            assert m[name] == pytest.approx(trl_metrics[name], rel=1e-6, abs=1e-12), name


def test_dpo_sft_term_matches_trl_with_equal_lengths() -> None:
    """TRL's ``sft`` loss is a token-weighted mean over the batch, ours a per-example
    per-token mean; with equal completion lengths the two coincide."""
    beta, b, w = 0.1, 4, 0.7
    case = _dpo_case(5, b, equal_lengths=True)
    trl_loss, trl_grad, _ = _run_trl_dpo(case, ["sigmoid", "sft"], [1.0, w], beta)

    leaf = case["per_token"].clone().requires_grad_(True)
    pc, pr = (leaf * case["mask"]).sum(-1).chunk(2)
    rc, rr = case["ref"].chunk(2)
    nt_c, _ = case["mask"].sum(-1).chunk(2)
    out = dpo_total_loss(pc, pr, rc, rr, beta=beta, sft_loss_weight=w, chosen_num_tokens=nt_c)
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach(), trl_loss.to(torch.float64))
    torch.testing.assert_close(leaf.grad, trl_grad)


@pytest.mark.parametrize(
    "loss_types,loss_weights,eps,equal_lengths",
    [
        (["exo_pair"], [1.0], 1e-3, False),
        (["exo_pair"], [1.0], 0.2, False),
        (["nca_pair"], [1.0], 0.0, False),
        (["robust"], [1.0], 0.0, False),
        (["robust"], [1.0], 0.3, False),
        (["sppo_hard"], [1.0], 0.0, False),
        (["bco_pair"], [1.0], 0.0, False),
        (["aot"], [1.0], 0.0, False),
        (["aot"], [1.0], 0.2, False),
        (["aot_unpaired"], [1.0], 0.0, False),
        (["aot_unpaired"], [1.0], 0.2, False),
        (["apo_zero"], [1.0], 0.0, False),
        (["apo_down"], [1.0], 0.0, False),
        (["discopop"], [1.0], 0.0, False),
        (["sigmoid_norm"], [1.0], 0.0, False),
        (["sft"], [1.0], 0.0, True),  # TRL's sft is token-weighted: equal lengths to coincide
        # MPO-style mixtures, TRL's loss_type list with loss_weights.
        (["sigmoid", "sigmoid_norm", "apo_zero"], [0.5, 2.0, 1.0], 0.0, False),
        (["robust", "nca_pair", "discopop"], [0.8, 0.2, 1.5], 0.1, False),
        (["sigmoid", "sft", "sppo_hard"], [1.0, 0.3, 0.05], 0.0, True),
        (["aot", "aot_unpaired", "bco_pair"], [1.0, 0.5, 0.25], 0.1, False),
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_dpo_catalogue_matches_trl(
    loss_types: list[str], loss_weights: list[float], eps: float, equal_lengths: bool, seed: int
) -> None:
    """Loss and gradient equal TRL 1.16's on random sums of per-token log-probs, to 1e-6
    relative (label smoothing included where the loss reads it)."""
    beta, b, tau = 0.1, 5, 0.05
    case = _dpo_case(seed, b, equal_lengths=equal_lengths)
    trl_loss, trl_grad, _ = _run_trl_dpo(case, loss_types, loss_weights, beta, eps, tau)

    leaf = case["per_token"].clone().requires_grad_(True)
    pc, pr = (leaf * case["mask"]).sum(-1).chunk(2)
    rc, rr = case["ref"].chunk(2)
    nt_c, nt_r = case["mask"].sum(-1).chunk(2)
    out = dpo_total_loss(
        pc,
        pr,
        rc,
        rr,
        beta=beta,
        loss_type=loss_types,
        loss_weights=loss_weights,
        label_smoothing=eps,
        discopop_tau=tau,
        chosen_num_tokens=nt_c,
        rejected_num_tokens=nt_r,
    )
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach(), trl_loss.to(torch.float64), rtol=1e-6, atol=0)
    torch.testing.assert_close(leaf.grad, trl_grad, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize(
    "kind,alpha,loss_types,loss_weights,eps,equal_lengths",
    [
        ("forward_kl", 0.5, ["sigmoid"], [1.0], 0.0, False),
        ("js_divergence", 0.5, ["hinge"], [1.0], 0.0, False),
        ("forward_kl", 0.5, ["exo_pair"], [1.0], 1e-3, False),
        ("js_divergence", 0.5, ["sigmoid_norm", "sft"], [1.0, 0.5], 0.0, True),
        ("alpha_divergence", 0.5, ["robust"], [1.0], 0.1, False),
        (
            "alpha_divergence",
            0.3,
            ["sigmoid", "sigmoid_norm", "discopop"],
            [1.0, 0.5, 2.0],
            0.0,
            False,
        ),
        ("alpha_divergence", 2.0, ["hinge"], [1.0], 0.0, False),
        ("alpha_divergence", 1.0, ["sigmoid"], [1.0], 0.0, False),  # the reverse_kl limit
    ],
)
def test_dpo_f_divergence_matches_trl(kind, alpha, loss_types, loss_weights, eps, equal_lengths):
    """f-DPO scores in place of the log-ratios: loss and gradient equal TRL 1.16's, and the
    rewards metrics stay β·u. TRL's alpha_divergence takes fp32/bf16/fp16 only (its clamp table
    has no fp64 entry), so those cases run in fp32."""
    beta, b, tau = 0.1, 5, 0.05
    dtype = torch.float32 if kind == "alpha_divergence" else torch.float64
    case = {
        k: v.to(dtype) if v.is_floating_point() else v
        for k, v in _dpo_case(3, b, equal_lengths).items()
    }
    trl_loss, trl_grad, trl_metrics = _run_trl_dpo(
        case, loss_types, loss_weights, beta, eps, tau, kind, alpha
    )

    leaf = case["per_token"].clone().requires_grad_(True)
    pc, pr = (leaf * case["mask"]).sum(-1).chunk(2)
    rc, rr = case["ref"].chunk(2)
    nt_c, nt_r = case["mask"].sum(-1).chunk(2)
    out = dpo_total_loss(
        pc,
        pr,
        rc,
        rr,
        beta=beta,
        loss_type=loss_types,
        loss_weights=loss_weights,
        label_smoothing=eps,
        discopop_tau=tau,
        chosen_num_tokens=nt_c,
        rejected_num_tokens=nt_r,
        f_divergence_type=kind,
        f_alpha_divergence_coef=alpha,
    )
    out.loss.backward()
    rtol = 1e-6  # TRL's exo_pair takes log(ε) of a float32 ε, even on fp64 inputs
    torch.testing.assert_close(out.loss.detach(), trl_loss.to(dtype), rtol=rtol, atol=0)
    torch.testing.assert_close(leaf.grad, trl_grad, rtol=rtol, atol=1e-12)
    for ours, name in (
        (out.chosen_rewards, "rewards/chosen"),
        (out.rejected_rewards, "rewards/rejected"),
    ):
        assert ours.mean().item() == pytest.approx(trl_metrics[name], rel=1e-6), name


@pytest.mark.parametrize("alpha", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("loss_types", [["sigmoid"], ["aot", "bco_pair"]])
def test_ld_alpha_matches_trl(alpha: float, loss_types: list[str]) -> None:
    """LD-DPO: TRL's ``ld_alpha`` weights the policy's tokens beyond the pair's shorter
    completion (its reference pass weights the reference's the same way; here the reference
    log-probs are given, as TRL's precomputed ones). Our ``ld_token_weights`` on the same masks,
    multiplied into the per-token log-probs: loss and gradient equal TRL's. The reference side
    runs through the same forward pass in training (tests/test_dpo_trl_parity.py)."""
    beta = 0.1
    case = _dpo_case(3, 5, equal_lengths=False)
    trl_loss, trl_grad, _ = _run_trl_dpo(case, loss_types, [1.0] * len(loss_types), beta,
                                         ld_alpha=alpha)  # fmt: skip
    from megatron_kto.losses.length_desensitized import ld_token_weights

    mask_c, mask_r = case["mask"].chunk(2)
    w_c, w_r = ld_token_weights(mask_c.bool(), mask_r.bool(), alpha)
    leaf = case["per_token"].clone().requires_grad_(True)
    logps = (leaf * case["mask"] * torch.cat([w_c, w_r]).double()).sum(-1)
    n_tokens = case["mask"].sum(-1)
    ref = case["ref"]
    pc, pr = logps.chunk(2)
    rc, rr = ref.chunk(2)
    nt_c, nt_r = n_tokens.chunk(2)
    out = dpo_total_loss(pc, pr, rc, rr, beta=beta, loss_type=loss_types,
                         chosen_num_tokens=nt_c, rejected_num_tokens=nt_r)  # fmt: skip
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach(), trl_loss.to(torch.float64), rtol=1e-6, atol=0)
    torch.testing.assert_close(leaf.grad, trl_grad, rtol=1e-6, atol=1e-12)
