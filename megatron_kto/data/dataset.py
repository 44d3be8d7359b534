"""KTO and DPO datasets over tokenised shards, and the functions that build them.

``build_kto_dataset`` / ``build_dpo_dataset`` read every file, tokenise it once (through the
cache, see ``cache.py``) and return the dataset with its :class:`DatasetStats`. In a
multi-rank job exactly one rank per cache location passes ``is_cache_writer=True``; all ranks
pass the same ``barrier`` (e.g. ``torch.distributed.barrier``), which every rank calls exactly
once per build, after the writer finished — whether the writer hit the cache, built it, or
failed (then the others raise instead of hanging).
"""

from __future__ import annotations

import bisect
import logging
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

from megatron_kto.data import cache
from megatron_kto.data.errors import CacheWriteError, CacheWriterFailedError
from megatron_kto.data.length_policy import LengthPolicy
from megatron_kto.data.shards import TokenizedShard, tokenize_file
from megatron_kto.data.stats import DatasetStats, merge_stats, one_class_warning
from megatron_kto.data.tokenizers import Tokenizer
from megatron_kto.runtime.disk import free_bytes, no_space_cause, size

logger = logging.getLogger(__name__)

PathList = str | Path | Sequence[str | Path]


class _ShardedDataset(Dataset):
    """Random access over the examples of several shards, in file order."""

    def __init__(self, shards: Sequence[TokenizedShard]) -> None:
        self.shards = list(shards)
        self._starts = np.cumsum([0] + [len(s) for s in self.shards]).tolist()

    def __len__(self) -> int:
        return self._starts[-1]

    def _locate(self, index: int) -> tuple[TokenizedShard, int]:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for a dataset of {len(self)} examples")
        shard = bisect.bisect_right(self._starts, index) - 1
        return self.shards[shard], index - self._starts[shard]

    def sequence_lengths(self) -> np.ndarray:
        """[n, S] token lengths of each example's segments (prompt, completion(s))."""
        if not self.shards:
            return np.zeros((0, 0), dtype=np.int64)
        return np.concatenate([np.diff(np.asarray(s.offsets), axis=1) for s in self.shards])


class KTODataset(_ShardedDataset):
    """KTO examples: ``{"prompt_ids": list[int], "completion_ids": list[int], "label": bool}``."""

    def __getitem__(self, index: int) -> dict[str, list[int] | bool]:
        shard, local = self._locate(index)
        prompt_ids, completion_ids = shard.segments(local)
        assert shard.labels is not None
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "label": bool(shard.labels[local]),
        }

    @property
    def labels(self) -> np.ndarray:
        """bool [n]: True for desirable examples."""
        if not self.shards:
            return np.zeros(0, dtype=bool)
        return np.concatenate([np.asarray(s.labels, dtype=bool) for s in self.shards])

    @property
    def prompt_keys(self) -> np.ndarray:
        """int64 [n]: prompt identities; equal keys mean the same prompt (for KL pairing)."""
        if not self.shards:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.asarray(s.prompt_keys, dtype=np.int64) for s in self.shards])


class DPODataset(_ShardedDataset):
    """DPO pairs: ``{"prompt_ids", "chosen_ids", "rejected_ids"}`` (lists of ints), plus
    ``chosen_reward`` / ``rejected_reward`` (floats) once ``rewards`` is set (the RPO losses;
    `data.rewards.pair_rewards`)."""

    rewards: np.ndarray | None = None
    """[n, 2] the pairs' (chosen, rejected) rewards, or None: items carry none."""

    def __getitem__(self, index: int) -> dict[str, list[int] | float]:
        shard, local = self._locate(index)
        prompt_ids, chosen_ids, rejected_ids = shard.segments(local)
        item: dict[str, list[int] | float] = {
            "prompt_ids": prompt_ids, "chosen_ids": chosen_ids, "rejected_ids": rejected_ids
        }  # fmt: skip
        if self.rewards is not None:
            i = index + len(self) if index < 0 else index
            item["chosen_reward"], item["rejected_reward"] = map(float, self.rewards[i])
        return item


def _as_paths(paths: PathList) -> list[Path]:
    if isinstance(paths, str | Path):
        return [Path(paths)]
    if not paths:
        raise ValueError("no data files given")
    return [Path(p) for p in paths]


def cache_failure_line(entry: Path, shard: TokenizedShard, error: OSError) -> str:
    """The one line for a tokenised cache that could not be written: the entry, the cause (a
    full disk: the shard's size and the space free) and the ways out. Nothing was trained yet."""
    arrays = (shard.tokens, shard.offsets, shard.labels, shard.prompt_keys)
    needed = sum(a.nbytes for a in arrays if a is not None)
    cause = no_space_cause(error, entry, needed)
    if cause is None:
        return (
            f"{entry}: cannot write the tokenised cache ({error}); make the data directory "
            "writable or set model.data.use_cache=false (tokenise in memory)"
        )
    return (
        f"{entry}: {cause} writing the tokenised cache (needs ~{size(needed)}, "
        f"{size(free_bytes(entry))} free); nothing was trained or saved yet; free space and "
        "rerun, or set model.data.use_cache=false (tokenise in memory)"
    )


