"""Recognise the supported row formats and normalise them into one example type per row.

Accepted rows (extra keys are ignored, so TRL/HF exports with bookkeeping columns load as is):

* TRL unpaired: ``{"prompt", "completion", "label": true|false}``
* NeMo-Aligner: ``{"prompt", "response", "preference": "chosen"|"rejected"}``
* paired: ``{"prompt", "chosen", "rejected"}`` (one desirable + one undesirable KTO row, or one
  DPO pair)

Each text field is either a string or, for conversational data, a list of
``{"role", "content"}`` messages; within a row all text fields are the same kind. One file uses
one format (and one kind of text): a file mixing them is rejected at the first row that
differs, because a silent mix usually means two datasets were concatenated by mistake.

Empty prompts and empty (or whitespace-only) completions are errors rather than dropped rows:
they are data bugs, and there is nothing to score without a completion.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_kto.data.errors import ROW_FIELD, DataFormatError, RowLocation
from megatron_kto.data.readers import Row, iter_rows

Message = dict[str, Any]
Text = str | list[Message]


class RowFormat(str, enum.Enum):
    """The supported row formats (value = short name used in messages and the CLI)."""

    UNPAIRED = "unpaired"
    NEMO = "nemo"
    PAIRED = "paired"

    @property
    def fields(self) -> tuple[str, str, str]:
        """The fields a row of this format must have."""
        return _FORMAT_FIELDS[self]

    @property
    def title(self) -> str:
        """Human-readable name with its fields, e.g. ``TRL unpaired {prompt, completion, label}``."""
        return f"{_FORMAT_TITLES[self]} {{{', '.join(self.fields)}}}"


_FORMAT_FIELDS = {
    RowFormat.UNPAIRED: ("prompt", "completion", "label"),
    RowFormat.NEMO: ("prompt", "response", "preference"),
    RowFormat.PAIRED: ("prompt", "chosen", "rejected"),
}
_FORMAT_TITLES = {
    RowFormat.UNPAIRED: "TRL unpaired",
    RowFormat.NEMO: "NeMo-Aligner",
    RowFormat.PAIRED: "paired",
}
_FIELD_SETS = {fmt: frozenset(fields) for fmt, fields in _FORMAT_FIELDS.items()}
_PREFERENCES = {"chosen": True, "rejected": False}


@dataclass(frozen=True, eq=False)
class UnpairedExample:
    """One KTO example: a prompt, a completion and whether the completion is desirable.

    Attributes:
        prompt: text, or a list of chat messages.
        completion: text, or a list of chat messages (same kind as ``prompt``).
        label: True for desirable, False for undesirable.
        where: the source row, for error messages.
        source_format: the format of the row it came from.
    """

    prompt: Text
    completion: Text
    label: bool
    where: RowLocation
    source_format: RowFormat


@dataclass(frozen=True, eq=False)
class PairedExample:
    """One preference pair: a prompt with a chosen and a rejected completion.

    Attributes:
        prompt: text, or a list of chat messages.
        chosen: the preferred completion (same kind as ``prompt``).
        rejected: the dispreferred completion (same kind as ``prompt``).
        where: the source row, for error messages.
        chosen_reward: the row's ``chosen_reward`` (NeMo-Aligner's RPO data), None if absent.
        rejected_reward: the row's ``rejected_reward``, None if absent.
    """

    prompt: Text
    chosen: Text
    rejected: Text
    where: RowLocation
    chosen_reward: float | None = None
    rejected_reward: float | None = None

    def unpaired(self) -> tuple[UnpairedExample, UnpairedExample]:
        """The two KTO rows of this pair: (desirable chosen, undesirable rejected)."""
        return (
            UnpairedExample(self.prompt, self.chosen, True, self.where, RowFormat.PAIRED),
            UnpairedExample(self.prompt, self.rejected, False, self.where, RowFormat.PAIRED),
        )


NormalizedRow = UnpairedExample | PairedExample


def is_conversational(text: Text) -> bool:
    """True when ``text`` is a list of chat messages rather than a string."""
    return isinstance(text, list)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    names = {bool: "boolean", str: "string", list: "array", dict: "object"}
    return names.get(type(value), type(value).__name__)


def detect_format(row: Row, where: RowLocation) -> RowFormat:
    """Decide which supported format a row is in from its keys.

    Args:
        row: the raw row.
        where: its location, for errors.

    Returns:
        The format.

    Raises:
        DataFormatError: no format matches, a format matches partly (names the missing field),
            or the row has the fields of two formats.
    """
    keys = row.keys()
    matches = [fmt for fmt, fields in _FIELD_SETS.items() if keys >= fields]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        names = " and ".join(fmt.title for fmt in matches)
        raise where.error(ROW_FIELD, f"ambiguous row: it has the fields of {names}")
    # Name the missing field of the format the row resembles most: the one sharing the most
    # format-specific keys ("prompt" is common to all, so it does not count).
    shared = {fmt: sum(k in row for k in fmt.fields[1:]) for fmt in RowFormat}
    best = max(RowFormat, key=shared.__getitem__)
    if shared[best]:
        missing = next(k for k in best.fields if k not in row)
        raise where.error(missing, f"missing field (the {best.title} format needs it)")
    expected = ", ".join(fmt.title for fmt in RowFormat)
    raise where.error(
        ROW_FIELD, f"unknown row format with keys {sorted(row)}; expected one of: {expected}"
    )


def _parse_messages(value: list[Any], field: str, where: RowLocation) -> list[Message]:
    if not value:
        raise where.error(field, "empty message list")
    messages: list[Message] = []
    for i, message in enumerate(value):
        name = f"{field}[{i}]"
        if not isinstance(message, dict):
            raise where.error(
                name, f"expected a {{role, content}} object, got {_json_type(message)}"
            )
        for key in ("role", "content"):
            if key not in message:
                raise where.error(f"{name}.{key}", "missing field")
            if not isinstance(message[key], str):
                raise where.error(
                    f"{name}.{key}", f"expected a string, got {_json_type(message[key])}"
                )
        if not message["role"]:
            raise where.error(f"{name}.role", "empty string")
        messages.append(dict(message))
    return messages


def _parse_text(row: Row, field: str, where: RowLocation, is_completion: bool) -> Text:
    value = row[field]
    if isinstance(value, str):
        if not value.strip():
            what = "nothing to score" if is_completion else "KTO scores a completion given a prompt"
            raise where.error(field, f"empty string ({what})")
        return value
    if isinstance(value, list):
        messages = _parse_messages(value, field, where)
        if is_completion and not any(m["content"].strip() for m in messages):
            raise where.error(f"{field}[0].content", "empty completion message")
        return messages
    raise where.error(
        field,
        f"expected a string or a list of {{role, content}} messages, got {_json_type(value)}",
    )


def _check_same_kind(prompt: Text, other: Text, field: str, where: RowLocation) -> None:
    if is_conversational(prompt) != is_conversational(other):
        kinds = ("a message list", "a string")
        this, that = (kinds[0], kinds[1]) if is_conversational(other) else (kinds[1], kinds[0])
        raise where.error(
            field,
            f"is {this} but prompt is {that}; give all texts of a row as strings or all as "
            "message lists",
        )


#: NeMo-Aligner's optional per-completion rewards of a paired row (read by its RPO losses).
REWARD_FIELDS = ("chosen_reward", "rejected_reward")


def _parse_reward(row: Row, field: str, where: RowLocation) -> float | None:
    """A paired row's optional reward: a finite number, or None when absent or null."""
    value = row.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        shown = f"{_json_type(value)} {value!r}" if isinstance(value, str) else repr(value)
        raise where.error(field, f"expected a finite number, got {shown}")
    return float(value)


