"""On-disk layout of training checkpoints — pure file-system code, no torch.distributed.

::

    <root>/latest              "step_<N>" — the commit point, replaced atomically (os.replace)
    <root>/step_<N>/           a complete checkpoint (renamed from step_<N>.tmp when complete)
        metadata.json .metadata common.pt __*_*.distcp   megatron dist_checkpointing (torch_dist)
        checkpoint.json        format, step, parallel layout, optimizer kind
        trainer_state.json     step, epoch, consumed_samples, ... (whatever the trainer passed)
        scheduler.json         OptimizerParamScheduler.state_dict()
        config.yaml            the run's resolved config
        architecture.json      GPTArchitecture (what `restore_from_path` rebuilds the model from)
        rng/rank_<r>.pt        per-rank RNG states (tensors only: loaded with weights_only=True)
        manifest.json          size and CRC32 of every other file; written last
    <root>/step_<N>.tmp/       a save in progress, or one killed part-way (deleted at start-up)

A directory is *usable* when its manifest parses and every file it lists is present with the
recorded size (and CRC32, which is recorded for everything but the tensor shards — checksumming
those would mean reading the whole checkpoint back after every save).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import zlib
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

LATEST = "latest"
MANIFEST = "manifest.json"
CHECKPOINT_META = "checkpoint.json"
TRAINER_STATE = "trainer_state.json"
SCHEDULER = "scheduler.json"
CONFIG = "config.yaml"
RNG_DIR = "rng"
TMP_SUFFIX = ".tmp"
OLD_SUFFIX = ".old"
FORMAT = "megatron_kto.training_checkpoint/1"
#: Files every training checkpoint has (besides the manifest itself and the tensor shards).
REQUIRED = (CHECKPOINT_META, TRAINER_STATE, "metadata.json", ".metadata", "common.pt")
#: Tensor shards: size-checked only.
_SHARD_SUFFIX = ".distcp"
_STEP_RE = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    """`step_<N>` — the directory name of the checkpoint taken after `step` optimizer steps."""
    return f"step_{int(step)}"


def parse_step(name: str) -> int | None:
    """The step of a `step_<N>` name, None for anything else (`.tmp` dirs included)."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def _fsync_dir(path: Path) -> None:
    # Makes a rename or a new file's directory entry durable (no-op where unsupported).
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` so that readers see the old or the new content, never a mix."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def write_json(path: Path, data: Any) -> None:
    """Write `data` as JSON atomically (see `atomic_write_text`)."""
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def read_json(path: Path) -> Any:
    """Parse a JSON file, raising ValueError with the path on any problem."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ValueError(f"{path}: missing") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable ({type(e).__name__}: {e})") from e


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            crc = zlib.crc32(block, crc)
    return crc


def write_manifest(ckpt_dir: Path) -> None:
    """Record size (and CRC32 except for tensor shards) of every file under `ckpt_dir`."""
    files: dict[str, dict[str, int | None]] = {}
    for path in sorted(p for p in Path(ckpt_dir).rglob("*") if p.is_file()):
        rel = path.relative_to(ckpt_dir).as_posix()
        if rel == MANIFEST or (path.name.startswith(".") and path.name.endswith(".tmp")):
            continue
        crc = None if path.name.endswith(_SHARD_SUFFIX) else _crc32(path)
        files[rel] = {"size": path.stat().st_size, "crc32": crc}
    write_json(Path(ckpt_dir) / MANIFEST, {"format": FORMAT, "files": files})


def check_complete(ckpt_dir: Path) -> str | None:
    """Why `ckpt_dir` is not a usable training checkpoint, or None when it is.

    Checks the manifest (present, parseable), that every file it lists has its recorded size
    and checksum, that the required files are listed, and that the JSON records parse.
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return "directory does not exist"
    if not (ckpt_dir / MANIFEST).is_file():
        return f"{MANIFEST}: missing (the save did not finish)"
    try:
        manifest = read_json(ckpt_dir / MANIFEST)
        files = manifest["files"]
        if manifest.get("format") != FORMAT or not isinstance(files, dict):
            return f"{MANIFEST}: unknown format {manifest.get('format')!r}"
    except ValueError as e:
        return str(e).replace(str(ckpt_dir / MANIFEST), MANIFEST)
    except (KeyError, TypeError, AttributeError) as e:
        return f"{MANIFEST}: damaged ({type(e).__name__}: {e})"
    missing = [name for name in REQUIRED if name not in files]
    if missing:
        return f"{MANIFEST} lists no {', '.join(missing)}"
    for rel, rec in files.items():
        path = ckpt_dir / rel
        try:
            size = path.stat().st_size
        except OSError:
            return f"{rel}: missing"
        if size != rec.get("size"):
            return f"{rel}: {size} bytes, expected {rec.get('size')} (truncated or overwritten)"
        if rec.get("crc32") is not None and _crc32(path) != rec["crc32"]:
            return f"{rel}: checksum mismatch (file damaged)"
    for name in (CHECKPOINT_META, TRAINER_STATE):
        try:
            read_json(ckpt_dir / name)
        except ValueError as e:
            return str(e).replace(str(ckpt_dir / name), name)
    return None


def list_step_dirs(root: Path) -> list[tuple[int, Path]]:
    """All `step_<N>` directories under `root` (complete or not), newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(parse_step(p.name), p) for p in root.iterdir() if p.is_dir()]
    return sorted(((s, p) for s, p in found if s is not None), reverse=True)


def read_latest(root: Path) -> tuple[str | None, str | None]:
    """(`step_<N>` named by `<root>/latest`, problem) — (None, None) when there is no marker."""
    path = Path(root) / LATEST
    if not path.exists():
        return None, None
    try:
        name = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        return None, f"{path}: unreadable ({e})"
    if parse_step(name) is None:
        return None, f"{path}: does not name a step_<N> directory (content {name[:40]!r})"
    return name, None


def write_latest(root: Path, name: str) -> None:
    """Point `<root>/latest` at `name` atomically."""
    atomic_write_text(Path(root) / LATEST, name + "\n")


def candidates(root: Path) -> tuple[list[Path], list[str]]:
    """Checkpoint directories to try, in order, and warnings about what was passed over.

    The directory `latest` names comes first, then older `step_<N>` directories, newest first.
    Directories newer than `latest` were never committed (a save was killed between its rename
    and the marker update) and are not used. Without a `latest` marker, all `step_<N>` are tried.
    """
    root = Path(root)
    name, problem = read_latest(root)
    warnings = [problem] if problem else []
    dirs = list_step_dirs(root)
    if name is None:
        if dirs and not problem:
            warnings.append(f"{root}: no '{LATEST}' marker; trying step directories newest first")
        return [p for _, p in dirs], warnings
    latest_step = parse_step(name)
    assert latest_step is not None
    ordered = [root / name]
    for step, path in dirs:
        if step < latest_step:
            ordered.append(path)
        elif step > latest_step:
            warnings.append(f"{path}: newer than '{LATEST}' ({name}), never committed; ignored")
    return ordered, warnings


def remove_stale(root: Path) -> list[Path]:
    """Clean up after killed saves; returns the directories deleted.

    `step_<N>.tmp` directories are deleted. A `step_<N>.old` (see `commit`) is moved back when
    the kill fell between its two renames (no `step_<N>`), and deleted otherwise.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    removed = []
    for p in sorted(root.iterdir()):
        for suffix in (TMP_SUFFIX, OLD_SUFFIX):
            base = p.name[: -len(suffix)]
            if not (p.is_dir() and p.name.endswith(suffix) and parse_step(base) is not None):
                continue
            if suffix == OLD_SUFFIX and not (root / base).exists():
                os.rename(p, root / base)
                continue
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def commit(tmp_dir: Path, final_dir: Path) -> None:
    """Rename a finished `step_<N>.tmp` to `step_<N>` and point `latest` at it.

    An existing `step_<N>` (a re-save of the same step) is moved aside first and deleted after
    the marker is written, so `latest` never names a half-written directory.
    """
    root = final_dir.parent
    old = final_dir.with_name(final_dir.name + OLD_SUFFIX)
    if final_dir.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final_dir, old)
    os.rename(tmp_dir, final_dir)
    _fsync_dir(root)
    write_latest(root, final_dir.name)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)


def prune(root: Path, keep_last: int, newest_step: int) -> list[Path]:
    """Keep the `keep_last` newest checkpoints up to `newest_step` (≤ 0 keeps all).

    Directories newer than `newest_step` are left alone (uncommitted leftovers of an earlier
    attempt; they are replaced when training reaches their step again).
    """
    if keep_last <= 0:
        return []
    committed = [(s, p) for s, p in list_step_dirs(root) if s <= newest_step]
    removed = []
    for _, path in committed[keep_last:]:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