def load_shards(
    paths: PathList,
    tokenizer: Tokenizer,
    policy: LengthPolicy,
    kind: str,
    cache_dir: str | Path | None = None,
    is_cache_writer: bool = True,
    barrier: Callable[[], object] | None = None,
    use_cache: bool = True,
) -> list[TokenizedShard]:
    """Tokenised shards of ``paths``, from the cache when possible.

    Args:
        paths: data files.
        tokenizer: the tokenizer.
        policy: length limits.
        kind: ``"kto"`` or ``"dpo"``.
        cache_dir: where caches go (None: beside each data file).
        is_cache_writer: this rank builds missing cache entries; others only read.
        barrier: called once by every rank after the writer is done (None in one process).
        use_cache: False tokenises in memory and touches no disk (``barrier`` is not called).

    Returns:
        One shard per path, in order.

    Raises:
        DataFormatError: bad data (on the writer; the other ranks raise RuntimeError).
    """
    paths = _as_paths(paths)
    if not use_cache:
        return [tokenize_file(p, tokenizer, policy, kind) for p in paths]
    for p in paths:
        if not p.exists():  # every rank fails the same way before anyone waits
            raise FileNotFoundError(f"{p}: data file not found")
    keys = [
        cache.cache_key(cache.content_hash(p), tokenizer.fingerprint, policy, kind) for p in paths
    ]
    entries = [cache.cache_root(p, cache_dir) / cache.key_digest(k) for p, k in zip(paths, keys)]
    failure: Exception | None = None
    if is_cache_writer:
        try:
            for path, key, entry in zip(paths, keys, entries):
                if cache.load_shard(entry, key) is not None:
                    continue
                if entry.exists():  # unreadable leftovers under our key: replace them
                    shutil.rmtree(entry)
                logger.info("tokenising %s into %s", path, entry)
                shard = tokenize_file(path, tokenizer, policy, kind)
                try:
                    cache.save_shard(shard, entry, key)
                except OSError as err:
                    raise CacheWriteError(cache_failure_line(entry, shard, err)) from err
        except Exception as err:  # still reach the barrier so the other ranks do not hang
            failure = err
    if barrier is not None:
        barrier()
    if failure is not None:
        raise failure
    shards = []
    for path, key, entry in zip(paths, keys, entries):
        shard = cache.load_shard(entry, key)
        if shard is None:
            raise CacheWriterFailedError(
                f"{path}: tokenised cache {entry} is missing after the cache-writer rank "
                "finished; that rank failed (see its log) or cannot write there (set cache_dir)"
            )
        # The entry may have been built from an identical copy elsewhere; report this path.
        shard.stats.files = [str(path)]
        shards.append(shard)
    return shards


def _build(
    kind: str,
    paths: PathList,
    tokenizer: Tokenizer,
    max_length: int | None,
    max_prompt_length: int | None,
    truncation_mode: str,
    cache_dir: str | Path | None,
    is_cache_writer: bool,
    barrier: Callable[[], object] | None,
    use_cache: bool,
) -> tuple[list[TokenizedShard], DatasetStats]:
    policy = LengthPolicy(max_length, max_prompt_length, truncation_mode)
    shards = load_shards(
        paths, tokenizer, policy, kind, cache_dir, is_cache_writer, barrier, use_cache
    )
    stats = merge_stats(s.stats for s in shards)
    # Log once per job, not once per rank. The imbalance advice depends on the configured loss
    # weights, which the caller passes to `stats.summary(...)`; a single class does not.
    warning = one_class_warning(stats) if kind == "kto" else None
    if is_cache_writer and warning is not None:
        logger.warning(warning)
    return shards, stats


def build_kto_dataset(
    paths: PathList,
    tokenizer: Tokenizer,
    max_length: int | None,
    max_prompt_length: int | None = None,
    truncation_mode: str = "keep_end",
    cache_dir: str | Path | None = None,
    is_cache_writer: bool = True,
    barrier: Callable[[], object] | None = None,
    use_cache: bool = True,
) -> tuple[KTODataset, DatasetStats]:
    """Build a KTO dataset from files in any supported format.

    Args:
        paths: one data file or several (concatenated in order).
        tokenizer: the tokenizer.
        max_length: most prompt + completion tokens (None: no limit).
        max_prompt_length: most prompt tokens (None: only ``max_length``).
        truncation_mode: ``keep_end`` or ``keep_start`` (see ``length_policy.py``).
        cache_dir: where tokenised caches go (None: beside each data file).
        is_cache_writer: this rank writes missing cache entries.
        barrier: collective barrier called once by every rank (None in one process).
        use_cache: False to tokenise in memory without touching the disk.

    Returns:
        (dataset, statistics). A one-class dataset is allowed; its warning is in
        ``stats.warnings`` and logged by the writer rank. Print ``stats.summary(λ_D, λ_U)``
        at start-up: it adds the class-imbalance advice for the configured loss weights.
    """
    shards, stats = _build(
        "kto", paths, tokenizer, max_length, max_prompt_length, truncation_mode,
        cache_dir, is_cache_writer, barrier, use_cache,
    )  # fmt: skip
    return KTODataset(shards), stats


def build_dpo_dataset(
    paths: PathList,
    tokenizer: Tokenizer,
    max_length: int | None,
    max_prompt_length: int | None = None,
    truncation_mode: str = "keep_end",
    cache_dir: str | Path | None = None,
    is_cache_writer: bool = True,
    barrier: Callable[[], object] | None = None,
    use_cache: bool = True,
) -> tuple[DPODataset, DatasetStats]:
    """Build a DPO dataset from paired files; arguments as for :func:`build_kto_dataset`.

    ``max_length`` bounds prompt + chosen and prompt + rejected separately.

    Returns:
        (dataset, statistics).
    """
    shards, stats = _build(
        "dpo", paths, tokenizer, max_length, max_prompt_length, truncation_mode,
        cache_dir, is_cache_writer, barrier, use_cache,
    )  # fmt: skip
    return DPODataset(shards), stats
