"""A non-finite step, run as a user would (CLI, 2 data-parallel ranks): `trainer.non_finite`.

The cause is a real one: a corrupted weight. A tiny Hugging Face model (untied embeddings) has
the embedding rows of the bytes of "Ω" set to NaN in its safetensors, and exactly one data row
(line 6, in the second global batch: 12 rows, global batch 4, no shuffle) contains "Ω". Step 1
trains and saves `step_1`; step 2's loss, log-probs, rewards, reference log-probs and gradients
are NaN.

- `stop` (the default): every rank exits non-zero (rank 0 exit code 2, torchrun's 1) within
  seconds of the step, with one `error:` line naming step 2, the quantities, the row
  (`train.jsonl:6`) and the untouched checkpoint; `latest` still names `step_1`.
- `skip`: step 2's update is skipped with one `warning:` line, training goes on to step 3, and
  metrics.jsonl counts it (`skipped_steps`, also kept in the checkpoints' trainer state), with
  no `null` anywhere.

Two runs, side by side (~40 s on 2 cores).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from e2e_cli import KTO_SCRIPT, QUIET, launch, read_metrics
from hf_tiny import EXAMPLE_TRAIN, make_hf_chat_model

pytestmark = pytest.mark.e2e

CORRUPT = "Ω"
BAD_LINE = 6
#: NaN at step 2: the metrics with the corrupted (desirable) row, z0 (its KL row), the
#: reference's log-probs (the same weights) and the gradients.
QUANTITIES = (
    "rewards/chosen, logps/chosen, logits/chosen, loss, rewards/margins, kl, "
    "reference log-probs, gradient norm"
)


def _corrupt_model_and_data(root):
    """The model with NaN embeddings for CORRUPT's tokens, and 12 rows of which line 6 holds it."""
    import torch
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer

    hf = make_hf_chat_model(root / "hf", tie=False)
    rows = [json.loads(line) for line in EXAMPLE_TRAIN.read_text().splitlines()[:12]]
    rows[BAD_LINE - 1]["completion"] = rows[BAD_LINE - 1]["completion"].replace("apple", CORRUPT)
    tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
    bad_ids = set(tok.encode(CORRUPT).ids)
    for i, r in enumerate(rows, start=1):  # only line 6 reads a corrupted row
        ids = set(tok.encode(r["prompt"] + r["completion"]).ids)
        assert bool(ids & bad_ids) == (i == BAD_LINE), (i, ids & bad_ids)
    weights = load_file(str(hf / "model.safetensors"))
    weights["model.embed_tokens.weight"][sorted(bad_ids)] = float("nan")
    save_file(weights, str(hf / "model.safetensors"), metadata={"format": "pt"})
    train = root / "data" / "train.jsonl"
    train.parent.mkdir()
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert not torch.isnan(weights["model.embed_tokens.weight"]).all()
    return hf, train


def _args(hf, train, log_dir, policy):
    return [
        str(KTO_SCRIPT),
        *QUIET,
        f"pretrained_checkpoint.restore_from_path={hf}",
        f"model.data.data_prefix.train=[{train}]",
        "model.data.data_prefix.validation=[]",
        "trainer.precision=32",
        f"exp_manager.explicit_log_dir={log_dir}",
        "trainer.kto.max_steps=3",
        "trainer.kto.save_interval=1",
        "model.global_batch_size=4",
        "model.micro_batch_size=1",
        "model.data.shuffle=false",
        "model.data.max_length=64",
        f"trainer.non_finite={policy}",
    ]


def _timed_launch(args):
    started = time.time()
    proc, _ = launch(args, 2, 300, real=True)
    return proc, started, time.time()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("non_finite")
    hf, train = _corrupt_model_and_data(root)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            policy: pool.submit(_timed_launch, _args(hf, train, root / policy, policy))
            for policy in ("stop", "skip")
        }
        out = {policy: f.result() for policy, f in futures.items()}
    return root, train, out


def _lines(proc, prefix):
    return [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith(prefix)]


def test_stop_is_one_line_and_keeps_the_last_checkpoint(runs):
    root, train, out = runs
    proc, started, ended = out["stop"]
    assert proc.returncode == 1, proc.stderr[-3000:]  # torchrun's, after rank 0's 2
    assert "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]
    ckpts = root / "stop" / "checkpoints"
    assert _lines(proc, "error:") == [
        f"error: step 2: non-finite {QUANTITIES}; rows: {train}:{BAD_LINE}; stopped "
        f"(trainer.non_finite=stop): the last good checkpoint, {ckpts / 'step_1'}, is untouched "
        f"and a rerun resumes from it; check those rows and the weights, or set "
        f"trainer.non_finite=skip to skip such steps"
    ], (proc.stdout + proc.stderr)[-4000:]
    # No rank prints a traceback (torchrun's own report of the failed rank follows).
    assert "]: Traceback" not in proc.stdout + proc.stderr
    assert (ckpts / "latest").read_text().strip() == "step_1"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_1"]
    # From the last save (just before step 2) to every rank gone.
    seconds = ended - (ckpts / "latest").stat().st_mtime
    print(
        f"stop: exit {proc.returncode} {seconds:.1f} s after step 1's checkpoint, run {ended - started:.0f} s"
    )
    assert seconds < 30, seconds
    assert [r["step"] for r in read_metrics(root / "stop")] == [1]


def test_skip_counts_the_step_and_trains_on(runs):
    root, train, out = runs
    proc, _, _ = out["skip"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _lines(proc, "warning: step") == [
        f"warning: step 2: non-finite {QUANTITIES}; rows: {train}:{BAD_LINE}; update skipped "
        f"(trainer.non_finite=skip, 1 skipped so far)"
    ], (proc.stdout + proc.stderr)[-4000:]
    rows = read_metrics(root / "skip")
    assert [(r["step"], r["skipped_steps"], r["skipped_step"]) for r in rows] == [
        (1, 0, 0.0),
        (2, 1, 1.0),
        (3, 1, 0.0),
    ]
    # The count is part of the trainer state a resume continues from.
    state = json.loads(
        (root / "skip" / "checkpoints" / "step_3" / "trainer_state.json").read_text()
    )
    assert state["skipped_steps"] == 1
    text = (root / "skip" / "metrics.jsonl").read_text()
    assert "null" not in text and "NaN" not in text
    assert "loss" not in rows[1] and all(r["loss"] == r["loss"] for r in (rows[0], rows[2]))
