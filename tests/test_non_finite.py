"""The pure parts of `trainer.non_finite`: which names are non-finite, which examples' rows, and
the file:line of an example (`data.provenance`). CPU, no process group, well under a second."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import torch

from megatron_kto.algorithms.non_finite import NonFiniteStep, bad_rows, non_finite_names
from megatron_kto.data.provenance import row_sources
from megatron_kto.data.stats import DatasetStats


def test_non_finite_names_keep_the_metrics_order():
    metrics = {"rewards/chosen": math.inf, "loss": math.nan, "kl": 0.0, "lr": 1e-3}
    assert non_finite_names(metrics) == ["rewards/chosen", "loss"]


def test_bad_rows_read_the_examples_own_blocks():
    nan = float("nan")
    # DPO, 3 pairs: chosen block then rejected block; pair 2's rejected row is NaN.
    policy = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, nan])
    assert bad_rows(policy, torch.zeros(6), 3, blocks=2).tolist() == [False, False, True]
    # KTO, 3 samples then their 3 KL rows: a NaN KL row (another example's completion) is not
    # the example's own fault; a NaN reference sample row is.
    policy = torch.tensor([1.0, 2.0, 3.0, nan, 5.0, 6.0])
    reference = torch.tensor([0.0, nan, 0.0, 0.0, 0.0, 0.0])
    assert bad_rows(policy, reference, 3, blocks=1).tolist() == [False, True, False]


def _file(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" if r else "\n" for r in rows))
    return path


def _dataset(counts, dropped):
    shards = []
    for n, d in zip(counts, dropped):
        stats = DatasetStats("kto")
        for _ in range(d):
            stats.count_drop("too_long")
        shards.append(SimpleNamespace(stats=stats, length=n))
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    return SimpleNamespace(dataset=SimpleNamespace(shards=shards, _starts=starts))


def test_row_sources_name_file_and_line(tmp_path):
    unpaired = {"prompt": "p", "completion": " c", "label": True}
    paired = {"prompt": "q", "chosen": " a", "rejected": " b"}
    a = _file(tmp_path / "a.jsonl", [unpaired, None, unpaired])  # a blank line 2
    b = _file(tmp_path / "b.jsonl", [paired, paired])  # KTO: two examples per line
    c = _file(tmp_path / "c.jsonl", [unpaired, unpaired, unpaired])
    view = _dataset([2, 4, 2], [0, 0, 1])  # c.jsonl lost a row to the length policy
    got = row_sources(view, [a, b, c], "kto", [1, 0, 3, 4, 5, 7])
    assert got == [
        f"{a}:3",
        f"{a}:1",
        f"{b}:1",
        f"{b}:2",
        f"{b}:2",
        f"{c} (example 2 of the kept ones)",
    ]
    assert row_sources(_dataset([2], [0]), [b], "dpo", [1]) == [f"{b}:2"]


def test_describe_caps_the_rows():
    error = NonFiniteStep(7, ["loss", "gradient norm"], [f"f:{i}" for i in range(10)], False)
    assert error.describe(max_rows=3) == (
        "step 7: non-finite loss, gradient norm; rows: f:0, f:1, f:2 and 7 more"
    )
    everything = NonFiniteStep(2, ["loss"], ["f:1", "f:2"], True)
    assert everything.describe().endswith("the step's rows (none alone non-finite): f:1, f:2")


def test_non_finite_validation_is_a_warning_not_a_silent_null(capsys):
    from megatron_kto.algorithms.dpo import DPOTrainer, TrainerState

    trainer = DPOTrainer.__new__(DPOTrainer)  # only its state is read
    trainer.state = TrainerState(step=4)
    trainer._warn_non_finite_validation({"loss": math.nan, "kl": 0.0})
    trainer._warn_non_finite_validation({"loss": 0.5})
    assert capsys.readouterr().out == (
        "warning: validation after step 4: non-finite loss (null in metrics.jsonl)\n"
    )
