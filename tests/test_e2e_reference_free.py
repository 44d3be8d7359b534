"""`examples/train_gpt_dpo.py model.dpo.loss_type=simpo|orpo`: the reference-free objectives
from the command line (the bundled tiny paired example, a few steps).

A reference-free run's reference policy is `NoReferencePolicy`, which raises if it is ever asked
for log-probs: a run that finishes (training and validation) ran no reference pass. Shown here:
the start-up and memory-plan lines say no reference model is used; TRL's metric names (SimPO:
CPOTrainer's, with ``nll_loss``; ORPO: ``log_odds_ratio`` / ``log_odds_chosen``); TP=2 equals
TP=1 step by step; a run resumed at step 2 continues as the straight run; LoRA runs with no
adapters-off pass; `tools/eval_kto_rewards.py` on the SimPO run reads no reference and reports
the policy's own rewards, equal to the run's validation row on the same pairs.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
from e2e_cli import EVAL_TOOL, QUIET, REPO, read_metrics, run_script

pytestmark = pytest.mark.e2e

DPO_SCRIPT = REPO / "examples" / "train_gpt_dpo.py"
STEPS = 3
RTOL = 1e-4


def _args(log_dir, loss_type: str, steps: int = STEPS) -> list[str]:
    return [
        "example=tiny_dpo",
        *QUIET,
        f"exp_manager.explicit_log_dir={log_dir}",
        f"model.dpo.loss_type={loss_type}",
        f"trainer.dpo.max_steps={steps}",
        f"trainer.dpo.val_check_interval={STEPS}",
        "trainer.dpo.limit_val_batches=1",
        "model.optim.sched.name=Constant",
        "model.optim.sched.warmup_steps=0",
    ]


LORA = ["model.peft.peft_scheme=lora", "model.peft.lora_tuning.adapter_dim=4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("reffree")
    out = {}
    out["simpo"] = run_script(DPO_SCRIPT, _args(root / "simpo", "simpo"))
    out["simpo_tp2"] = run_script(
        DPO_SCRIPT, [*_args(root / "simpo_tp2", "simpo"), "model.tensor_model_parallel_size=2"], 2
    )
    # Resume: 2 steps, then the 3rd in the same run directory.
    run_script(DPO_SCRIPT, _args(root / "resumed", "simpo", steps=2))
    out["resumed"] = run_script(DPO_SCRIPT, _args(root / "resumed", "simpo"))
    out["orpo_lora"] = run_script(
        DPO_SCRIPT,
        [*_args(root / "orpo_lora", "orpo"), *LORA, "model.dpo.reference_policy=separate"],
    )
    # The pairs of the run's one validation batch (validation is read in order).
    val = REPO / "examples" / "data" / "tiny_dpo" / "validation.jsonl"
    (root / "val8.jsonl").write_text("".join(val.read_text().splitlines(True)[:8]))
    out["eval"] = run_script(
        EVAL_TOOL,
        ["--policy", str(root / "simpo"), "--algorithm", "dpo", "--data", str(root / "val8.jsonl"),
         "--json", str(root / "eval.json")],
    )  # fmt: skip
    out["eval_json"] = json.loads((root / "eval.json").read_text())
    metrics = {n: read_metrics(root / n) + read_metrics(root / n, "val") for n in out
               if n not in ("eval", "eval_json")}  # fmt: skip
    yield out, metrics
    shutil.rmtree(root, ignore_errors=True)


def test_start_up_says_no_reference_model(runs):
    procs, _ = runs
    text = procs["simpo"].stdout + procs["simpo"].stderr
    assert "loss_type simpo is reference-free: no reference model is used" in text
    assert "no reference model (reference-free loss)" in text  # the memory plan's line
    assert "cpu_swap" not in text and "precomputing reference" not in text
    lora = procs["orpo_lora"].stdout + procs["orpo_lora"].stderr
    assert "model.dpo.reference_policy=separate is not used" in lora
    assert "reference = none (reference-free loss type)" in lora


def test_metrics_under_trls_names(runs):
    _, metrics = runs
    simpo, orpo = metrics["simpo"], metrics["orpo_lora"]
    assert [r["step"] for r in simpo] == [1, 2, 3, 3]  # three steps, then validation
    for row in simpo + orpo:
        assert math.isfinite(row["loss"]) and row["nll_loss"] > 0
        assert "kl" not in row
        # SimPO/ORPO rewards are β × per-token mean log-probs (TRL's CPO/ORPO trainers)
        assert row["rewards/chosen"] == pytest.approx(0.1 * row["logps/chosen"], rel=1e-6)
    for row in orpo:
        assert row["log_odds_ratio"] <= 0 and "log_odds_chosen" in row
    assert "log_odds_ratio" not in simpo[0]


def test_tp2_and_resume_match_the_straight_run(runs):
    _, metrics = runs
    keys = ("loss", "nll_loss", "rewards/chosen", "rewards/margins", "grad_norm")
    last = [r for r in metrics["simpo"] if r["step"] == STEPS]  # train and validation rows
    for rows, ref in (
        (metrics["simpo_tp2"], metrics["simpo"]),
        ([r for r in metrics["resumed"] if r["step"] == STEPS], last),
    ):
        assert [(r["split"], r["step"]) for r in rows] == [(r["split"], r["step"]) for r in ref]
        for a, b in zip(rows, ref, strict=True):
            for k in keys:
                if k in b:
                    assert a[k] == pytest.approx(b[k], rel=RTOL, abs=1e-6), (a["step"], k)


def test_eval_tool_reports_the_policys_own_rewards(runs):
    """SimPO's rewards are β × the per-token mean log-prob; the tool runs no reference pass, says
    so, reports no sign accuracy, and its class means are the run's `val` rewards/chosen and
    rewards/rejected on the same 8 pairs."""
    out, metrics = runs
    report, printed = out["eval_json"], out["eval"].stdout
    assert "reference: none (reference-free" in printed and report["settings"]["reference"] is None
    assert report["accuracy"] is None and report["settings"]["average_log_probs"] is True
    val = [r for r in metrics["simpo"] if r["split"] == "val"][-1]
    assert report["mean_reward_desirable"] == pytest.approx(val["rewards/chosen"], rel=1e-5)
    assert report["mean_reward_undesirable"] == pytest.approx(val["rewards/rejected"], rel=1e-5)
    assert report["margin"] == pytest.approx(val["rewards/margins"], rel=1e-4, abs=1e-7)
    assert 0.0 <= report["auc"] <= 1.0
