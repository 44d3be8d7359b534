"""Tokenised cache: hit, miss, invalidation, atomicity, and the writer/barrier protocol."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from megatron_kto.data import cache
from megatron_kto.data import dataset as dataset_module
from megatron_kto.data.dataset import build_kto_dataset
from megatron_kto.data.errors import DataFormatError
from megatron_kto.data.tokenizers import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
SP_MODEL = str(REPO / "examples" / "data" / "tokenizer" / "tiny_sp.model")
ROWS = [
    {"prompt": "Name two fruit words .", "completion": " apple , plum .", "label": True},
    {"prompt": "Name two tool words .", "completion": " rain , fog .", "label": False},
    {"prompt": "Name three color words .", "completion": " red , blue , pink .", "label": True},
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("sentencepiece", SP_MODEL)


@pytest.fixture
def data(tmp_path) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    return path


def entries(path: Path) -> list[Path]:
    root = cache.cache_root(path, None)
    return sorted(root.iterdir()) if root.exists() else []


class CountingTokenize:
    """Wraps tokenize_file to count how often tokenisation really runs."""

    def __init__(self, monkeypatch):
        self.calls = 0
        self._real = dataset_module.tokenize_file
        monkeypatch.setattr(dataset_module, "tokenize_file", self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._real(*args, **kwargs)


def items(ds) -> list:
    return [ds[i] for i in range(len(ds))]


def test_miss_then_hit_gives_identical_data_from_memory_maps(data, tok, monkeypatch):
    counter = CountingTokenize(monkeypatch)
    first, stats1 = build_kto_dataset(data, tok, max_length=64)
    assert counter.calls == 1
    (entry,) = entries(data)
    assert entry.parent.name == "train.jsonl.mkto_cache"
    assert {p.name for p in entry.iterdir()} == {
        "tokens.npy",
        "offsets.npy",
        "labels.npy",
        "prompt_keys.npy",
        "meta.json",
    }
    second, stats2 = build_kto_dataset(data, tok, max_length=64)
    assert counter.calls == 1  # hit: no tokenisation
    assert isinstance(second.shards[0].tokens, np.memmap)
    assert (
        items(first) == items(second) == items(build_kto_dataset(data, tok, 64, use_cache=False)[0])
    )
    assert stats1 == stats2


def test_content_change_invalidates_even_with_same_size_and_mtime(data, tok, monkeypatch):
    counter = CountingTokenize(monkeypatch)
    build_kto_dataset(data, tok, max_length=64)
    stat = data.stat()
    text = data.read_text().replace("apple", "mango")  # same length, different content
    data.write_text(text)
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert data.stat().st_size == stat.st_size
    ds, _ = build_kto_dataset(data, tok, max_length=64)
    assert counter.calls == 2 and len(entries(data)) == 2
    assert ds[0]["completion_ids"][0] == tok.encode(" mango")[0]


def test_tokenizer_and_length_settings_are_part_of_the_key(data, tok, monkeypatch):
    counter = CountingTokenize(monkeypatch)
    build_kto_dataset(data, tok, max_length=64)
    build_kto_dataset(data, tok, max_length=32)
    build_kto_dataset(data, tok, max_length=64, max_prompt_length=8)
    build_kto_dataset(data, tok, max_length=64, max_prompt_length=8, truncation_mode="keep_start")
    templated = load_tokenizer("sentencepiece", SP_MODEL, chat_template="{{ messages }}")
    build_kto_dataset(data, templated, max_length=64)
    assert counter.calls == 5 and len(entries(data)) == 5
    build_kto_dataset(data, tok, max_length=32)
    assert counter.calls == 5


def test_cache_dir_option(data, tok, tmp_path):
    build_kto_dataset(data, tok, max_length=64, cache_dir=tmp_path / "cache")
    assert not entries(data)
    assert len(list((tmp_path / "cache" / "train.jsonl.mkto_cache").iterdir())) == 1


def test_crash_while_writing_leaves_no_partial_entry(data, tok, monkeypatch):
    real_save = np.save
    calls = []

    def failing_save(path, array):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        real_save(path, array)

    monkeypatch.setattr(cache.np, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        build_kto_dataset(data, tok, max_length=64)
    assert entries(data) == []  # neither the entry nor its temporary directory remains
    monkeypatch.setattr(cache.np, "save", real_save)
    ds, _ = build_kto_dataset(data, tok, max_length=64)
    assert len(ds) == 3


BAD_SECOND_LINES = {
    "malformed": b'{"prompt": "x", "completion": ',
    "wrong_type": b'{"prompt": "x", "completion": "y", "label": "yes"}',
    "non_utf8": b'{"prompt": "caf\xe9", "completion": "y", "label": true}',
    "mixed": b'{"prompt": "x", "response": "y", "preference": "chosen"}',
    "empty_completion": b'{"prompt": "x", "completion": "", "label": true}',
}


@pytest.mark.parametrize("case", sorted(BAD_SECOND_LINES))
def test_bad_file_writes_no_cache(tmp_path, tok, case):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(json.dumps(ROWS[0]).encode() + b"\n" + BAD_SECOND_LINES[case] + b"\n")
    with pytest.raises(DataFormatError, match="bad.jsonl:2: "):
        build_kto_dataset(path, tok, max_length=64)
    assert entries(path) == []


def test_parquet_and_datasets_directory_are_cached(tmp_path, tok):
    pa = pytest.importorskip("pyarrow")
    datasets = pytest.importorskip("datasets")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    reference = items(build_kto_dataset(tmp_path / "d.parquet", tok, 64, use_cache=False)[0])
    for path in (tmp_path / "d.parquet", tmp_path / "ds"):
        assert items(build_kto_dataset(path, tok, 64)[0]) == reference
        assert len(entries(path)) == 1
        assert items(build_kto_dataset(path, tok, 64)[0]) == reference
    assert (tmp_path / "ds.mkto_cache").is_dir()


def test_barrier_protocol(data, tok):
    calls = []
    # A reader before the writer ran finds nothing after the barrier and says so.
    with pytest.raises(RuntimeError, match="cache-writer rank"):
        build_kto_dataset(data, tok, 64, is_cache_writer=False, barrier=lambda: calls.append("r"))
    assert calls == ["r"] and entries(data) == []
    # Writer builds, then reaches the barrier exactly once; a reader then loads the same data.
    writer, _ = build_kto_dataset(data, tok, 64, barrier=lambda: calls.append("w"))
    reader, _ = build_kto_dataset(
        data, tok, 64, is_cache_writer=False, barrier=lambda: calls.append("r")
    )
    assert calls == ["r", "w", "r"] and items(writer) == items(reader)


def test_failing_writer_still_reaches_the_barrier(tmp_path, tok):
    path = tmp_path / "bad.jsonl"
    path.write_text("{not json}\n")
    calls = []
    with pytest.raises(DataFormatError):
        build_kto_dataset(path, tok, 64, barrier=lambda: calls.append("w"))
    assert calls == ["w"]


def test_corrupt_entry_is_rebuilt_by_the_writer(data, tok, monkeypatch):
    build_kto_dataset(data, tok, max_length=64)
    (entry,) = entries(data)
    (entry / "offsets.npy").write_bytes(b"garbage")
    counter = CountingTokenize(monkeypatch)
    ds, _ = build_kto_dataset(data, tok, max_length=64)
    assert counter.calls == 1 and len(ds) == 3
