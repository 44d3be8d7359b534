"""build_kto_dataset / build_dpo_dataset: items, statistics, length drops, class-balance advice."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from megatron_kto.data.dataset import DPODataset, KTODataset, build_dpo_dataset, build_kto_dataset
from megatron_kto.data.errors import DataFormatError
from megatron_kto.data.stats import (
    DESIRABLE_WEIGHT_KEY,
    UNDESIRABLE_WEIGHT_KEY,
    DatasetStats,
    class_balance_warnings,
    imbalance_ratio,
    suggest_loss_weights,
)
from megatron_kto.data.tokenizers import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
SP_MODEL = str(REPO / "examples" / "data" / "tokenizer" / "tiny_sp.model")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("sentencepiece", SP_MODEL)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_kto_items_and_stats(tmp_path, tok):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"prompt": "Name two fruit words .", "completion": " apple , plum .", "label": True},
            {"prompt": "Name two tool words .", "completion": " rain , fog .", "label": False},
        ],
    )
    dataset, stats = build_kto_dataset(path, tok, max_length=64, use_cache=False)
    assert isinstance(dataset, KTODataset) and len(dataset) == 2
    item = dataset[0]
    assert set(item) == {"prompt_ids", "completion_ids", "label"}
    assert item["prompt_ids"] == [tok.bos_id, *tok.encode("Name two fruit words .")]
    assert item["completion_ids"] == [*tok.encode(" apple , plum ."), tok.eos_id]
    assert item["label"] is True and dataset[-1]["label"] is False
    assert all(isinstance(i, int) for i in item["prompt_ids"])
    assert dataset.labels.tolist() == [True, False]
    assert (stats.rows_read, stats.examples, stats.desirable, stats.undesirable) == (2, 2, 1, 1)
    assert stats.dropped == {} and stats.warnings == []
    with pytest.raises(IndexError):
        dataset[2]


def test_paired_rows_become_two_kto_rows_and_one_dpo_pair(tmp_path, tok):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {
                "prompt": "Name two fruit words .",
                "chosen": " apple , plum .",
                "rejected": " car , bus .",
            }
        ],
    )
    kto, kto_stats = build_kto_dataset(path, tok, max_length=64, use_cache=False)
    assert [kto[i]["label"] for i in range(2)] == [True, False]
    assert kto_stats.rows_read == 1 and kto_stats.examples == 2
    dpo, dpo_stats = build_dpo_dataset(path, tok, max_length=64, use_cache=False)
    assert isinstance(dpo, DPODataset) and len(dpo) == 1 and dpo_stats.examples == 1
    assert dpo[0]["chosen_ids"] == kto[0]["completion_ids"]
    assert dpo[0]["rejected_ids"] == kto[1]["completion_ids"]
    assert dpo[0]["prompt_ids"] == kto[0]["prompt_ids"]


def test_multiple_files_are_concatenated_in_order(tmp_path, tok):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "a", "completion": "b", "label": True}])
    b = write_jsonl(
        tmp_path / "b.jsonl", [{"prompt": "c", "response": "d", "preference": "rejected"}]
    )
    dataset, stats = build_kto_dataset([a, b], tok, max_length=64, use_cache=False)
    assert [dataset[i]["label"] for i in range(2)] == [True, False]
    assert stats.files == [str(a), str(b)] and stats.rows_read == 2


def test_length_policy_drops_are_counted_and_reported(tmp_path, tok):
    long_prompt = " ".join(["apple"] * 40)
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"prompt": long_prompt, "completion": " plum .", "label": True},
            {
                "prompt": "Name two fruit words .",
                "completion": " apple , plum , peach , mango .",
                "label": False,
            },
            {"prompt": "Name two fruit words .", "completion": " apple .", "label": True},
        ],
    )
    dataset, stats = build_kto_dataset(path, tok, max_length=10, use_cache=False)
    assert len(dataset) == 2 and stats.dropped == {"prompt_too_long": 1}
    assert stats.completions_truncated == 1
    assert all(
        len(dataset[i]["prompt_ids"]) + len(dataset[i]["completion_ids"]) <= 10 for i in range(2)
    )
    assert dataset[0]["completion_ids"][-1] != tok.eos_id  # a cut completion loses its EOS
    assert "dropped by the length policy: 1 (prompt_too_long=1)" in stats.summary()
    # With max_prompt_length the long prompt is truncated (keep_end keeps BOS) instead of dropped.
    dataset, stats = build_kto_dataset(
        path, tok, max_length=10, max_prompt_length=7, use_cache=False
    )
    assert len(dataset) == 3 and stats.dropped == {} and stats.prompts_truncated == 1
    assert dataset[0]["prompt_ids"] == [tok.bos_id] + tok.encode(long_prompt)[-6:]
    dataset, _ = build_kto_dataset(
        path, tok, max_length=10, max_prompt_length=7, truncation_mode="keep_start", use_cache=False
    )
    assert dataset[0]["prompt_ids"] == [tok.bos_id] + tok.encode(long_prompt)[:6]


def test_one_class_dataset_is_allowed_with_a_warning(tmp_path, tok, caplog):
    path = write_jsonl(
        tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b", "label": True}] * 3
    )
    with caplog.at_level(logging.WARNING):
        dataset, stats = build_kto_dataset(path, tok, max_length=64, use_cache=False)
    assert len(dataset) == 3 and stats.undesirable == 0
    (warning,) = stats.warnings
    assert (
        "one-class" in warning
        and DESIRABLE_WEIGHT_KEY in warning
        and UNDESIRABLE_WEIGHT_KEY in warning
    )
    assert warning in caplog.text
    assert "WARNING: one-class" in stats.summary()


def test_imbalance_suggestion_lands_in_the_paper_range():
    assert suggest_loss_weights(100, 100) == (1.0, 1.0)
    assert suggest_loss_weights(120, 100) == (1.0, 1.0)
    assert suggest_loss_weights(0, 5) is None and suggest_loss_weights(5, 0) is None
    for n_d, n_u in ((10, 1000), (1, 3), (999, 1000), (1000, 10), (5, 3), (7, 5)):
        w_d, w_u = suggest_loss_weights(n_d, n_u)
        assert 1.0 <= imbalance_ratio(n_d, n_u, w_d, w_u) <= 4 / 3, (n_d, n_u)
    stats = DatasetStats(kind="kto", desirable=10, undesirable=1000)
    (warning,) = class_balance_warnings(stats)
    assert f"{DESIRABLE_WEIGHT_KEY}=100" in warning
    assert class_balance_warnings(stats, desirable_weight=100.0) == []


def test_dpo_from_unpaired_data_is_an_error(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b", "label": True}])
    with pytest.raises(DataFormatError, match="d.jsonl:1: <row>: DPO needs"):
        build_dpo_dataset(path, tok, max_length=64, use_cache=False)


def test_summary_judges_imbalance_with_the_configured_weights():
    stats = DatasetStats(
        kind="kto", files=["f"], rows_read=40, examples=40, desirable=10, undesirable=30
    )
    assert "class imbalance" in stats.summary()
    assert "WARNING" not in stats.summary(desirable_weight=3.5, undesirable_weight=1.0)
