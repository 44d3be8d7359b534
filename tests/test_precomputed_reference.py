"""reference_policy=precomputed: the table holds exactly what live reference passes give for the
batches the run consumes — KL rows with the same global-batch partners as `cpu_swap`, epoch by
epoch — and a resumed run never recomputes it."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_kto.algorithms.precompute import Coverage, compute_table, load_or_compute
from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.data.collate import kto_custom_collate
from megatron_kto.data.dataset import build_kto_dataset
from megatron_kto.data.kl_pairs import BatchKLPartners
from megatron_kto.data.pipeline import Split
from megatron_kto.data.tokenizers import load_tokenizer
from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks
from megatron_kto.models.kto_model import KTOSettings, MegatronGPTKTOModel
from megatron_kto.models.reference import CPUSwapReference, PrecomputedReference
from megatron_kto.models.training_setup import wrap_ddp
from megatron_kto.runtime import init_runtime, teardown

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples/data/tiny_kto/validation.jsonl"
TOKENIZER = ROOT / "examples/data/tokenizer/tiny_sp.model"
G = 8
#: 128 rows = 16 global batches per epoch; 6 of them per epoch, 13 steps -> epochs 0, 1, 2.
COVERAGE = Coverage(max_steps=13, steps_per_epoch=6, limit_val_batches=0)


@pytest.fixture(scope="module")
def setup():
    runtime = init_runtime(1, 1, seed=3)
    tokenizer = load_tokenizer("sentencepiece", str(TOKENIZER))
    dataset, _ = build_kto_dataset([DATA], tokenizer, max_length=64, use_cache=False)
    keys = np.asarray(dataset.prompt_keys)
    assert len(np.unique(keys)) < len(keys)  # prompts repeat: the partner rule matters here
    view = BatchKLPartners(dataset, index_offset=0)
    collate = partial(kto_custom_collate, pad_id=tokenizer.pad_id, max_length=64)
    arch = GPTArchitecture(vocab_size=tokenizer.vocab_size, make_vocab_size_divisible_by=64)
    chunks = wrap_ddp(build_gpt_chunks(arch, ParallelLayout(), runtime.device), False)
    settings = KTOSettings(0.1, 1.0, 1.0, "kto", 0.0, 2, 4, arch.vocab_size)
    model = MegatronGPTKTOModel(chunks, CPUSwapReference(chunks), settings)
    split = Split("train", view, None, collate, G, 0, 1, True, 5, 0, kl_prompt_keys=keys)
    yield runtime, model, split
    teardown()


def test_table_equals_live_reference_passes_of_the_consumed_batches(setup):
    runtime, model, split = setup
    table = compute_table(model, [split], runtime, COVERAGE)
    assert table.shape == (128, 1 + 3)
    lookup = PrecomputedReference(table)
    worst = 0.0
    for epoch, batches in ((0, 6), (1, 6), (2, 1)):
        for b, batch in enumerate(split.loader(epoch)):
            if b == batches:
                # Not consumed by the run: never computed, and looking it up is an error.
                with pytest.raises(RuntimeError, match="no precomputed reference log-prob"):
                    lookup.log_probs(batch, forward=None)
                break
            assert batch["epoch"].tolist() == [epoch] * G
            live = model.get_ref_policy_logprobs(batch)  # cpu_swap: a real reference pass
            looked_up = lookup.log_probs(batch, forward=None)
            worst = max(worst, float((looked_up - live).abs().max()))
    print(f"\nmax |precomputed - live| over 13 batches (3 epochs): {worst:.1e}")
    assert worst <= 1e-5
    # The precomputed KL rows are the training sampler's partners: never the row's own prompt.
    keys = split.kl_prompt_keys
    for epoch, batches in ((0, 6), (1, 6), (2, 1)):
        for (rows, partners), batch in zip(
            split.global_batches(epoch, batches), split.loader(epoch)
        ):
            assert rows == batch["index"].tolist()
            assert all(keys[i] != keys[p] for i, p in zip(rows, partners))


def test_resumed_run_never_recomputes(setup, tmp_path):
    runtime, model, split = setup
    args = (model, [split], runtime, COVERAGE, tmp_path / "ref")
    with pytest.raises(RuntimeError, match="cannot recompute"):
        load_or_compute(*args, {"k": 1}, resuming=True)
    first = load_or_compute(*args, {"k": 1}, resuming=False)
    with torch.no_grad():  # trained weights must not leak into a reloaded table
        for p in model.chunks[0].parameters():
            p.add_(0.5)
    again = load_or_compute(*args, {"k": 1}, resuming=True)
    assert torch.equal(first.nan_to_num(7.0), again.nan_to_num(7.0))
    with pytest.raises(RuntimeError, match="other data"):
        load_or_compute(*args, {"k": 2}, resuming=True)
    longer = Coverage(max_steps=20, steps_per_epoch=6, limit_val_batches=0)
    with pytest.raises(RuntimeError, match="cover fewer steps"):
        load_or_compute(model, [split], runtime, longer, tmp_path / "ref", {"k": 1}, True)
