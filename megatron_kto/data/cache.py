"""On-disk cache of tokenised shards, so tokenisation runs once per (data, tokenizer, limits).

Layout: ``<cache root>/<key>/`` with ``tokens.npy`` (int32), ``offsets.npy`` (int64),
``labels.npy`` (uint8, KTO only), ``prompt_keys.npy`` (int64, KTO only), ``rewards.npy``
(float64, DPO only) and ``meta.json``. The cache root is
``<data file>.mkto_cache/`` beside the data, or ``<cache_dir>/<file name>.mkto_cache/``.
Arrays are plain ``.npy`` files (never pickle) and are memory-mapped on load, so start-up from
the cache costs a content hash and a few ``open`` calls, whatever the dataset size.

The key hashes the file's *content* (every byte, so an edit that keeps size and mtime still
invalidates), the tokenizer fingerprint (model file + special tokens + chat template), the
dataset kind, the length policy and :data:`CACHE_VERSION` (bumped whenever tokenisation rules
change).

Atomicity: a shard is written into a temporary sibling directory and renamed into place, so a
crash (or a bad row found half-way through the file) never leaves a partial entry; entries are
only ever read from their final name. Temporary ``.tmp-*`` directories of a killed writer are
ignored.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from megatron_kto.data.length_policy import LengthPolicy
from megatron_kto.data.shards import TokenizedShard
from megatron_kto.data.stats import DatasetStats

#: 2: TRL's tokenisation rule (whole text, completion after the common prefix) and per-example
#: prompt keys for KL pairing. 3: DPO entries keep the rows' rewards (NeMo-Aligner's RPO).
CACHE_VERSION = 3
CACHE_SUFFIX = ".mkto_cache"
_HASH_CHUNK = 1 << 22


def content_hash(path: str | Path) -> str:
    """BLAKE2b digest of a file's bytes, or of every file (name + bytes) under a directory.

    Args:
        path: a file or a directory.

    Returns:
        Hex digest.
    """
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    h = hashlib.blake2b(digest_size=32)
    for file in files:
        if path.is_dir():
            h.update(str(file.relative_to(path)).encode("utf-8") + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def cache_key(
    data_hash: str, tokenizer_fingerprint: str, policy: LengthPolicy, kind: str
) -> dict[str, Any]:
    """Everything the cached tokens depend on, as a JSON-ready dict.

    Args:
        data_hash: :func:`content_hash` of the data file.
        tokenizer_fingerprint: ``Tokenizer.fingerprint``.
        policy: the length policy.
        kind: ``"kto"`` or ``"dpo"``.

    Returns:
        The key material; :func:`key_digest` turns it into a directory name.
    """
    return {
        "version": CACHE_VERSION,
        "data": data_hash,
        "tokenizer": tokenizer_fingerprint,
        "kind": kind,
        "policy": asdict(policy),
    }


def key_digest(key: dict[str, Any]) -> str:
    """Short stable name for a key (first 24 hex digits of its SHA-256)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()[:24]


def cache_root(data_path: str | Path, cache_dir: str | Path | None) -> Path:
    """Directory holding the cache entries of one data file.

    Args:
        data_path: the data file.
        cache_dir: a directory for all caches, or None to cache beside the data.

    Returns:
        ``<data_path>.mkto_cache`` or ``<cache_dir>/<name>.mkto_cache``.
    """
    data_path = Path(data_path)
    parent = Path(cache_dir) if cache_dir is not None else data_path.parent
    return parent / (data_path.name + CACHE_SUFFIX)


def load_shard(entry: Path, key: dict[str, Any]) -> TokenizedShard | None:
    """Memory-map a cache entry.

    Args:
        entry: the entry directory.
        key: the expected key material (must match the stored one).

    Returns:
        The shard, or None when the entry is absent, from another key, or unreadable.
    """
    meta_file = entry / "meta.json"
    if not meta_file.is_file():
        return None
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
        if meta.get("key") != key:
            return None
        tokens = np.load(entry / "tokens.npy", mmap_mode="r", allow_pickle=False)
        offsets = np.load(entry / "offsets.npy", mmap_mode="r", allow_pickle=False)
        labels = prompt_keys = rewards = None
        if key["kind"] == "dpo":
            rewards = np.load(entry / "rewards.npy", mmap_mode="r", allow_pickle=False)
        if key["kind"] == "kto":
            labels = np.load(entry / "labels.npy", mmap_mode="r", allow_pickle=False)
            prompt_keys = np.load(entry / "prompt_keys.npy", mmap_mode="r", allow_pickle=False)
        stats = DatasetStats.from_dict(meta["stats"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if offsets.shape[0] != meta.get("num_examples") or tokens.shape[0] != meta.get("num_tokens"):
        return None
    for per_example in (prompt_keys, rewards):
        if per_example is not None and per_example.shape[0] != offsets.shape[0]:
            return None
    return TokenizedShard(
        tokens=tokens,
        offsets=offsets,
        labels=labels,
        stats=stats,
        prompt_keys=prompt_keys,
        rewards=rewards,
    )


def save_shard(shard: TokenizedShard, entry: Path, key: dict[str, Any]) -> None:
    """Write a shard to ``entry`` atomically (temporary directory + rename).

    Args:
        shard: the shard.
        entry: the final entry directory.
        key: its key material (stored in ``meta.json`` and checked on load).

    If another writer created ``entry`` first, that entry is kept and this one discarded.
    """
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.parent / f".tmp-{entry.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        np.save(tmp / "tokens.npy", np.ascontiguousarray(shard.tokens, dtype=np.int32))
        np.save(tmp / "offsets.npy", np.ascontiguousarray(shard.offsets, dtype=np.int64))
        if shard.labels is not None:
            np.save(tmp / "labels.npy", np.ascontiguousarray(shard.labels, dtype=np.uint8))
        if shard.prompt_keys is not None:
            np.save(tmp / "prompt_keys.npy", np.ascontiguousarray(shard.prompt_keys, np.int64))
        if shard.rewards is not None:
            np.save(tmp / "rewards.npy", np.ascontiguousarray(shard.rewards, np.float64))
        meta = {
            "key": key,
            "num_examples": int(shard.offsets.shape[0]),
            "num_tokens": int(shard.tokens.shape[0]),
            "stats": shard.stats.to_dict(),
        }
        # meta.json last: an entry without it is never treated as valid.
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
        try:
            os.rename(tmp, entry)
        except OSError:
            if not (entry / "meta.json").is_file():
                raise
            # Another writer won the race with identical content; keep theirs.
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
