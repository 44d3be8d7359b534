"""metrics.jsonl content, resume truncation, rank gating, TensorBoard and W&B sinks."""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch

from megatron_kto.logging import MetricsLogger
from megatron_kto.logging import metrics_logger as ml


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_records_are_flushed_per_line(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path, rank0=True, tensorboard=False)
    logger.log("train", 1, 8, {"loss": torch.tensor(0.69), "lr": 1e-5, "rewards/chosen": 0.1})
    # Read before close: a crash right now must not lose the line.
    records = _lines(tmp_path / "metrics.jsonl")
    assert records == [
        {
            "split": "train",
            "step": 1,
            "consumed_samples": 8,
            "loss": pytest.approx(0.69),
            "lr": 1e-5,
            "rewards/chosen": 0.1,
        }
    ]
    assert list(records[0])[:3] == ["split", "step", "consumed_samples"]
    logger.log("val", 1, 8, {"loss": float("nan"), "tokens_per_sec": 12})
    logger.close()
    records = _lines(tmp_path / "metrics.jsonl")
    assert records[1] == {
        "split": "val",
        "step": 1,
        "consumed_samples": 8,
        "loss": None,
        "tokens_per_sec": 12,
    }


def test_bad_split_and_reserved_names_rejected(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, rank0=True, tensorboard=False) as logger:
        with pytest.raises(ValueError, match="split"):
            logger.log("test", 1, 1, {})
        with pytest.raises(ValueError, match="reserved"):
            logger.log("train", 1, 1, {"step": 3})


def test_truncate_after_keeps_earlier_steps_and_appends(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path, rank0=True, tensorboard=False)
    for step in range(1, 6):
        logger.log("train", step, step * 4, {"loss": 1.0 / step})
        if step % 2 == 0:
            logger.log("val", step, step * 4, {"loss": 2.0 / step})
    path = tmp_path / "metrics.jsonl"
    with path.open("a") as f:
        f.write('{"split": "train", "step": 2, "loss"')  # a line cut short by a crash
    logger.close()

    # Resume from the checkpoint of step 3: steps 4 and 5 (3 lines) and the partial line go.
    resumed = MetricsLogger(tmp_path, rank0=True, tensorboard=False)
    assert resumed.truncate_after(3) == 4
    assert [(r["split"], r["step"]) for r in _lines(path)] == [
        ("train", 1),
        ("train", 2),
        ("val", 2),
        ("train", 3),
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temp file left
    resumed.log("train", 4, 16, {"loss": 0.3})
    resumed.close()
    assert [(r["split"], r["step"]) for r in _lines(path)][-2:] == [("train", 3), ("train", 4)]


def test_append_after_partial_line_starts_a_new_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"split": "train", "step": 1}\n{"split": "tr')
    with MetricsLogger(tmp_path, rank0=True, tensorboard=False) as logger:
        logger.log("train", 2, 2, {"loss": 0.5})
    assert json.loads(path.read_text().splitlines()[-1])["step"] == 2


def test_truncate_without_file_is_a_noop(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path / "run", rank0=True, tensorboard=False) as logger:
        assert logger.truncate_after(10) == 0


def test_other_ranks_write_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    logger = MetricsLogger(run_dir, rank0=False, tensorboard=True)
    logger.log("train", 1, 1, {"loss": 1.0})
    assert logger.truncate_after(0) == 0
    logger.close()
    assert not run_dir.exists()


def _scalars(tb_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_event_files(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    with MetricsLogger(tmp_path, rank0=True, tensorboard=True) as logger:
        logger.log("train", 1, 4, {"loss": 0.5, "rewards/margins": 0.25})
        logger.log("val", 1, 4, {"loss": 0.75})
    tb_dir = tmp_path / "tensorboard"
    assert list(tb_dir.glob("events.out.tfevents.*"))
    assert _scalars(tb_dir, "train/loss") == [(1, 0.5)]
    assert _scalars(tb_dir, "train/rewards/margins") == [(1, 0.25)]
    assert _scalars(tb_dir, "val/loss") == [(1, 0.75)]


def test_tensorboard_missing_warns_once_and_continues(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import → ImportError
    monkeypatch.setattr(ml, "_tensorboard_warned", False)
    with pytest.warns(UserWarning, match="TensorBoard"):
        logger = MetricsLogger(tmp_path, rank0=True, tensorboard=True)
    logger.log("train", 1, 1, {"loss": 1.0})
    logger.close()
    assert (tmp_path / "metrics.jsonl").exists()
    assert not (tmp_path / "tensorboard").exists()


def test_wandb_enabled_but_missing_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    for rank0 in (True, False):
        with pytest.raises(ImportError, match="pip install wandb"):
            MetricsLogger(tmp_path, rank0=rank0, tensorboard=False, wandb={"project": "p"})


def test_wandb_receives_prefixed_metrics(tmp_path: Path, monkeypatch) -> None:
    calls: list[tuple[str, object]] = []

    class FakeRun:
        def log(self, payload: dict, step: int) -> None:
            calls.append(("log", (payload, step)))

        def finish(self) -> None:
            calls.append(("finish", None))

    def init(**kwargs: object) -> FakeRun:
        calls.append(("init", kwargs))
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    with MetricsLogger(tmp_path, rank0=True, tensorboard=False, wandb={"project": "p"}) as lg:
        lg.log("train", 3, 12, {"loss": 0.5, "bad": math.inf})
    assert calls[0] == ("init", {"dir": str(tmp_path), "project": "p"})
    payload, step = calls[1][1]  # type: ignore[misc]
    assert step == 3
    assert payload == {"train/loss": 0.5, "train/bad": math.inf, "train/consumed_samples": 12}
    assert calls[-1] == ("finish", None)

    calls.clear()
    MetricsLogger(tmp_path, rank0=False, tensorboard=False, wandb={"project": "p"}).close()
    assert calls == []  # only rank 0 starts a run


def test_tensorboard_purges_steps_after_resume(tmp_path: Path) -> None:
    """Steps 1..5 logged, resumed from step 3, step 4 logged again with a new value: TensorBoard
    must show 1, 2, 3 and the new 4, not the stale 4 and 5."""
    pytest.importorskip("tensorboard")
    with MetricsLogger(tmp_path, rank0=True, tensorboard=True) as logger:
        for step in range(1, 6):
            logger.log("train", step, step, {"loss": float(step)})
    with MetricsLogger(tmp_path, rank0=True, tensorboard=True) as logger:
        logger.truncate_after(3)
        logger.log("train", 4, 4, {"loss": 40.0})
    assert _scalars(tmp_path / "tensorboard", "train/loss") == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
    ]
