"""Tokenise one data file into a compact shard: a flat token buffer plus segment offsets.

A shard stores example ``i`` as consecutive segments of one int32 buffer:

    KTO: tokens[offsets[i,0]:offsets[i,1]] = prompt, tokens[offsets[i,1]:offsets[i,2]] = completion
    DPO: prompt, chosen, rejected between offsets[i,0..3]

plus, for DPO, ``rewards[i]`` (the row's ``chosen_reward`` and ``rejected_reward``, NaN where
absent; NeMo-Aligner's RPO losses read them), for KTO, ``labels[i]`` (1 desirable, 0 undesirable) and ``prompt_keys[i]`` (a hash of
the prompt text: rows with equal keys answer the same prompt, which KL pairing must know). The file is read as a stream and
tokenised in chunks (so the tokenizer's batch encoder is used) straight into ``array`` buffers:
memory grows with the number of tokens, not with Python objects per row. The same layout is
what the cache stores on disk and memory-maps on load.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_kto.data.encoding import (
    RenderedExample,
    completion_fields,
    encode_rendered,
    render_example,
)
from megatron_kto.data.formats import (
    PairedExample,
    UnpairedExample,
    iter_dpo_examples,
    iter_normalized,
)
from megatron_kto.data.length_policy import LengthPolicy, plan_lengths, truncate_prompt
from megatron_kto.data.stats import DatasetStats
from megatron_kto.data.tokenizers import Tokenizer

KINDS = ("kto", "dpo")
_CHUNK_EXAMPLES = 512


@dataclass(frozen=True)
class TokenizedShard:
    """The kept examples of one file, tokenised.

    Attributes:
        tokens: int32 [N] all segments of all examples back to back.
        offsets: int64 [n, S+1] segment boundaries per example (S = 2 for KTO, 3 for DPO).
        labels: uint8 [n] KTO labels (1 desirable), or None for DPO.
        stats: what tokenising this file did.
        prompt_keys: int64 [n] prompt identities (``encoding.prompt_key``), or None for DPO.
        raw_lengths: int64 [m, S] token lengths of *every* example before the length policy
            (dropped ones included), only when requested; used by the ``stats`` tool.
        rewards: float64 [n, 2] DPO: each pair's chosen and rejected reward from the data,
            NaN where the row has none; None for KTO.
    """

    tokens: np.ndarray
    offsets: np.ndarray
    labels: np.ndarray | None
    stats: DatasetStats
    prompt_keys: np.ndarray | None = None
    raw_lengths: np.ndarray | None = None
    rewards: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.offsets.shape[0])

    def segments(self, index: int) -> list[list[int]]:
        """The token id lists of example ``index`` (prompt, then completion(s))."""
        bounds = self.offsets[index]
        return [self.tokens[bounds[j] : bounds[j + 1]].tolist() for j in range(len(bounds) - 1)]


def _iter_items(
    path: Path, kind: str, stats: DatasetStats
) -> Iterator[UnpairedExample | PairedExample]:
    rows = iter_dpo_examples(path) if kind == "dpo" else iter_normalized(path)
    for row in rows:
        stats.rows_read += 1
        if kind == "kto" and isinstance(row, PairedExample):
            yield from row.unpaired()
        else:
            yield row


class _ShardWriter:
    """Accumulates encoded examples into flat buffers, applying the length policy."""

    def __init__(
        self,
        kind: str,
        tokenizer: Tokenizer,
        policy: LengthPolicy,
        stats: DatasetStats,
        record_lengths: bool,
    ) -> None:
        self.kind = kind
        self.tokenizer = tokenizer
        self.policy = policy
        self.stats = stats
        self.tokens = array("i")
        self.offsets = array("q")
        self.labels = array("B")
        self.prompt_keys = array("q")
        self.rewards = array("d")
        self.raw = array("q") if record_lengths else None

    def add_chunk(
        self, items: list[UnpairedExample | PairedExample], rendered: list[RenderedExample]
    ) -> None:
        for item, encoded in zip(items, encode_rendered(self.tokenizer, rendered)):
            prompt, completions = encoded.prompt_ids, encoded.completion_ids
            for ids, field in zip(completions, completion_fields(item)):
                if not ids:
                    raise item.where.error(
                        field,
                        "the completion has no tokens of its own after tokenisation (the "
                        "tokenised prompt + completion adds nothing to the tokenised prompt)",
                    )
            if self.raw is not None:
                self.raw.extend([len(prompt), *(len(c) for c in completions)])
            plan = plan_lengths(self.policy, len(prompt), [len(c) for c in completions])
            if plan.drop_reason is not None:
                self.stats.count_drop(plan.drop_reason)
                continue
            self.stats.prompts_truncated += plan.prompt_truncated
            self.stats.completions_truncated += plan.completion_truncated
            self.stats.prompts_merged += encoded.merged
            prompt = truncate_prompt(
                prompt, plan.prompt_length, self.policy.truncation_mode, self.tokenizer.bos_id
            )
            start = len(self.tokens)
            self.offsets.append(start)
            self.tokens.extend(prompt)
            self.offsets.append(len(self.tokens))
            for ids, keep in zip(completions, plan.completion_lengths):
                self.tokens.extend(ids[:keep])
                self.offsets.append(len(self.tokens))
            self.stats.examples += 1
            if isinstance(item, PairedExample):
                for reward in (item.chosen_reward, item.rejected_reward):
                    self.rewards.append(math.nan if reward is None else reward)
            if isinstance(item, UnpairedExample):
                self.labels.append(int(item.label))
                self.prompt_keys.append(encoded.prompt_key)
                if item.label:
                    self.stats.desirable += 1
                else:
                    self.stats.undesirable += 1

    def finish(self) -> TokenizedShard:
        segments = 3 if self.kind == "kto" else 4
        offsets = np.frombuffer(self.offsets, dtype=np.int64).reshape(-1, segments)
        raw = None
        if self.raw is not None:
            raw = np.frombuffer(self.raw, dtype=np.int64).reshape(-1, segments - 1)
        return TokenizedShard(
            tokens=np.frombuffer(self.tokens, dtype=np.int32),
            offsets=offsets,
            labels=np.frombuffer(self.labels, dtype=np.uint8) if self.kind == "kto" else None,
            stats=self.stats,
            prompt_keys=np.frombuffer(self.prompt_keys, dtype=np.int64)
            if self.kind == "kto"
            else None,
            raw_lengths=raw,
            rewards=np.frombuffer(self.rewards, dtype=np.float64).reshape(-1, 2)
            if self.kind == "dpo"
            else None,
        )


def tokenize_file(
    path: str | Path,
    tokenizer: Tokenizer,
    policy: LengthPolicy,
    kind: str = "kto",
    record_lengths: bool = False,
) -> TokenizedShard:
    """Read, validate, tokenise and length-filter one data file.

    Args:
        path: a data file or ``datasets`` directory.
        tokenizer: the tokenizer.
        policy: length limits.
        kind: ``"kto"`` (any format; pairs become two rows) or ``"dpo"`` (paired format only).
        record_lengths: also return every example's untruncated lengths (``raw_lengths``).

    Returns:
        The shard with its statistics.

    Raises:
        DataFormatError: the first bad row (nothing is returned for a bad file).
    """
    if kind not in KINDS:
        raise ValueError(f"kind: {kind!r} is not one of {KINDS}")
    path = Path(path)
    stats = DatasetStats(kind=kind, files=[str(path)])
    writer = _ShardWriter(kind, tokenizer, policy, stats, record_lengths)
    items: list[UnpairedExample | PairedExample] = []
    rendered: list[RenderedExample] = []
    for item in _iter_items(path, kind, stats):
        if isinstance(item, PairedExample):
            completions = (item.chosen, item.rejected)
        else:
            completions = (item.completion,)
        fields = completion_fields(item)
        items.append(item)
        rendered.append(render_example(tokenizer, item.prompt, completions, item.where, fields))
        if len(items) >= _CHUNK_EXAMPLES:
            writer.add_chunk(items, rendered)
            items, rendered = [], []
    writer.add_chunk(items, rendered)
    return writer.finish()