def normalize_row(row: Row, where: RowLocation) -> NormalizedRow:
    """Validate one raw row and convert it to the internal example type.

    Args:
        row: the raw row.
        where: its location, for errors.

    Returns:
        An :class:`UnpairedExample` (TRL unpaired, NeMo-Aligner) or a :class:`PairedExample`.

    Raises:
        DataFormatError: the first problem found, naming the field.
    """
    fmt = detect_format(row, where)
    prompt = _parse_text(row, "prompt", where, is_completion=False)
    if fmt is RowFormat.PAIRED:
        chosen = _parse_text(row, "chosen", where, is_completion=True)
        rejected = _parse_text(row, "rejected", where, is_completion=True)
        _check_same_kind(prompt, chosen, "chosen", where)
        _check_same_kind(prompt, rejected, "rejected", where)
        rewards = (_parse_reward(row, f, where) for f in REWARD_FIELDS)
        return PairedExample(prompt, chosen, rejected, where, *rewards)
    text_field = "completion" if fmt is RowFormat.UNPAIRED else "response"
    completion = _parse_text(row, text_field, where, is_completion=True)
    _check_same_kind(prompt, completion, text_field, where)
    if fmt is RowFormat.UNPAIRED:
        label = row["label"]
        if not isinstance(label, bool):
            shown = (
                f"{_json_type(label)} {label!r}" if isinstance(label, str) else _json_type(label)
            )
            raise where.error("label", f"expected true or false, got {shown}")
    else:
        preference = row["preference"]
        if not isinstance(preference, str) or preference not in _PREFERENCES:
            raise where.error(
                "preference", f"unknown value {preference!r}; expected 'chosen' or 'rejected'"
            )
        label = _PREFERENCES[preference]
    return UnpairedExample(prompt, completion, label, where, fmt)


