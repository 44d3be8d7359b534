"""The logic behind ``tools/preprocess_kto_data.py``: validate, convert and describe data files.

Everything here returns values or report strings; the tool only parses arguments, prints and
picks exit codes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_kto.data.formats import (
    PairedExample,
    RowFormat,
    is_conversational,
    iter_normalized,
)
from megatron_kto.data.length_policy import LengthPolicy
from megatron_kto.data.shards import tokenize_file
from megatron_kto.data.stats import (
    DESIRABLE_WEIGHT_KEY,
    UNDESIRABLE_WEIGHT_KEY,
    DatasetStats,
    imbalance_ratio,
    suggest_loss_weights,
)
from megatron_kto.data.tokenizers import Tokenizer

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class FileReport:
    """What :func:`validate_file` found in a well-formed file.

    Attributes:
        path: the file.
        format: its row format.
        conversational: texts are chat message lists.
        rows: raw rows.
        desirable: KTO rows labelled desirable (a pair gives one of each).
        undesirable: KTO rows labelled undesirable.
    """

    path: str
    format: RowFormat
    conversational: bool
    rows: int
    desirable: int
    undesirable: int

    def summary(self) -> str:
        """One line for the ``validate`` command."""
        kind = "conversational" if self.conversational else "plain-text"
        return (
            f"{self.path}: OK, {self.rows} rows, {kind} {self.format.title}; KTO view: "
            f"{self.desirable} desirable, {self.undesirable} undesirable"
        )


def validate_file(path: str | Path) -> FileReport:
    """Read and check every row of a file (no tokenizer needed).

    Args:
        path: a data file or ``datasets`` directory.

    Returns:
        The report.

    Raises:
        DataFormatError: the first problem.
    """
    rows = desirable = undesirable = 0
    fmt, conversational = RowFormat.UNPAIRED, False
    for example in iter_normalized(path):
        rows += 1
        conversational = is_conversational(example.prompt)
        if isinstance(example, PairedExample):
            fmt = RowFormat.PAIRED
            desirable += 1
            undesirable += 1
        else:
            fmt = example.source_format
            desirable += example.label
            undesirable += not example.label
    return FileReport(str(path), fmt, conversational, rows, desirable, undesirable)


def convert_to_unpaired(src: str | Path, dst: str | Path) -> int:
    """Write a file in any supported format as TRL unpaired JSONL.

    Pairs become a desirable (chosen) and an undesirable (rejected) row; NeMo-Aligner
    ``response``/``preference`` become ``completion``/``label``. Conversational texts stay
    message lists. The output is written to a temporary file and renamed, so a bad input row
    never leaves a partial output.

    Args:
        src: input file.
        dst: output ``.jsonl`` file.

    Returns:
        The number of rows written.

    Raises:
        DataFormatError: a bad input row (``dst`` is then untouched).
    """
    dst = Path(dst)
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    written = 0
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as out:
            for example in iter_normalized(src):
                pieces = example.unpaired() if isinstance(example, PairedExample) else (example,)
                for piece in pieces:
                    row = {
                        "prompt": piece.prompt,
                        "completion": piece.completion,
                        "label": piece.label,
                    }
                    out.write(json.dumps(row, ensure_ascii=False) + "\n")
                    written += 1
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            tmp.unlink()
    return written


@dataclass(frozen=True)
class LengthReport:
    """Token statistics of a file under a length policy.

    Attributes:
        stats: counts after the policy (kept, dropped per reason, truncated).
        prompt: percentiles (p50, p90, p99, max) of untruncated prompt lengths.
        completion: the same for completions.
        total: the same for prompt + completion.
    """

    stats: DatasetStats
    prompt: tuple[int, ...]
    completion: tuple[int, ...]
    total: tuple[int, ...]


def _percentiles(values: np.ndarray) -> tuple[int, ...]:
    if values.size == 0:
        return (0,) * (len(PERCENTILES) + 1)
    # Nearest-rank percentiles: every reported value is a length that occurs in the data.
    points = np.percentile(values, PERCENTILES, method="inverted_cdf")
    return (*(int(p) for p in points), int(values.max()))


def length_report(path: str | Path, tokenizer: Tokenizer, policy: LengthPolicy) -> LengthReport:
    """Tokenise a file (no cache) and describe its lengths under ``policy``.

    Args:
        path: a data file in any format (pairs count as two KTO rows).
        tokenizer: the tokenizer.
        policy: length limits (``max_length=None`` reports lengths only).

    Returns:
        The report.
    """
    shard = tokenize_file(path, tokenizer, policy, kind="kto", record_lengths=True)
    raw = shard.raw_lengths if shard.raw_lengths is not None else np.zeros((0, 2), np.int64)
    return LengthReport(
        stats=shard.stats,
        prompt=_percentiles(raw[:, 0]),
        completion=_percentiles(raw[:, 1]),
        total=_percentiles(raw.sum(axis=1)),
    )


def format_length_report(report: LengthReport, policy: LengthPolicy) -> str:
    """Multi-line text for the ``stats`` command."""
    stats = report.stats
    names = " / ".join([*(f"p{p}" for p in PERCENTILES), "max"])
    lines = [
        f"{', '.join(stats.files)}: {stats.rows_read} rows, {stats.desirable + stats.undesirable} "
        f"KTO examples kept: {stats.desirable} desirable, {stats.undesirable} undesirable",
    ]
    suggestion = suggest_loss_weights(stats.desirable, stats.undesirable)
    if suggestion is None:
        lines.append("loss weights: one-class data, no weighting balances it")
    else:
        ratio = imbalance_ratio(stats.desirable, stats.undesirable)
        lines.append(
            f"loss weights: n_D/n_U = {ratio:.3f}; for (λ_D·n_D)/(λ_U·n_U) in [1, 4/3] use "
            f"{DESIRABLE_WEIGHT_KEY}={suggestion[0]:g} {UNDESIRABLE_WEIGHT_KEY}={suggestion[1]:g}"
        )
    lines.append(f"token lengths before truncation ({names}):")
    for label, values in (("prompt", report.prompt), ("completion", report.completion),
                          ("total", report.total)):  # fmt: skip
        lines.append(f"  {label:<10} " + " / ".join(str(v) for v in values))
    drops = ", ".join(f"{k}={v}" for k, v in sorted(stats.dropped.items())) or "none"
    lines.append(
        f"length policy (max_length={policy.max_length}, max_prompt_length="
        f"{policy.max_prompt_length}, {policy.truncation_mode}): dropped {stats.dropped_total} "
        f"({drops}); truncated {stats.prompts_truncated} prompts, "
        f"{stats.completions_truncated} completions"
    )
    lines.extend(f"WARNING: {w}" for w in stats.warnings)
    return "\n".join(lines)
