"""A full disk ends a training run with one line, on every rank within seconds, and loses
nothing already saved; a rerun with space resumes.

Each run is the bundled tiny example at TP=2 under torchrun (2 ranks), its log directory on a
small tmpfs mounted for the test (the test skips where mounting is not allowed). The disk fills
for real — the kernel's ENOSPC, no error is raised by hand:

* **checkpoint, cannot fit** (the issue's case: a 3 MiB file system, a save every 3 steps):
  step 3's checkpoint fits, step 6's does not. The save measures itself before writing and
  stops: one `error:` line naming `step_6.tmp`, the space needed and free, and `step_3` as the
  checkpoint still good; no `step_6.tmp` is left. Then the tmpfs grows ("space freed") and the
  same command resumes from step 3 and finishes.
* **checkpoint, disk fills during the save**: another writer (`tests/fill_disk.py`'s
  `sitecustomize`, on rank 1 just before megatron-core writes step 6's tensors) takes all but
  64 KiB: the tensor writes fail inside megatron-core's writers; same line, `.tmp` removed.
* **metrics.jsonl**: the disk fills before step 11's metrics (rank 0 writes them alone; the other
  rank must not wait for it in a collective): one line naming metrics.jsonl and `step_10`.
* **tokenisation cache**: the data directory's file system has 4 KiB free: one line naming the
  cache entry, its size and the way out (`model.data.use_cache=false`).

Checked for each: exit code 2 (torchrun's report), exactly that line on rank 0's stderr and
nothing on rank 1's, no traceback anywhere, the time from the fault to the exit, and that the
last good checkpoint is complete (its manifest's sizes and checksums) and unchanged.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
from e2e_cli import (
    KTO_SCRIPT,
    QUIET,
    TINY_EXAMPLE,
    TRAIN_DATA,
    VALIDATION_DATA,
    launch,
    read_metrics,
)
from fill_disk import fill, inject_env, resize, small_tmpfs

from megatron_kto.checkpointing import files
from megatron_kto.checkpointing.disk_space import directory_bytes
from megatron_kto.runtime.disk import free_bytes, size

pytestmark = pytest.mark.e2e

#: Seconds from the fault to the last rank's exit (a hang is the collective timeout: minutes).
BOUND_S = 30.0
KEPT = "is untouched and a rerun resumes from it; free space and rerun the same command"


def _args(run: Path, *extra: str) -> list[str]:
    return [
        str(KTO_SCRIPT),
        *QUIET,
        TINY_EXAMPLE,
        f"exp_manager.explicit_log_dir={run}",
        "model.tensor_model_parallel_size=2",
        *extra,
    ]


def _launch(args: list[str], logs: Path, env: dict[str, str] | None = None):
    with pytest.MonkeyPatch.context() as patch:
        for key, value in (env or {}).items():
            patch.setenv(key, value)
        proc, ranks = launch(args, 2, timeout=240, logs=logs)
    return proc, ranks, time.time()


def _one_error_line(proc, ranks) -> str:
    """Rank 0's only stderr line (rank 1 says nothing), after checking the exit code."""
    assert len(ranks) == 2
    (out0, err0), (out1, err1) = ranks
    assert "exitcode  : 2" in proc.stderr, proc.stderr[-2000:]
    assert not err1.strip(), err1[-3000:]
    assert all("Traceback" not in out + err for out, err in ranks), err0[-3000:]
    lines = err0.strip().splitlines()
    assert len(lines) == 1, err0[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def cannot_fit(tmp_path_factory):
    root = tmp_path_factory.mktemp("disk_cannot_fit")
    with small_tmpfs(root / "mnt", "3m") as mnt:
        run = mnt / "run"
        args = _args(run, "trainer.kto.max_steps=9", "trainer.kto.save_interval=3")
        first = _launch(args, root / "logs1")
        kept = run / "checkpoints" / "step_3"
        facts = {
            "free": free_bytes(mnt),
            "kept_bytes": directory_bytes(kept),
            "saved_at": (kept / files.MANIFEST).stat().st_mtime,
            "tmp_left": (run / "checkpoints" / "step_6.tmp").exists(),
            "latest": (run / "checkpoints" / files.LATEST).read_text().strip(),
            "problem": files.check_complete(kept),
        }
        resize(mnt, "8m")
        second = _launch(args, root / "logs2")
        facts["metrics"] = read_metrics(run)
        facts["final"] = files.check_complete(run / "checkpoints" / "step_9")
        yield run, first, second, facts


def test_a_checkpoint_that_cannot_fit_stops_before_writing(cannot_fit):
    run, (proc, ranks, ended), _, facts = cannot_fit
    line = _one_error_line(proc, ranks)
    ckpts = run / "checkpoints"
    assert line == (
        f"error: {ckpts / 'step_6.tmp'}: no space left on device writing the checkpoint of step "
        f"6 (needs ~{size(facts['kept_bytes'])}, {size(facts['free'])} free); the last good "
        f"checkpoint, {ckpts / 'step_3'}, {KEPT}"
    )
    assert facts["latest"] == "step_3" and facts["problem"] is None
    assert not facts["tmp_left"]
    took = ended - facts["saved_at"]  # steps 4-6 included
    print(f"\nexited {took:.1f} s after step 3's checkpoint (3 steps and the check included)")
    assert took < BOUND_S


def test_the_rerun_with_space_resumes_from_the_good_checkpoint(cannot_fit):
    run, _, (proc, ranks, _), facts = cannot_fit
    assert "exitcode" not in proc.stderr, proc.stderr[-3000:]
    out0 = ranks[0][0]
    assert f"resumed from {run / 'checkpoints' / 'step_3'} (step 3)" in out0
    assert [r["step"] for r in facts["metrics"]] == list(range(1, 10))
    assert facts["final"] is None  # (step_3 itself is pruned now: save_top_k=2)


@pytest.fixture(scope="module")
def fills_during_save(tmp_path_factory):
    root = tmp_path_factory.mktemp("disk_fills_during_save")
    with small_tmpfs(root / "mnt", "8m") as mnt:
        run = mnt / "run"
        env = inject_env(root / "inject", "save:1:step_6.tmp", mnt, leave=64 * 1024)
        args = _args(run, "trainer.kto.max_steps=9", "trainer.kto.save_interval=3")
        proc, ranks, ended = _launch(args, root / "logs", env)
        kept = run / "checkpoints" / "step_3"
        yield (
            run,
            proc,
            ranks,
            ended,
            {
                "free": free_bytes(mnt),
                "kept_bytes": directory_bytes(kept),
                "problem": files.check_complete(kept),
                "latest": (run / "checkpoints" / files.LATEST).read_text().strip(),
                "tmp_left": (run / "checkpoints" / "step_6.tmp").exists(),
                "filled_at": (mnt / "filler").stat().st_mtime,
            },
        )


def test_a_disk_that_fills_during_the_save_stops_every_rank(fills_during_save):
    run, proc, ranks, ended, facts = fills_during_save
    line = _one_error_line(proc, ranks)
    ckpts = run / "checkpoints"
    assert line == (
        f"error: {ckpts / 'step_6.tmp'}: no space left on device writing the checkpoint of step "
        f"6 (needs ~{size(facts['kept_bytes'])}, {size(facts['free'])} free); the last good "
        f"checkpoint, {ckpts / 'step_3'}, {KEPT}"
    )
    assert facts["latest"] == "step_3" and facts["problem"] is None
    assert not facts["tmp_left"]
    took = ended - facts["filled_at"]
    print(f"\nexited {took:.1f} s after the disk filled during the save")
    assert took < BOUND_S


@pytest.fixture(scope="module")
def metrics_full(tmp_path_factory):
    root = tmp_path_factory.mktemp("disk_metrics")
    with small_tmpfs(root / "mnt", "8m") as mnt:
        run = mnt / "run"
        env = inject_env(root / "inject", "log:11", mnt)
        args = _args(run, "trainer.kto.max_steps=20", "trainer.kto.save_interval=10")
        proc, ranks, ended = _launch(args, root / "logs", env)
        kept = run / "checkpoints" / "step_10"
        yield (
            run,
            proc,
            ranks,
            ended,
            {
                "free": free_bytes(mnt),
                "problem": files.check_complete(kept),
                "latest": (run / "checkpoints" / files.LATEST).read_text().strip(),
                "filled_at": (mnt / "filler").stat().st_mtime,
                "logged": [
                    r["step"]
                    for r in map(_parse, (run / "metrics.jsonl").read_text().splitlines())
                    if r
                ],
            },
        )


def _parse(line: str):
    import json

    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def test_metrics_that_cannot_be_written_stop_every_rank(metrics_full):
    run, proc, ranks, ended, facts = metrics_full
    line = _one_error_line(proc, ranks)
    assert line == (
        f"error: {run / 'metrics.jsonl'}: no space left on device writing the metrics "
        f"({size(facts['free'])} free); the last good checkpoint, "
        f"{run / 'checkpoints' / 'step_10'}, {KEPT}"
    )
    assert facts["latest"] == "step_10" and facts["problem"] is None
    # Every step up to the first line that did not fit; the lines written before it stay.
    assert facts["logged"] == list(range(1, len(facts["logged"]) + 1))
    assert 11 <= len(facts["logged"]) < 20
    took = ended - facts["filled_at"]
    print(f"\nexited {took:.1f} s after the disk filled (a few steps' lines still fitted)")
    assert took < BOUND_S


def test_a_tokenisation_cache_that_cannot_be_written_is_one_line(tmp_path):
    with small_tmpfs(tmp_path / "mnt", "1m") as mnt:
        data = mnt / "data"
        data.mkdir()
        for src in (TRAIN_DATA, VALIDATION_DATA):
            (data / src.name).write_bytes(src.read_bytes())
        fill(mnt, leave=4096)
        started = time.time()
        proc, ranks, ended = _launch(
            _args(
                tmp_path / "run",
                "trainer.kto.max_steps=3",
                f"model.data.data_prefix.train=[{data / TRAIN_DATA.name}]",
                f"model.data.data_prefix.validation=[{data / VALIDATION_DATA.name}]",
            ),
            tmp_path / "logs",
        )
        line = _one_error_line(proc, ranks)
        free = size(free_bytes(mnt))
        left = sorted(os.listdir(data))
        entries = os.listdir(data / f"{TRAIN_DATA.name}.mkto_cache")
    cache = re.escape(f"{data / TRAIN_DATA.name}.mkto_cache/")
    assert re.fullmatch(
        f"error: {cache}[0-9a-f]{{24}}: no space left on device writing the tokenised cache "
        rf"\(needs ~\d+\.\d KiB, {free} free\); nothing was trained or saved yet; free space "
        r"and rerun, or set model.data.use_cache=false \(tokenise in memory\)",
        line,
    ), line
    # The partial entry is gone (only the empty cache directory stays).
    assert left == [TRAIN_DATA.name, f"{TRAIN_DATA.name}.mkto_cache", VALIDATION_DATA.name]
    assert entries == []
    print(f"\nexited {ended - started:.1f} s after the launch (start-up included)")
    assert not (tmp_path / "run" / "checkpoints").exists()