def _describe_kind(kind: tuple[RowFormat, bool]) -> str:
    fmt, conversational = kind
    return f"{'conversational' if conversational else 'plain-text'} {fmt.title}"


def iter_normalized(path: str | Path) -> Iterator[NormalizedRow]:
    """Stream the normalised rows of one file, rejecting a mix of formats.

    Args:
        path: a data file or ``datasets`` directory.

    Returns:
        An iterator with one normalised row per raw row.

    Raises:
        DataFormatError: bad bytes, a bad row, or a row whose format (or text kind) differs
            from the file's first row.
    """
    first: tuple[tuple[RowFormat, bool], int] | None = None
    for line, row in iter_rows(path):
        where = RowLocation(path, line)
        example = normalize_row(row, where)
        fmt = example.source_format if isinstance(example, UnpairedExample) else RowFormat.PAIRED
        kind = (fmt, is_conversational(example.prompt))
        if first is None:
            first = (kind, line)
        elif kind != first[0]:
            raise where.error(
                ROW_FIELD,
                f"mixed formats in one file: this row is {_describe_kind(kind)} but the first "
                f"row ({first[1]}) is {_describe_kind(first[0])}; convert the file to one format",
            )
        yield example


def iter_kto_examples(path: str | Path) -> Iterator[UnpairedExample]:
    """Stream KTO examples; a paired row becomes (desirable chosen, undesirable rejected).

    Args:
        path: a data file or ``datasets`` directory in any supported format.

    Returns:
        An iterator of unpaired examples.
    """
    for example in iter_normalized(path):
        if isinstance(example, PairedExample):
            yield from example.unpaired()
        else:
            yield example


def iter_dpo_examples(path: str | Path) -> Iterator[PairedExample]:
    """Stream DPO pairs; only the paired format has them.

    Args:
        path: a data file or ``datasets`` directory in the paired format.

    Returns:
        An iterator of pairs.

    Raises:
        DataFormatError: the file is in an unpaired format.
    """
    for example in iter_normalized(path):
        if not isinstance(example, PairedExample):
            raise DataFormatError(
                path,
                example.where.line,
                ROW_FIELD,
                f"DPO needs {RowFormat.PAIRED.title} rows, but this file is "
                f"{example.source_format.title}; train it with KTO instead",
            )
        yield example
