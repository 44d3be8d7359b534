"""KTO through the entry script learns the bundled synthetic task from random weights.

A randomly initialised tiny model (2 layers, hidden 64; saved once so the reference weights
are on disk) is trained for 40 steps (global batch 32, lr 1e-3 with the config's 5-step warm-up
and cosine decay, β 0.1) by `examples/train_gpt_kto.py`; `tools/eval_kto_rewards.py` then
scores the held-out validation set (drawn with another seed than the training rows).

Measured on this configuration (deterministic on CPU): train `rewards/margins` mean over steps
1-10 ≈ 0.12, over steps 31-40 ≈ 1.9; validation margin (all 128 rows) 1.45 at step 20, 2.30 at
step 40; held-out AUC 0.90 and sign accuracy 0.91 (policy == reference gives AUC 0.5: all
rewards are 0).
The thresholds below sit well inside those numbers so that an unrelated numerical change does
not flip the test, while a model that does not learn (AUC ≈ 0.5, margins ≈ 0) fails it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from e2e_cli import (
    EVAL_TOOL,
    KTO_SCRIPT,
    QUIET,
    TINY_EXAMPLE,
    VALIDATION_DATA,
    read_metrics,
    run_script,
    save_initial_checkpoint,
)

from megatron_kto.eval.classification import roc_auc, summarize

STEPS = 40
GLOBAL_BATCH = 32
AUC_THRESHOLD = 0.75  # measured 0.90
LATE_MARGIN_THRESHOLD = 1.0  # measured ≈ 1.9 (mean train margin over the last 10 steps)


# --- AUC (pure) ---------------------------------------------------------------------------------


def test_roc_auc_by_hand():
    """Positives {0.35, 0.8}, negatives {0.1, 0.4}: of the 4 (pos, neg) pairs, 3 are ordered
    correctly (0.35 < 0.4 is the miss), so AUC = 3/4. A tie counts 1/2: positives {0.4, 0.8}
    against negatives {0.1, 0.4} give (1 + 0.5 + 1 + 1) / 4 = 0.875."""
    assert roc_auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == 0.75
    assert roc_auc(np.array([0.1, 0.4, 0.4, 0.8]), np.array([0, 0, 1, 1])) == 0.875
    assert roc_auc(np.array([3.0, 2.0, 1.0]), np.array([True, False, False])) == 1.0
    assert roc_auc(np.array([3.0, 2.0, 1.0]), np.array([False, True, True])) == 0.0


def test_roc_auc_equals_pairwise_definition_and_handles_ties():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, size=200).astype(float)  # many ties
    labels = rng.random(200) < 0.4
    pos, neg = scores[labels], scores[~labels]
    pairwise = ((pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])).mean()
    assert roc_auc(scores, labels) == pytest.approx(pairwise, abs=1e-12)
    assert roc_auc(np.zeros(10), np.arange(10) % 2 == 0) == 0.5  # policy == reference


def test_roc_auc_needs_both_classes():
    with pytest.raises(ValueError, match="both classes"):
        roc_auc(np.array([0.1, 0.2]), np.array([True, True]))


def test_summarize_by_hand():
    report = summarize(np.array([2.0, -1.0, 0.5, -3.0]), np.array([True, True, False, False]))
    assert (report.num_desirable, report.num_undesirable) == (2, 2)
    assert report.mean_reward_desirable == 0.5 and report.mean_reward_undesirable == -1.25
    assert report.margin == 1.75
    assert report.accuracy == 0.5  # 2.0 right, -1.0 wrong, 0.5 wrong, -3.0 right
    assert report.auc == 0.75  # pairs: (2,.5) (2,-3) (-1,-3) right, (-1,.5) wrong


# --- end to end ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("learning")
    init = save_initial_checkpoint(root / "init", seed=5)
    log_dir = root / "run"
    run_script(
        KTO_SCRIPT,
        [
            *QUIET,
            TINY_EXAMPLE,
            f"pretrained_checkpoint.restore_from_path={init}",
            f"exp_manager.explicit_log_dir={log_dir}",
            f"trainer.kto.max_steps={STEPS}",
            "trainer.kto.val_check_interval=20",
            "trainer.kto.save_interval=0",
            # All 4 validation global batches (128 rows; cross-checked with the eval tool below).
            "trainer.kto.limit_val_batches=1.0",
            f"model.global_batch_size={GLOBAL_BATCH}",
            "model.micro_batch_size=8",
            "model.optim.lr=1e-3",
            "model.kto.ref_policy_kl_penalty=0.1",
        ],
    )
    evals = {}
    for name, nproc in (("dp1", 1), ("dp2", 2)):
        out = root / f"eval_{name}"
        run_script(
            EVAL_TOOL,
            ["--policy", str(log_dir), "--json", f"{out}.json", "--per-example", f"{out}.jsonl"],
            nproc=nproc,
        )
        evals[name] = (
            json.loads((root / f"eval_{name}.json").read_text()),
            [json.loads(line) for line in (root / f"eval_{name}.jsonl").read_text().splitlines()],
        )
    return log_dir, init, evals


@pytest.mark.e2e
def test_margins_rise_during_training(trained):
    log_dir, _, _ = trained
    train = read_metrics(log_dir, "train")
    val = read_metrics(log_dir, "val")
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    margins = np.array([r["rewards/margins"] for r in train])
    early, late = margins[:10].mean(), margins[-10:].mean()
    print(f"\ntrain rewards/margins: steps 1-10 mean {early:.3f}, steps 31-40 mean {late:.3f}")
    print(
        "val rewards/margins: "
        + ", ".join(f"step {r['step']} {r['rewards/margins']:.3f}" for r in val)
    )
    assert margins[0] == 0.0  # policy == reference at the first step
    assert late > LATE_MARGIN_THRESHOLD and late > 5 * early
    assert [r["step"] for r in val] == [20, 40]
    assert 0 < val[0]["rewards/margins"] < val[1]["rewards/margins"]
    assert train[-1]["loss"] < train[0]["loss"]


@pytest.mark.e2e
def test_logged_lr_is_the_rate_of_that_update(trained):
    """A step's update moves the weights iff some update so far had a non-zero rate; the next
    step's rewards show whether the weights moved (they are exactly 0 while policy == reference).
    With warm-up from 0, step 1 updates with lr 0."""
    train = read_metrics(trained[0], "train")
    for k in range(len(train) - 1):
        moved = any(r["lr"] > 0 for r in train[: k + 1])
        next_rewards = (train[k + 1]["rewards/chosen"], train[k + 1]["rewards/rejected"])
        assert (next_rewards != (0.0, 0.0)) == moved, (k + 1, train[k]["lr"], next_rewards)


@pytest.mark.e2e
def test_implicit_reward_classifies_held_out_examples(trained):
    _, init, evals = trained
    report, rows = evals["dp1"]
    print(
        f"\nheld-out AUC {report['auc']:.4f}, accuracy {report['accuracy']:.4f}, mean reward "
        f"desirable {report['mean_reward_desirable']:+.4f} / undesirable "
        f"{report['mean_reward_undesirable']:+.4f}"
    )
    assert report["settings"]["reference"] == str(init)  # from the run's restore_from_path
    assert report["settings"]["data"] == [str(VALIDATION_DATA)]
    assert report["num_examples"] == len(VALIDATION_DATA.read_text().splitlines()) == len(rows)
    assert report["auc"] > AUC_THRESHOLD
    assert report["accuracy"] > 0.7  # measured 0.91
    assert report["mean_reward_desirable"] > 0 > report["mean_reward_undesirable"]


@pytest.mark.e2e
def test_eval_agrees_with_training_validation_and_across_ranks(trained):
    """The tool's per-example rewards reproduce the trainer's own validation metrics at the
    last step (same weights: the final checkpoint) over the whole validation pass — 4 global
    batches whose class mixes differ, so a mean of per-batch means would not match — and a
    2-rank (DP=2) evaluation gives the same table."""
    log_dir, _, evals = trained
    report, rows = evals["dp1"]
    final_val = read_metrics(log_dir, "val")[-1]
    assert len(rows) == 4 * GLOBAL_BATCH
    for label, suffix in ((True, "chosen"), (False, "rejected")):
        rewards = [r["reward"] for r in rows if r["label"] == label]
        logps = [r["policy_logps"] for r in rows if r["label"] == label]
        assert np.mean(rewards) == pytest.approx(final_val[f"rewards/{suffix}"], rel=1e-4)
        assert np.mean(logps) == pytest.approx(final_val[f"logps/{suffix}"], rel=1e-5)
    assert report["margin"] == pytest.approx(final_val["rewards/margins"], rel=1e-4)
    per_batch = [
        np.mean([r["reward"] for r in rows[b : b + GLOBAL_BATCH] if r["label"]])
        for b in range(0, len(rows), GLOBAL_BATCH)
    ]
    print(
        f"\nvalidation rewards/chosen {final_val['rewards/chosen']:.5f} = eval "
        f"{report['mean_reward_desirable']:.5f}; mean of per-batch means would be "
        f"{np.mean(per_batch):.5f}"
    )
    _, rows2 = evals["dp2"]
    assert [r["label"] for r in rows2] == [r["label"] for r in rows]
    np.testing.assert_allclose(
        [r["reward"] for r in rows2], [r["reward"] for r in rows], rtol=1e-5, atol=1e-6
    )
