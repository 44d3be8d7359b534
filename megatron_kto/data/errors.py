"""The one exception type for bad training data.

Every problem in a data file is reported as a single line ``file:line: field: problem`` so a
user can jump straight to it and tools can print it without a traceback. For JSONL the position
is the 1-based line number of the file; for JSON lists, Parquet and ``datasets`` directories,
which have no meaningful line numbers, it is the 1-based row index.
"""

from __future__ import annotations

from pathlib import Path

#: Pseudo field names for problems that are not about a single row field.
FILE_FIELD = "<file>"
JSON_FIELD = "<json>"
ENCODING_FIELD = "<utf-8>"
ROW_FIELD = "<row>"


class DataFormatError(ValueError):
    """A data file (or one of its rows) cannot be used; ``str(err)`` is one line.

    Attributes:
        path: the data file.
        line: 1-based line (JSONL) or row (other readers) number.
        field: the offending field, e.g. ``label`` or ``prompt[1].role``, or a pseudo field
            such as ``<json>`` for problems with the row as a whole.
        problem: what is wrong, and where useful how to fix it.
    """

    def __init__(self, path: str | Path, line: int, field: str, problem: str) -> None:
        self.path = str(path)
        self.line = line
        self.field = field
        # Keep the message on one line whatever the problem text contains.
        self.problem = " ".join(str(problem).split())
        super().__init__(f"{self.path}:{self.line}: {self.field}: {self.problem}")

    def __reduce__(self) -> tuple[type, tuple[str, int, str, str]]:
        # Picklable with its fields, so it survives DataLoader workers and multiprocessing.
        return (type(self), (self.path, self.line, self.field, self.problem))


class CacheWriteError(OSError):
    """The tokenised cache could not be written (a full disk, a read-only data directory); the
    message names the entry, the cause, the space needed and free, and the way out."""


class CacheWriterFailedError(RuntimeError):
    """A rank that waited for the tokenised cache found none: the rank writing it failed and
    reports why itself (or the cache directory is not shared between them)."""


class RowLocation:
    """Where a row came from; builds :class:`DataFormatError` for that row.

    Small helper so parsing code can say ``where.error("label", "...")`` without threading the
    path and line through every call.
    """

    __slots__ = ("path", "line")

    def __init__(self, path: str | Path, line: int) -> None:
        self.path = str(path)
        self.line = line

    def error(self, field: str, problem: str) -> DataFormatError:
        """Return (not raise) the error for ``field`` of this row."""
        return DataFormatError(self.path, self.line, field, problem)

    def __repr__(self) -> str:
        return f"{self.path}:{self.line}"
