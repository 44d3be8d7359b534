"""Crash safety and damaged checkpoints, end to end with real saves.

1. A process that trains and saves in a loop (keep_last=1) is SIGKILLed in the middle of its
   3rd save — inside dist_checkpointing's write, and between the commit rename and the `latest`
   update. Each time `latest` still names step_2, which is complete, and a new job (2 ranks,
   another layout) cleans up and resumes from exactly step 2.
2. Damaged checkpoints (truncated shard, garbled metadata, missing files, a `latest` naming a
   missing directory, failures only the load itself finds, on one rank only): resume warns with the
   directory's name and falls back to the previous checkpoint; with nothing usable it raises one
   clear `CheckpointError`. `restore_pretrained` accepts every kind of path.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from multirank import run_multirank

from megatron_kto.checkpointing import files

pytestmark = pytest.mark.multirank

TESTS_DIR = Path(__file__).resolve().parent
KILL_POINTS = {
    # kill point -> file whose appearance triggers the SIGKILL (during the 3rd save). A kill
    # after the manifest but before the rename leaves the same state as the first one; it is
    # covered on fake directories in test_checkpoint_files.py.
    "during_dist_save": "step_3.tmp/common.pt",
    "before_latest_update": "step_3",
}


def save_loop(root: str, kill_point: str) -> None:
    """Train and save every step until killed (runs in its own process, world of one).

    For the kill point after the rename, the 3rd save is paused there so the test can kill at
    exactly that point.
    """
    from test_checkpoint_harness import build_run

    from megatron_kto.checkpointing.manager import CheckpointManager

    if kill_point == "before_latest_update":
        write_latest = files.write_latest

        def paused(root: Path, name: str) -> None:
            if name == "step_3":
                time.sleep(600)
            write_latest(root, name)

        files.write_latest = paused
    run = build_run(1, 1, False, seed=1)
    manager = CheckpointManager(root, keep_last=1)
    step = 0
    while True:
        step += 1
        run.step(step)
        state = {"epoch": 0, "consumed_samples": 4 * step}
        manager.save(step, run.chunks, run.optimizer, run.scheduler, state, "", run.arch)


def _kill_mid_save(jobs: list[tuple[Path, str]]) -> None:
    """Start one saver per (root, kill point) at once; SIGKILL each when its trigger appears."""
    running = []
    try:
        for root, point in jobs:
            code = (
                f"import sys; sys.path.insert(0, {str(TESTS_DIR)!r}); "
                f"import test_checkpoint_atomicity as t; t.save_loop({str(root)!r}, {point!r})"
            )
            log = root.parent / f"{root.name}.stderr"
            with open(log, "wb") as err:
                proc = subprocess.Popen(
                    [sys.executable, "-c", code],
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    start_new_session=True,  # own process group: the kill reaches its writers too
                )
            running.append((proc, root / KILL_POINTS[point], log))
        deadline = time.monotonic() + 240
        while running:
            for item in list(running):
                proc, trigger, log = item
                if trigger.exists():
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    running.remove(item)
                    continue
                assert proc.poll() is None, f"saver exited early:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "a saver never reached its kill point"
            time.sleep(0.002)
    finally:
        for proc, _, _ in running:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


DAMAGES = [
    "truncated_shard",
    "garbled_dcp_metadata",
    "missing_metadata_json",
    "missing_manifest",
    "garbled_trainer_state",
    "load_fails_after_validation",
    "rng_file_unreadable_on_rank_1",
    "latest_names_missing_dir",
    "latest_garbled",
]


def _damage(root: Path, kind: str) -> None:
    d = root / "step_3"
    if kind == "truncated_shard":
        shard = sorted(d.glob("*.distcp"))[0]
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size // 2)
    elif kind == "garbled_dcp_metadata":
        data = bytearray((d / ".metadata").read_bytes())
        data[len(data) // 2 : len(data) // 2 + 16] = b"\xff" * 16
        (d / ".metadata").write_bytes(bytes(data))
    elif kind == "missing_metadata_json":
        (d / "metadata.json").unlink()
    elif kind == "missing_manifest":
        (d / files.MANIFEST).unlink()
    elif kind == "garbled_trainer_state":
        (d / files.TRAINER_STATE).write_text('{"step": 3, "epo')
    elif kind == "load_fails_after_validation":
        # Damage that happened before the manifest was written: only the load can find it.
        (d / "common.pt").write_bytes(b"not a torch file")
        files.write_manifest(d)
    elif kind == "rng_file_unreadable_on_rank_1":
        (d / "rng" / "rank_00001.pt").write_bytes(b"garbage")
        files.write_manifest(d)
    elif kind == "latest_names_missing_dir":
        files.write_latest(root, "step_9")
    elif kind == "latest_garbled":
        (root / files.LATEST).write_text("\x00\x01garbage")


def _worker(rank: int, world_size: int, tmp: str, killed_roots: list[str]) -> dict:
    import torch.distributed as dist
    from test_checkpoint_harness import LogCapture, bitwise_equal, build_run, max_abs_diff

    from megatron_kto.checkpointing.errors import CheckpointError
    from megatron_kto.checkpointing.manager import CheckpointManager, restore_pretrained
    from megatron_kto.checkpointing.model_io import save_model
    from megatron_kto.runtime import teardown

    logs = LogCapture()
    log_dir = Path(tmp) / "log"
    root = log_dir / "checkpoints"
    run = build_run(1, 1, False, seed=1)
    manager = CheckpointManager(root, keep_last=0)
    params = {}
    for step in (1, 2, 3):
        run.step(step)
        manager.save(
            step,
            run.chunks,
            run.optimizer,
            run.scheduler,
            {"epoch": 0, "consumed_samples": 4 * step},
            "",
            run.arch,
        )
        params[step] = run.params()
    backup = Path(tmp) / "backup_step_3"
    if rank == 0:
        shutil.copytree(root / "step_3", backup)
    logs.take()
    out: dict = {}

    def try_load(fn) -> dict:
        try:
            state = fn()
            result = {"step": state["step"]}
            result["exact"] = bitwise_equal(run.params(), params[state["step"]])
        except CheckpointError as e:
            result = {"error": str(e)}
        result["warnings"] = logs.take()
        return result

    def resume_latest() -> dict:
        return CheckpointManager(root).load_latest(run.chunks, run.optimizer, run.scheduler)

    for kind in DAMAGES:
        if rank == 0:
            _damage(root, kind)
        dist.barrier()
        out[kind] = try_load(resume_latest)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root / "step_3")
            shutil.copytree(backup, root / "step_3")
            files.write_latest(root, "step_3")
        dist.barrier()

    # A named step directory is used as is: no fallback.
    if rank == 0:
        _damage(root, "truncated_shard")
    dist.barrier()
    out["explicit_damaged"] = try_load(
        lambda: CheckpointManager(root).load(
            root / "step_3", run.chunks, run.optimizer, run.scheduler
        )
    )
    out["pretrained_skips_damaged"] = {}
    fresh = build_run(1, 1, False, seed=5)
    restore_pretrained(log_dir, fresh.chunks)  # a log dir: uses its checkpoints/ root
    out["pretrained_skips_damaged"]["log_dir"] = max_abs_diff(fresh.params(), params[2])
    out["pretrained_skips_damaged"]["warnings"] = logs.take()
    dist.barrier()

    # Nothing usable: one clear error.
    if rank == 0:
        for step in (1, 2, 3):
            (root / f"step_{step}" / files.MANIFEST).unlink(missing_ok=True)
    dist.barrier()
    out["none_usable"] = try_load(resume_latest)

    # restore_pretrained from a step dir and from a conversion-tool (model_io) checkpoint.
    model_io_dir = Path(tmp) / "model_io"
    model_io_dir.mkdir(exist_ok=True)
    save_model(model_io_dir, run.chunks, run.arch)
    expected = run.params()
    fresh = build_run(1, 1, False, seed=6)
    arch = restore_pretrained(model_io_dir, fresh.chunks)
    out["pretrained_model_io"] = (max_abs_diff(fresh.params(), expected), arch == run.arch)

    # The roots of the SIGKILLed savers (trained at DP=1; resumed here at DP=2).
    out["killed"] = {}
    for killed in killed_roots:
        killed_run = build_run(1, 1, False, seed=7)
        logs.take()
        state = CheckpointManager(killed).load_latest(
            killed_run.chunks, killed_run.optimizer, killed_run.scheduler
        )
        out["killed"][killed] = {
            "state": state,
            "diff": max_abs_diff(killed_run.params(), params[2]),
            "warnings": logs.take(),
            "left": sorted(p.name for p in Path(killed).iterdir()),
        }
    teardown()
    return out


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> dict[str, dict]:
    """Kill a saver at each kill point; what the directory looked like right after."""
    jobs = [(tmp_path_factory.mktemp(f"killed_{point}"), point) for point in KILL_POINTS]
    _kill_mid_save(jobs)
    out = {}
    for root, point in jobs:
        out[point] = {
            "root": root,
            "latest": files.read_latest(root),
            "complete": {p.name: files.check_complete(p) for _, p in files.list_step_dirs(root)},
            "entries": sorted(p.name for p in root.iterdir()),
        }
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory, killed) -> dict:
    roots = [str(k["root"]) for k in killed.values()]
    return run_multirank(_worker, 2, str(tmp_path_factory.mktemp("damage")), roots, timeout=400)


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_sigkill_mid_save_leaves_latest_on_a_complete_checkpoint(killed, point) -> None:
    k = killed[point]
    assert k["latest"] == ("step_2", None)
    assert k["complete"]["step_2"] is None
    assert "step_1" not in k["entries"], "keep_last=1 should have removed step_1"
    if point == "before_latest_update":
        assert "step_3" in k["entries"]  # renamed but never committed
    else:
        assert "step_3.tmp" in k["entries"] and "step_3" not in k["entries"]


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_resume_after_sigkill(killed, results, point) -> None:
    root = str(killed[point]["root"])
    for rank, rank_result in enumerate(results):
        r = rank_result["killed"][root]
        assert r["state"]["step"] == 2 and r["state"]["consumed_samples"] == 8
        assert r["diff"] <= 1e-6, r["diff"]
        assert "step_3.tmp" not in r["left"], "stale .tmp directory was not removed"
        if rank == 0:
            expected = (
                ("step_3", "never committed")
                if point == "before_latest_update"
                else ("step_3.tmp", "interrupted save")
            )
            assert any(all(e in w for e in expected) for w in r["warnings"]), r["warnings"]


@pytest.mark.parametrize("kind", DAMAGES)
def test_damaged_checkpoint_falls_back_with_warning(results, kind) -> None:
    expected_step = 3 if kind.startswith("latest_") else 2
    for rank, rank_result in enumerate(results):
        r = rank_result[kind]
        assert "error" not in r, r
        assert r["step"] == expected_step and r["exact"]
        if rank == 0:
            named = {"latest_names_missing_dir": "step_9", "latest_garbled": "latest"}
            assert any(named.get(kind, "step_3") in w for w in r["warnings"]), r["warnings"]
        if rank == 1 and kind == "rng_file_unreadable_on_rank_1":
            assert any("rank 1 cannot load" in w and "step_3" in w for w in r["warnings"]), r


def test_explicit_damaged_directory_is_an_error(results) -> None:
    r = results[0]["explicit_damaged"]
    assert "step_3" in r["error"] and "truncated" in r["error"] and "\n" not in r["error"]


def test_restore_pretrained_skips_damaged(results) -> None:
    r = results[0]["pretrained_skips_damaged"]
    assert r["log_dir"] == 0.0
    assert any("step_3" in w for w in r["warnings"])


def test_no_usable_checkpoint_is_one_clear_error(results) -> None:
    for rank_result in results:
        message = rank_result["none_usable"]["error"]
        assert "no usable checkpoint" in message and "\n" not in message
        assert all(f"step_{s}" in message for s in (1, 2, 3)), message


def test_restore_pretrained_from_model_io_checkpoint(results) -> None:
    diff, same_arch = results[0]["pretrained_model_io"]
    assert diff == 0.0 and same_arch
