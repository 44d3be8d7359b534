"""`reference_policy=precomputed` under an interleaved pipeline with PP >= 3 (PP=4 x VPP=2).

The precompute pass ran every pass as 2 micro-batches (first rows, second rows); megatron-core's
interleaved schedule needs a multiple of PP micro-batches and refused ("should range in
[PP=4, M=2]"). Now each pass holds `examples_per_pass` examples, topped up on the last pass. The
table computed on 4 ranks (8-layer model, 2 layers per model chunk) must equal the one computed
by a single process on the same weights, for a dataset whose size leaves a short last pass.
DPO pairs are used: both algorithms went through this pass, and DPO's still takes it.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from multirank import run_multirank

pytestmark = pytest.mark.multirank

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples/data/tiny_dpo/validation.jsonl"
TOKENIZER = ROOT / "examples/data/tokenizer/tiny_sp.model"
EXAMPLES = 21  # 4 examples per pass at PP=4, forward micro-batch 2: 5 full passes + 1 short
FORWARD_MBS = 2


class _Indexed(torch.utils.data.Dataset):
    """The first EXAMPLES pairs, each carrying its table row as `index`."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return EXAMPLES

    def __getitem__(self, i: int) -> dict:
        return {**self.dataset[i], "index": i}


def _table(tp: int, pp: int, vpp: int | None, ckpt: Path) -> torch.Tensor:
    from megatron_kto.algorithms.precompute import compute_table
    from megatron_kto.checkpointing.model_io import load_model, read_architecture
    from megatron_kto.data.collate import dpo_custom_collate
    from megatron_kto.data.dataset import build_dpo_dataset
    from megatron_kto.data.pipeline import Split
    from megatron_kto.data.tokenizers import load_tokenizer
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks
    from megatron_kto.models.dpo_model import DPOSettings, MegatronGPTDPOModel
    from megatron_kto.runtime import init_runtime

    runtime = init_runtime(tp, pp, vpp, seed=3)
    arch = read_architecture(ckpt)
    layout = ParallelLayout(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
    )
    chunks = build_gpt_chunks(arch, layout, runtime.device)
    load_model(ckpt, chunks)
    tokenizer = load_tokenizer("sentencepiece", str(TOKENIZER))
    dataset, _ = build_dpo_dataset([DATA], tokenizer, max_length=64, use_cache=False)
    collate = partial(dpo_custom_collate, pad_id=tokenizer.pad_id)
    split = Split(
        "train", _Indexed(dataset), None, collate, 8, runtime.data_parallel_rank, 1, False, 0, 0
    )
    settings = DPOSettings(
        0.1, "sigmoid", 0.0, False, 0.0, FORWARD_MBS, FORWARD_MBS, arch.vocab_size
    )
    model = MegatronGPTDPOModel(chunks, None, settings)
    # 4th argument: rows per forward micro-batch (the DPO pass reads it from the settings too).
    return compute_table(model, [split], runtime, FORWARD_MBS)


def _single(rank: int, world_size: int, tmp: str) -> torch.Tensor:
    from megatron_kto.checkpointing.model_io import save_model
    from megatron_kto.config.architecture import GPTArchitecture
    from megatron_kto.data.tokenizers import load_tokenizer
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks
    from megatron_kto.runtime import init_runtime, teardown

    rt = init_runtime(1, 1, seed=3)
    vocab = load_tokenizer("sentencepiece", str(TOKENIZER)).vocab_size
    arch = GPTArchitecture(
        num_layers=8,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        vocab_size=vocab,
        make_vocab_size_divisible_by=64,
        encoder_seq_length=64,
        init_method_std=0.1,
    )
    ckpt = Path(tmp) / "weights"
    ckpt.mkdir()
    save_model(ckpt, build_gpt_chunks(arch, ParallelLayout(), rt.device), arch)
    table = _table(1, 1, None, ckpt)
    teardown()
    return table


def _interleaved(rank: int, world_size: int, tmp: str) -> torch.Tensor:
    from megatron_kto.runtime import teardown

    table = _table(1, 4, 2, Path(tmp) / "weights")
    teardown()
    return table


def test_interleaved_pp4_table_equals_single_process(tmp_path) -> None:
    single = run_multirank(_single, 1, str(tmp_path), timeout=240)[0]
    per_rank = run_multirank(_interleaved, 4, str(tmp_path), timeout=400)
    assert single.shape == (EXAMPLES, 2) and bool((single < 0).all())
    for table in per_rank:
        torch.testing.assert_close(table, single, rtol=1e-5, atol=1e-5)
