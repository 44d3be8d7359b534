"""The on-disk protocol (files.py), on fake checkpoint directories — no torch.distributed needed.

Covers the states a crash can leave behind at each point of a save, detection of damaged
directories, the order in which resume tries directories, and retention.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_kto.checkpointing import files


def fake_checkpoint(root: Path, step: int, suffix: str = "") -> Path:
    """A directory with the files of a real checkpoint (tiny contents) and its manifest."""
    d = root / (files.step_dir_name(step) + suffix)
    (d / "rng").mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(b"\0" * 4096)
    (d / ".metadata").write_bytes(b"pickled dcp metadata")
    (d / "common.pt").write_bytes(b"common")
    (d / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (d / "rng" / "rank_00000.pt").write_bytes(b"rng")
    files.write_json(d / files.CHECKPOINT_META, {"format": files.FORMAT, "step": step})
    files.write_json(d / files.TRAINER_STATE, {"step": step, "epoch": 0, "consumed_samples": step})
    files.write_manifest(d)
    return d


def committed(root: Path, *steps: int) -> None:
    for s in steps:
        fake_checkpoint(root, s)
    files.write_latest(root, files.step_dir_name(max(steps)))


def names(paths) -> list[str]:
    return [p.name for p in paths]


def test_complete_checkpoint_passes(tmp_path) -> None:
    assert files.check_complete(fake_checkpoint(tmp_path, 3)) is None


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda d: (d / "__0_0.distcp").write_bytes(b"\0" * 100), "truncated"),
        (lambda d: (d / ".metadata").write_bytes(b"PICKLED DCP METADATA"), "checksum"),
        (lambda d: (d / "metadata.json").unlink(), "metadata.json: missing"),
        (lambda d: (d / "rng" / "rank_00000.pt").unlink(), "rank_00000.pt: missing"),
        (lambda d: (d / files.MANIFEST).unlink(), "manifest.json"),
        (lambda d: (d / files.MANIFEST).write_text('{"files": '), "manifest.json"),
        (lambda d: (d / files.MANIFEST).write_text("[]"), "manifest.json"),
        (lambda d: (d / files.TRAINER_STATE).write_text("{not json"), "trainer_state.json"),
    ],
)
def test_damage_is_detected(tmp_path, damage, expected) -> None:
    d = fake_checkpoint(tmp_path, 3)
    damage(d)
    problem = files.check_complete(d)
    assert problem is not None and expected in problem, problem


def test_json_damaged_before_manifest_is_detected(tmp_path) -> None:
    # Same size and listed checksum would match only if the manifest were written after the damage.
    d = fake_checkpoint(tmp_path, 3)
    (d / files.TRAINER_STATE).write_text("{")
    files.write_manifest(d)
    assert "trainer_state.json" in files.check_complete(d)


def test_manifest_must_list_required_files(tmp_path) -> None:
    d = fake_checkpoint(tmp_path, 3)
    manifest = json.loads((d / files.MANIFEST).read_text())
    del manifest["files"]["common.pt"]
    (d / files.MANIFEST).write_text(json.dumps(manifest))
    assert "common.pt" in files.check_complete(d)


def test_candidates_latest_first_then_older(tmp_path) -> None:
    committed(tmp_path, 1, 2, 3)
    files.write_latest(tmp_path, "step_2")
    fake_checkpoint(tmp_path, 4, files.TMP_SUFFIX)  # a save killed part-way
    found, notes = files.candidates(tmp_path)
    assert names(found) == ["step_2", "step_1"]
    assert len(notes) == 1 and "step_3" in notes[0] and "never committed" in notes[0]


def test_candidates_without_latest_marker(tmp_path) -> None:
    fake_checkpoint(tmp_path, 1)
    fake_checkpoint(tmp_path, 2)
    found, notes = files.candidates(tmp_path)
    assert names(found) == ["step_2", "step_1"]
    assert "no 'latest' marker" in notes[0]


def test_candidates_empty_root(tmp_path) -> None:
    assert files.candidates(tmp_path / "missing") == ([], [])
    assert files.candidates(tmp_path) == ([], [])


@pytest.mark.parametrize("content", ["", "garbage\n", "step_x", "\xff"])
def test_garbled_latest_marker(tmp_path, content) -> None:
    committed(tmp_path, 1, 2)
    (tmp_path / files.LATEST).write_text(content)
    found, notes = files.candidates(tmp_path)
    assert names(found) == ["step_2", "step_1"]
    assert "latest" in notes[0]


def test_latest_naming_missing_directory(tmp_path) -> None:
    committed(tmp_path, 1, 2)
    files.write_latest(tmp_path, "step_7")
    found, _ = files.candidates(tmp_path)
    assert names(found) == ["step_7", "step_2", "step_1"]
    assert files.check_complete(found[0]) == "directory does not exist"


def test_remove_stale(tmp_path) -> None:
    committed(tmp_path, 1)
    fake_checkpoint(tmp_path, 2, files.TMP_SUFFIX)
    # Killed between commit's two renames: step_3 moved aside, the new one not yet in place.
    fake_checkpoint(tmp_path, 3, files.OLD_SUFFIX)
    fake_checkpoint(tmp_path, 3, files.TMP_SUFFIX)
    # Killed after the new one was in place, before the old copy was deleted.
    fake_checkpoint(tmp_path, 1, files.OLD_SUFFIX)
    (tmp_path / "step_notes.tmp").mkdir()  # not ours: left alone
    removed = files.remove_stale(tmp_path)
    assert sorted(names(removed)) == ["step_1.old", "step_2.tmp", "step_3.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "step_1",
        "step_3",
        "step_notes.tmp",
    ]
    assert files.check_complete(tmp_path / "step_3") is None


def test_commit_moves_latest_only_when_complete(tmp_path) -> None:
    committed(tmp_path, 1)
    tmp = fake_checkpoint(tmp_path, 2, files.TMP_SUFFIX)
    assert files.read_latest(tmp_path) == ("step_1", None)
    files.commit(tmp, tmp_path / "step_2")
    assert files.read_latest(tmp_path) == ("step_2", None)
    assert not tmp.exists() and files.check_complete(tmp_path / "step_2") is None


def test_commit_replaces_same_step(tmp_path) -> None:
    committed(tmp_path, 2)
    tmp = fake_checkpoint(tmp_path, 2, files.TMP_SUFFIX)
    (tmp / "marker").write_text("new")
    files.write_manifest(tmp)
    files.commit(tmp, tmp_path / "step_2")
    assert (tmp_path / "step_2" / "marker").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_2"]


def test_atomic_write_leaves_no_temp_files(tmp_path) -> None:
    files.write_latest(tmp_path, "step_5")
    files.write_latest(tmp_path, "step_6")
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]
    assert files.read_latest(tmp_path) == ("step_6", None)


@pytest.mark.parametrize(
    ("keep", "left"), [(2, [5, 4]), (1, [5]), (0, [5, 4, 3, 2]), (-1, [5, 4, 3, 2])]
)
def test_prune(tmp_path, keep, left) -> None:
    committed(tmp_path, 2, 3, 4, 5)
    files.prune(tmp_path, keep, newest_step=5)
    assert [s for s, _ in files.list_step_dirs(tmp_path)] == left


def test_prune_ignores_uncommitted_newer_dirs(tmp_path) -> None:
    committed(tmp_path, 2, 3, 4)
    fake_checkpoint(tmp_path, 9)  # from an earlier attempt, never committed
    files.prune(tmp_path, 2, newest_step=4)
    assert [s for s, _ in files.list_step_dirs(tmp_path)] == [9, 4, 3]


@pytest.mark.parametrize("given", ["root", "latest", "log_dir", "step"])
def test_resolve_reads_the_root_its_latest_marker_or_the_log_dir(tmp_path, given) -> None:
    # README: `convert_checkpoint.py export --ckpt runs/kto/checkpoints/latest` — the marker file
    # is accepted as well as the root, the log directory and a step directory.
    from megatron_kto.checkpointing.locate import resolve_pretrained_dir

    root = tmp_path / "checkpoints"
    committed(root, 1, 2)
    path = {
        "root": root,
        "latest": root / files.LATEST,
        "log_dir": tmp_path,
        "step": root / "step_2",
    }[given]
    assert resolve_pretrained_dir(path, warn=lambda _: None) == root / "step_2"


def test_resolve_through_latest_falls_back_past_a_damaged_newest(tmp_path) -> None:
    from megatron_kto.checkpointing.locate import resolve_pretrained_dir

    committed(tmp_path, 1, 2)
    (tmp_path / "step_2" / "metadata.json").unlink()
    warnings: list[str] = []
    assert resolve_pretrained_dir(tmp_path / files.LATEST, warn=warnings.append) == (
        tmp_path / "step_1"
    )
    assert len(warnings) == 1 and "step_2" in warnings[0]
