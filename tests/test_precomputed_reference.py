"""reference_policy=precomputed: order-independent KL pairs and a table equal to live reference passes."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from megatron_kto.algorithms.precompute import compute_table, load_or_compute
from megatron_kto.data.collate import kto_custom_collate
from megatron_kto.data.dataset import build_kto_dataset
from megatron_kto.data.kl_pairs import IndexedExamples
from megatron_kto.data.pipeline import Split
from megatron_kto.data.tokenizers import load_tokenizer
from megatron_kto.models.architecture import GPTArchitecture
from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks
from megatron_kto.models.kto_model import KTOSettings, MegatronGPTKTOModel
from megatron_kto.models.reference import CPUSwapReference, PrecomputedReference
from megatron_kto.models.training_setup import wrap_ddp
from megatron_kto.runtime import init_runtime, teardown

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples/data/tiny_kto/validation.jsonl"
TOKENIZER = ROOT / "examples/data/tokenizer/tiny_sp.model"


@pytest.fixture(scope="module")
def setup():
    runtime = init_runtime(1, 1, seed=3)
    tokenizer = load_tokenizer("sentencepiece", str(TOKENIZER))
    dataset, _ = build_kto_dataset([DATA], tokenizer, max_length=64, use_cache=False)
    indexed = IndexedExamples(dataset, index_offset=0)
    collate = partial(kto_custom_collate, pad_id=tokenizer.pad_id, max_length=64)
    arch = GPTArchitecture(vocab_size=tokenizer.vocab_size, make_vocab_size_divisible_by=64)
    chunks = wrap_ddp(build_gpt_chunks(arch, ParallelLayout(), runtime.device), False)
    settings = KTOSettings(0.1, 1.0, 1.0, "kto", 0.0, 2, 4, arch.vocab_size)
    model = MegatronGPTKTOModel(chunks, CPUSwapReference(chunks), settings)
    split = Split("train", indexed, None, collate, 8, 0, 1, False, 0, 0)
    yield runtime, indexed, collate, model, split
    teardown()


def test_kl_partner_is_fixed_by_dataset_index(setup):
    _, indexed, collate, _, _ = setup
    n = len(indexed)
    assert indexed[5]["kl_completion_ids"] == indexed.dataset[6]["completion_ids"]
    assert indexed[n - 1]["kl_completion_ids"] == indexed.dataset[0]["completion_ids"]
    # The KL row of example 7 is the same whichever batch it lands in (and a batch of one works).
    alone = collate([indexed[7]])
    mixed = collate([indexed[3], indexed[7], indexed[40]])
    t = int(alone["kl_sample_lengths"][0])
    assert torch.equal(alone["kl_samples"][0, :t], mixed["kl_samples"][1, :t])
    assert mixed["index"].tolist() == [3, 7, 40]


def test_table_equals_live_reference_pass(setup):
    runtime, indexed, collate, model, split = setup
    table = compute_table(model, [split], runtime, chunk=4)
    assert table.shape == (len(indexed), 2)
    batch = collate([indexed[i] for i in (9, 2, 31, 100)])
    live = model.get_ref_policy_logprobs(batch)
    looked_up = PrecomputedReference(table).log_probs(batch, forward=None)
    torch.testing.assert_close(looked_up, live, rtol=1e-5, atol=1e-5)


def test_resumed_run_never_recomputes(setup, tmp_path):
    runtime, _, _, model, split = setup
    with pytest.raises(RuntimeError, match="cannot recompute"):
        load_or_compute(model, [split], runtime, 4, tmp_path / "ref", {"k": 1}, resuming=True)
    first = load_or_compute(model, [split], runtime, 4, tmp_path / "ref", {"k": 1}, resuming=False)
    with torch.no_grad():  # trained weights must not leak into a reloaded table
        for p in model.chunks[0].parameters():
            p.add_(0.5)
    again = load_or_compute(model, [split], runtime, 4, tmp_path / "ref", {"k": 1}, resuming=True)
    assert torch.equal(first, again)
    with pytest.raises(RuntimeError, match="other data"):
        load_or_compute(model, [split], runtime, 4, tmp_path / "ref", {"k": 2}, resuming=True)
