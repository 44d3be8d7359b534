"""tools/preprocess_kto_data.py exit codes and output (run as a subprocess), and the bundled
example data (in sync with tools/make_example_data.py, balanced, learnable-by-design)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "preprocess_kto_data.py"
EXAMPLES = REPO / "examples" / "data"
SP_MODEL = EXAMPLES / "tokenizer" / "tiny_sp.model"


def run(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *map(str, args)], capture_output=True, text=True, cwd=REPO, timeout=120
    )


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_validate_good_and_bad_files(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [{"prompt": "a", "completion": "b", "label": True}])
    bad = write_jsonl(
        tmp_path / "bad.jsonl",
        [
            {"prompt": "a", "completion": "b", "label": True},
            {"prompt": "a", "completion": "b", "label": "yes"},
        ],
    )
    ok = run(TOOL, "validate", good)
    assert ok.returncode == 0 and "OK, 1 rows" in ok.stdout and "1 desirable" in ok.stdout
    failed = run(TOOL, "validate", good, bad)
    assert failed.returncode == 1
    assert "OK" in failed.stdout  # the good file is still reported
    assert failed.stderr.strip().splitlines() == [
        f"{bad}:2: label: expected true or false, got string 'yes'"
    ]
    assert "Traceback" not in failed.stderr


BAD_FILES = {
    "malformed.jsonl": (
        b'{"prompt": "a", "completion": "b", "label": true}\n{"prompt": \n',
        2,
        "<json>",
    ),
    "missing.jsonl": (b'{"prompt": "a", "completion": "b"}\n', 1, "label"),
    "type.jsonl": (b'{"prompt": "a", "completion": "b", "label": "yes"}\n', 1, "label"),
    "empty_completion.jsonl": (
        b'{"prompt": "a", "completion": "", "label": true}\n',
        1,
        "completion",
    ),
    "preference.jsonl": (
        b'{"prompt": "a", "response": "b", "preference": "best"}\n',
        1,
        "preference",
    ),
    "mixed.jsonl": (
        b'{"prompt": "a", "completion": "b", "label": true}\n'
        b'{"prompt": "a", "chosen": "b", "rejected": "c"}\n',
        2,
        "<row>",
    ),
    "empty.jsonl": (b"", 1, "<file>"),
    "latin1.jsonl": (b'{"prompt": "caf\xe9", "completion": "b", "label": true}\n', 1, "<utf-8>"),
}


def test_every_bad_input_is_one_line_per_file_and_exit_1(tmp_path):
    paths = []
    for name, (content, _, _) in BAD_FILES.items():
        (tmp_path / name).write_bytes(content)
        paths.append(tmp_path / name)
    result = run(TOOL, "validate", *paths)
    assert result.returncode == 1 and result.stdout == "" and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == len(BAD_FILES)
    for line, (name, (_, number, field)) in zip(lines, BAD_FILES.items()):
        assert line.startswith(f"{tmp_path / name}:{number}: {field}: "), line


def test_validate_missing_file_and_bad_arguments(tmp_path):
    missing = run(TOOL, "validate", tmp_path / "nope.jsonl")
    assert missing.returncode == 1 and len(missing.stderr.strip().splitlines()) == 1
    assert "Traceback" not in missing.stderr
    assert run(TOOL, "convert", "--to", "paired", "a", "b").returncode == 2


def test_convert_paired_and_nemo_to_unpaired(tmp_path):
    paired = write_jsonl(
        tmp_path / "paired.jsonl", [{"prompt": "p", "chosen": "c", "rejected": "r"}]
    )
    out = tmp_path / "out.jsonl"
    result = run(TOOL, "convert", "--to", "unpaired", paired, out)
    assert result.returncode == 0, result.stderr
    assert [json.loads(line) for line in out.read_text().splitlines()] == [
        {"prompt": "p", "completion": "c", "label": True},
        {"prompt": "p", "completion": "r", "label": False},
    ]
    nemo = write_jsonl(
        tmp_path / "nemo.json", [{"prompt": "p", "response": "x", "preference": "rejected"}]
    )
    assert run(TOOL, "convert", "--to", "unpaired", nemo, out).returncode == 0
    assert json.loads(out.read_text()) == {"prompt": "p", "completion": "x", "label": False}
    assert run(TOOL, "validate", out).returncode == 0


def test_convert_bad_input_leaves_no_output(tmp_path):
    bad = write_jsonl(
        tmp_path / "bad.jsonl", [{"prompt": "p", "chosen": "c", "rejected": "r"}, {"prompt": "p"}]
    )
    out = tmp_path / "out.jsonl"
    result = run(TOOL, "convert", "--to", "unpaired", bad, out)
    assert (
        result.returncode == 1
        and result.stderr.strip()
        == f"{bad}:2: <row>: unknown row format with keys ['prompt']; expected one of: TRL unpaired {{prompt, completion, label}}, NeMo-Aligner {{prompt, response, preference}}, paired {{prompt, chosen, rejected}}"
    )
    assert not out.exists() and list(tmp_path.iterdir()) == [bad]


def test_stats_reports_counts_weights_percentiles_and_drops(tmp_path):
    result = run(
        TOOL, "stats", EXAMPLES / "tiny_kto" / "validation.jsonl",
        "--tokenizer-library", "sentencepiece", "--tokenizer-model", SP_MODEL,
        "--max-length", "16", "--max-prompt-length", "8",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "128 rows" in out and "64 desirable, 64 undesirable" in out
    assert "model.kto.desirable_loss_weight=1" in out
    assert "p50 / p90 / p99 / max" in out and "dropped 0" in out
    long_prompt = write_jsonl(
        tmp_path / "long.jsonl",
        [
            {"prompt": " ".join(["apple"] * 30), "completion": "plum .", "label": True},
            {"prompt": "Name two fruit words .", "completion": "plum , fig .", "label": False},
        ],
    )
    result = run(
        TOOL, "stats", long_prompt, "--tokenizer-library", "sentencepiece",
        "--tokenizer-model", SP_MODEL, "--max-length", "16",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "dropped 1 (prompt_too_long=1)" in result.stdout
    assert "0 desirable, 1 undesirable" in result.stdout  # the dropped row is not counted as kept
    bad = run(
        TOOL,
        "stats",
        SP_MODEL,
        "--tokenizer-library",
        "sentencepiece",
        "--tokenizer-model",
        "nope.model",
    )
    assert bad.returncode == 1 and "Traceback" not in bad.stderr


@pytest.mark.parametrize("split, rows", [("train", 1024), ("validation", 128)])
def test_bundled_kto_example_is_balanced_and_in_range(split, rows):
    from megatron_kto.data.dataset import build_kto_dataset
    from megatron_kto.data.tokenizers import load_tokenizer

    tok = load_tokenizer("sentencepiece", str(SP_MODEL))
    dataset, stats = build_kto_dataset(
        EXAMPLES / "tiny_kto" / f"{split}.jsonl", tok, 64, use_cache=False
    )
    assert stats.examples == rows and stats.desirable == stats.undesirable and not stats.warnings
    lengths = dataset.sequence_lengths()
    assert 5 <= lengths[:, 0].min() and lengths[:, 0].max() <= 16  # prompts, BOS included
    assert 4 <= lengths[:, 1].min() and lengths[:, 1].max() <= 13  # completions, EOS included
    assert 1 not in set(dataset.shards[0].tokens.tolist())  # no <unk> token anywhere


def test_example_generator_reproduces_the_bundled_files(tmp_path):
    result = run(REPO / "tools" / "make_example_data.py", "--out", tmp_path)
    assert result.returncode == 0, result.stderr
    for name in ("tiny_kto/train.jsonl", "tiny_kto/validation.jsonl", "tiny_dpo/train.jsonl",
                 "tiny_dpo/validation.jsonl", "tokenizer/tiny_sp.model"):  # fmt: skip
        assert (tmp_path / name).read_bytes() == (EXAMPLES / name).read_bytes(), name


def test_bundled_kto_signal_is_visible_at_the_token_level():
    """A per-token log-odds model fitted on train completions classifies validation rows far
    above chance: the desirable/undesirable difference is in the tokens, as the task promises."""
    from collections import Counter

    from megatron_kto.data.dataset import build_kto_dataset
    from megatron_kto.data.tokenizers import load_tokenizer

    tok = load_tokenizer("sentencepiece", str(SP_MODEL))
    train, _ = build_kto_dataset(EXAMPLES / "tiny_kto" / "train.jsonl", tok, 64, use_cache=False)
    val, _ = build_kto_dataset(EXAMPLES / "tiny_kto" / "validation.jsonl", tok, 64, use_cache=False)
    counts = {True: Counter(), False: Counter()}
    for i in range(len(train)):
        counts[train[i]["label"]].update(train[i]["completion_ids"])

    def score(ids: list[int]) -> float:
        return sum(math.log((counts[True][t] + 1) / (counts[False][t] + 1)) for t in ids)

    correct = sum((score(val[i]["completion_ids"]) > 0) == val[i]["label"] for i in range(len(val)))
    assert correct / len(val) > 0.8
