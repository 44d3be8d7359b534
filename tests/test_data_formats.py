"""Readers (JSONL/JSON/Parquet/datasets dir) and format normalisation, including every bad input.

Every bad input must raise DataFormatError (a ValueError) whose str is one line
``file:line: field: problem``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from megatron_kto.data.errors import DataFormatError
from megatron_kto.data.formats import (
    PairedExample,
    RowFormat,
    UnpairedExample,
    iter_dpo_examples,
    iter_kto_examples,
    iter_normalized,
)
from megatron_kto.data.readers import iter_rows

ROWS = [
    {"prompt": "p1", "completion": "c1", "label": True},
    {"prompt": "p2", "completion": "c2", "label": False, "extra": 1},
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def assert_error(err: pytest.ExceptionInfo, path: Path, line: int, field: str) -> str:
    message = str(err.value)
    assert isinstance(err.value, ValueError)
    assert "\n" not in message
    assert message.startswith(f"{path}:{line}: {field}: "), message
    return message


# ----------------------------------------------------------------------------- readers


def test_jsonl_streams_rows_with_line_numbers_skipping_blank_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(ROWS[0]).encode() + b"\n\n  \n")
    path.write_bytes(path.read_bytes() + json.dumps(ROWS[1]).encode())  # no final newline
    assert [(n, r["prompt"]) for n, r in iter_rows(path)] == [(1, "p1"), (4, "p2")]


def test_json_list_and_jsonl_named_json(tmp_path):
    as_list = tmp_path / "list.json"
    as_list.write_text(json.dumps(ROWS, indent=2))
    assert [r for _, r in iter_rows(as_list)] == ROWS
    as_lines = write_jsonl(tmp_path / "lines.json", ROWS)
    assert [r for _, r in iter_rows(as_lines)] == ROWS


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    rows = [{k: v for k, v in r.items() if k != "extra"} for r in ROWS]
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert [(n, r) for n, r in iter_rows(path)] == [(1, rows[0]), (2, rows[1])]


def test_hf_datasets_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{k: v for k, v in r.items() if k != "extra"} for r in ROWS]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    assert [r for _, r in iter_rows(tmp_path / "ds")] == rows
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(
        str(tmp_path / "dd")
    )
    with pytest.raises(DataFormatError, match="DatasetDict with splits \\['train'\\]"):
        list(iter_rows(tmp_path / "dd"))


def test_missing_datasets_package_is_a_clear_import_error(tmp_path, monkeypatch):
    (tmp_path / "ds").mkdir()
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(ImportError, match="optional `datasets` package"):
        list(iter_rows(tmp_path / "ds"))


def test_malformed_json_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(ROWS[0]) + '\n{"prompt": "x", "completion": \n')
    with pytest.raises(DataFormatError) as err:
        list(iter_rows(path))
    assert "malformed JSON" in assert_error(err, path, 2, "<json>")


def test_malformed_json_list_reports_the_parser_line(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[\n {"prompt": "a"},\n {"prompt": }\n]')
    with pytest.raises(DataFormatError) as err:
        list(iter_rows(path))
    assert_error(err, path, 3, "<json>")


def test_non_utf8_bytes(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(json.dumps(ROWS[0]).encode() + b'\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataFormatError) as err:
        list(iter_rows(path))
    assert "invalid UTF-8 byte 0xe9" in assert_error(err, path, 2, "<utf-8>")


@pytest.mark.parametrize("content", [b"", b"\n\n   \n"])
def test_empty_file(tmp_path, content):
    path = tmp_path / "d.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataFormatError) as err:
        list(iter_rows(path))
    assert "no rows" in assert_error(err, path, 1, "<file>")


def test_row_that_is_not_an_object(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('["prompt", "completion"]\n')
    with pytest.raises(DataFormatError) as err:
        list(iter_rows(path))
    assert "expected a JSON object, got array" in assert_error(err, path, 1, "<row>")


def test_unknown_suffix_and_missing_file(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("a,b\n")
    with pytest.raises(DataFormatError, match="unknown data file type '.csv'"):
        list(iter_rows(path))
    with pytest.raises(FileNotFoundError, match="data file not found"):
        list(iter_rows(tmp_path / "nope.jsonl"))


# ----------------------------------------------------------------------------- formats


def test_every_format_normalises_to_the_same_examples(tmp_path):
    trl = write_jsonl(
        tmp_path / "trl.jsonl",
        [
            {"prompt": "q", "completion": "good", "label": True},
            {"prompt": "q", "completion": "bad", "label": False},
        ],
    )
    nemo = write_jsonl(
        tmp_path / "nemo.jsonl",
        [
            {"prompt": "q", "response": "good", "preference": "chosen"},
            {"prompt": "q", "response": "bad", "preference": "rejected"},
        ],
    )
    paired = write_jsonl(
        tmp_path / "paired.jsonl", [{"prompt": "q", "chosen": "good", "rejected": "bad"}]
    )
    for path, fmt in (
        (trl, RowFormat.UNPAIRED),
        (nemo, RowFormat.NEMO),
        (paired, RowFormat.PAIRED),
    ):
        examples = list(iter_kto_examples(path))
        assert [(e.prompt, e.completion, e.label) for e in examples] == [
            ("q", "good", True),
            ("q", "bad", False),
        ]
        assert all(isinstance(e, UnpairedExample) and e.source_format is fmt for e in examples)
    (pair,) = list(iter_dpo_examples(paired))
    assert isinstance(pair, PairedExample) and (pair.chosen, pair.rejected) == ("good", "bad")


def test_conversational_rows(tmp_path):
    prompt = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    path = write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {
                "prompt": prompt,
                "completion": [{"role": "assistant", "content": "yo"}],
                "label": 1 == 1,
            },
        ],
    )
    (example,) = list(iter_normalized(path))
    assert example.prompt == prompt and example.completion[0]["content"] == "yo"


@pytest.mark.parametrize(
    "row, field, problem",
    [
        ({"prompt": "p", "completion": "c"}, "label", "missing field"),
        ({"completion": "c", "label": True}, "prompt", "missing field"),
        ({"prompt": "p", "response": "r"}, "preference", "missing field"),
        ({"prompt": "p", "completion": "c", "label": "yes"}, "label", "expected true or false, got string 'yes'"),
        ({"prompt": "p", "completion": "c", "label": 1}, "label", "expected true or false, got int"),
        ({"prompt": "p", "completion": "", "label": True}, "completion", "empty string"),
        ({"prompt": "p", "completion": "  \n", "label": True}, "completion", "empty string"),
        ({"prompt": "", "completion": "c", "label": True}, "prompt", "empty string"),
        ({"prompt": "p", "chosen": "c", "rejected": ""}, "rejected", "empty string"),
        ({"prompt": "p", "response": "r", "preference": "maybe"}, "preference", "unknown value 'maybe'"),
        ({"prompt": "p", "response": "r", "preference": True}, "preference", "unknown value True"),
        ({"prompt": 3, "completion": "c", "label": True}, "prompt", "expected a string or a list"),
        ({"prompt": "p", "completion": None, "label": True}, "completion", "got null"),
        ({"prompt": "p", "completion": "c", "label": True, "chosen": "x", "rejected": "y"}, "<row>", "ambiguous row"),
        ({"text": "hello"}, "<row>", "unknown row format"),
        ({"prompt": [{"role": "user"}], "completion": [{"role": "assistant", "content": "a"}], "label": True},
         "prompt[0].content", "missing field"),
        ({"prompt": [{"role": "user", "content": 5}], "completion": [{"role": "assistant", "content": "a"}], "label": True},
         "prompt[0].content", "expected a string, got int"),
        ({"prompt": [], "completion": [{"role": "assistant", "content": "a"}], "label": True}, "prompt", "empty message list"),
        ({"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant", "content": " "}], "label": True},
         "completion[0].content", "empty completion message"),
        ({"prompt": "p", "completion": [{"role": "assistant", "content": "a"}], "label": True},
         "completion", "is a message list but prompt is a string"),
    ],
)  # fmt: skip
def test_bad_rows(tmp_path, row, field, problem):
    path = write_jsonl(tmp_path / "d.jsonl", [ROWS[0], row])
    with pytest.raises(DataFormatError) as err:
        list(iter_normalized(path))
    assert problem in assert_error(err, path, 2, field)
    assert err.value.line == 2 and err.value.field == field


def test_error_is_one_line_and_picklable():
    import pickle

    err = DataFormatError("f.jsonl", 3, "label", "bad\nvalue")
    assert str(err) == "f.jsonl:3: label: bad value"
    copy = pickle.loads(pickle.dumps(err))
    assert (str(copy), copy.line, copy.field) == (str(err), 3, "label")


def test_mixed_formats_in_one_file(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [ROWS[0], ROWS[1], {"prompt": "p", "response": "r", "preference": "chosen"}],
    )
    with pytest.raises(DataFormatError) as err:
        list(iter_normalized(path))
    message = assert_error(err, path, 3, "<row>")
    assert "mixed formats" in message and "NeMo-Aligner" in message and "TRL unpaired" in message


def test_mixed_plain_and_conversational_rows(tmp_path):
    chat = {
        "prompt": [{"role": "user", "content": "q"}],
        "completion": [{"role": "assistant", "content": "a"}],
        "label": True,
    }
    path = write_jsonl(tmp_path / "d.jsonl", [chat, ROWS[0]])
    with pytest.raises(DataFormatError) as err:
        list(iter_normalized(path))
    assert "conversational" in assert_error(err, path, 2, "<row>")


def test_dpo_needs_paired_rows(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(DataFormatError) as err:
        list(iter_dpo_examples(path))
    assert "train it with KTO" in assert_error(err, path, 1, "<row>")
