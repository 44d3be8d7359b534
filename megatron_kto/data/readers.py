"""Read raw rows (plain dicts) from JSONL, JSON, Parquet files and ``datasets`` directories.

Every reader yields ``(position, row)`` pairs, lazily where the format allows it:

* JSONL is streamed line by line (a multi-GB file is never held as Python objects); the
  position is the 1-based line number, blank lines are skipped.
* JSON: a file whose first non-blank character is ``[`` is one list of objects (loaded whole;
  the position is the 1-based list index). Any other ``.json`` file is read as JSONL, because
  many tools write JSON Lines under a ``.json`` name.
* Parquet is read in record batches through ``pyarrow`` (imported only here, only when used).
* A directory written by ``datasets.Dataset.save_to_disk`` is iterated row by row
  (``datasets`` is optional and imported only when such a directory is read).

Problems with the bytes themselves (not UTF-8, malformed JSON, not an object, no rows at all)
are raised as :class:`DataFormatError`; field-level checks live in ``formats.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megatron_kto.data.errors import (
    ENCODING_FIELD,
    FILE_FIELD,
    JSON_FIELD,
    ROW_FIELD,
    DataFormatError,
)

Row = dict[str, Any]

_PARQUET_BATCH_ROWS = 1024
_UTF8_BOM = b"\xef\xbb\xbf"


def _type_name(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean"}.get(
        type(value), type(value).__name__
    )


def _check_object(path: Path, position: int, value: Any) -> Row:
    if not isinstance(value, dict):
        raise DataFormatError(
            path, position, ROW_FIELD, f"expected a JSON object, got {_type_name(value)}"
        )
    return value


def iter_jsonl(path: Path) -> Iterator[tuple[int, Row]]:
    """Stream the objects of a JSON Lines file.

    Args:
        path: the file.

    Returns:
        An iterator of (1-based line number, row); blank lines are skipped.
    """
    # Binary mode so a bad byte is reported at its own line instead of failing the whole file.
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if line_no == 1 and raw.startswith(_UTF8_BOM):
                raw = raw[len(_UTF8_BOM) :]
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataFormatError(
                    path,
                    line_no,
                    ENCODING_FIELD,
                    f"invalid UTF-8 byte 0x{raw[err.start]:02x} at byte {err.start + 1} of the "
                    "line; re-encode the file as UTF-8",
                ) from None
            if not text.strip():
                continue
            try:
                value = json.loads(text)
            except json.JSONDecodeError as err:
                raise DataFormatError(
                    path, line_no, JSON_FIELD, f"malformed JSON: {err.msg} at column {err.colno}"
                ) from None
            yield line_no, _check_object(path, line_no, value)


def _first_non_blank_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        head = f.read(4096)
    return head.removeprefix(_UTF8_BOM).lstrip()[:1]


def iter_json(path: Path) -> Iterator[tuple[int, Row]]:
    """Read a ``.json`` file: a list of objects, or JSON Lines under a ``.json`` name.

    Args:
        path: the file.

    Returns:
        An iterator of (1-based list index or line number, row).
    """
    if _first_non_blank_byte(path) != b"[":
        yield from iter_jsonl(path)
        return
    raw = path.read_bytes().removeprefix(_UTF8_BOM)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise DataFormatError(
            path, line, ENCODING_FIELD, f"invalid UTF-8 byte 0x{raw[err.start]:02x}"
        ) from None
    try:
        values = json.loads(text)
    except json.JSONDecodeError as err:
        # Here the parser knows the real line, so report that one.
        raise DataFormatError(
            path, err.lineno, JSON_FIELD, f"malformed JSON: {err.msg} at column {err.colno}"
        ) from None
    for index, value in enumerate(values, start=1):
        yield index, _check_object(path, index, value)


def iter_parquet(path: Path) -> Iterator[tuple[int, Row]]:
    """Read a Parquet file batch by batch with ``pyarrow``.

    Args:
        path: the file.

    Returns:
        An iterator of (1-based row index, row).
    """
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError(
            f"{path}: reading Parquet needs pyarrow; install it with `pip install pyarrow` "
            "(or `pip install megatron_kto[parquet]`)"
        ) from err
    try:
        parquet_file = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises several unrelated types for a corrupt file
        raise DataFormatError(path, 1, FILE_FIELD, f"not a readable Parquet file ({err})") from None
    index = 0
    for batch in parquet_file.iter_batches(batch_size=_PARQUET_BATCH_ROWS):
        for row in batch.to_pylist():
            index += 1
            yield index, row


def iter_hf_dataset_dir(path: Path) -> Iterator[tuple[int, Row]]:
    """Read a directory written by ``datasets.Dataset.save_to_disk``.

    Args:
        path: the directory (one split; a ``DatasetDict`` directory is rejected with the list
            of its splits).

    Returns:
        An iterator of (1-based row index, row).
    """
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise DataFormatError(
            path,
            1,
            FILE_FIELD,
            f"is a DatasetDict with splits {splits}; pass one split directory, e.g. "
            f"{path / (splits[0] if splits else 'train')}",
        )
    try:
        import datasets
    except ImportError as err:
        raise ImportError(
            f"{path}: reading a `save_to_disk` directory needs the optional `datasets` package; "
            "install it with `pip install datasets` or export the data to JSONL/Parquet"
        ) from err
    try:
        dataset = datasets.load_from_disk(str(path))
    except Exception as err:  # datasets raises FileNotFoundError/ValueError/... variously
        raise DataFormatError(
            path, 1, FILE_FIELD, f"not a readable `datasets` directory ({err})"
        ) from None
    yield from enumerate(dataset, start=1)


def iter_rows(path: str | Path) -> Iterator[tuple[int, Row]]:
    """Yield the rows of one data file, picking the reader from the path.

    Args:
        path: a ``.jsonl``, ``.json`` or ``.parquet`` file, or a ``datasets`` directory.

    Returns:
        An iterator of (position, row); see the module docstring for what position means.

    Raises:
        FileNotFoundError: the path does not exist.
        DataFormatError: the file is unreadable, malformed or has no rows.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: data file not found")
    if path.is_dir():
        reader = iter_hf_dataset_dir
    else:
        suffix = path.suffix.lower()
        readers = {".jsonl": iter_jsonl, ".json": iter_json, ".parquet": iter_parquet}
        if suffix not in readers:
            raise DataFormatError(
                path,
                1,
                FILE_FIELD,
                f"unknown data file type {suffix!r}; use .jsonl, .json, .parquet or a "
                "`datasets` save_to_disk directory",
            )
        reader = readers[suffix]
    count = 0
    for position, row in reader(path):
        count += 1
        yield position, row
    if count == 0:
        raise DataFormatError(path, 1, FILE_FIELD, "no rows (the file is empty)")
