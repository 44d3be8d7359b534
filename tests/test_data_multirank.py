"""The cache writer/reader protocol with a real gloo barrier on 2 ranks (one spawn, ~5 s)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from multirank import run_multirank

REPO = Path(__file__).resolve().parents[1]
SP_MODEL = str(REPO / "examples" / "data" / "tokenizer" / "tiny_sp.model")


def _ranks_build(rank: int, world_size: int, good: str, bad: str) -> dict:
    import torch.distributed as dist

    from megatron_kto.data.dataset import build_kto_dataset
    from megatron_kto.data.samplers import TrainingBatchSampler
    from megatron_kto.data.tokenizers import load_tokenizer

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    tok = load_tokenizer("sentencepiece", SP_MODEL)
    dataset, stats = build_kto_dataset(
        good, tok, 64, is_cache_writer=rank == 0, barrier=dist.barrier
    )
    items = [dataset[i] for i in range(len(dataset))]
    shares = list(TrainingBatchSampler(len(dataset), 8, rank, world_size, seed=3, max_epochs=1))
    try:
        build_kto_dataset(bad, tok, 64, is_cache_writer=rank == 0, barrier=dist.barrier)
        failure = ""
    except Exception as err:  # every rank must fail, none may hang
        failure = f"{type(err).__name__}: {err}"
    dist.destroy_process_group()
    return {"items": items, "examples": stats.examples, "shares": shares, "failure": failure}


@pytest.mark.multirank
def test_writer_and_reader_ranks_share_one_cache_and_fail_together(tmp_path):
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    rows = [
        {"prompt": f"Name {i} .", "completion": "apple .", "label": i % 2 == 0} for i in range(20)
    ]
    good.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bad.write_text(json.dumps(rows[0]) + '\n{"prompt": "x", "completion": "y", "label": "no"}\n')
    rank0, rank1 = run_multirank(_ranks_build, 2, str(good), str(bad), timeout=120)
    assert rank0["items"] == rank1["items"] and rank0["examples"] == 20
    assert len(list((tmp_path / "good.jsonl.mkto_cache").iterdir())) == 1
    seen = [i for r in (rank0, rank1) for share in r["shares"] for i in share]
    assert sorted(seen) == sorted(set(seen)) and len(seen) == 16  # 2 full global batches of 8
    assert rank0["failure"].startswith(f"DataFormatError: {bad}:2: label:")
    # A RuntimeError subclass the entry points know: that rank exits quietly, rank 0 reports.
    assert rank1["failure"].startswith("CacheWriterFailedError")
    assert "cache-writer rank" in rank1["failure"]
    assert not (tmp_path / "bad.jsonl.mkto_cache").exists() or not any(
        (tmp_path / "bad.jsonl.mkto_cache").iterdir()
    )
