"""One KTO training step's loss and metrics — z₀ included — are the same under every layout.

A reference checkpoint and a *different* policy checkpoint (the reference plus noise, which on
this data scores the KL rows higher, so r > 0 and z₀ > 0 is really exercised) are saved at
TP=1. The same global batch of 8 bundled examples is collated per data-parallel rank exactly as
training does it (`rank_share` with global-batch KL partners, `BatchKLPartners`,
`kto_custom_collate`), and `MegatronGPTKTOModel` runs `get_ref_policy_logprobs` and a training
`get_loss_and_metrics` (micro-batch size 1) under TP=1 (one process) and TP2×DP2, PP2×DP2,
TP2×PP2 and DP4 (four processes). Every layout must give the TP=1 loss, z₀ (`kl`) and TRL
metrics: this is what proves the DP reduction of z₀ and of the (sum, count) metrics, and that the
KL rows do not depend on the data-parallel size.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from e2e_cli import TOKENIZER, TRAIN_DATA, tiny_architecture
from multirank import run_multirank

pytestmark = pytest.mark.multirank

GLOBAL_BATCH = 8
LAYOUTS = {"tp2_dp2": (2, 1), "pp2_dp2": (1, 2), "tp2_pp2": (2, 2), "dp4": (1, 1)}
RTOL = 1e-5
# Rewards and z₀ are β·differences of summed log-probs of magnitude ~60, so fp32 reduction order
# (TP splits the softmax sums; the completion-only output layer sums per chunk) moves them by
# ~60·6e-8·a few: measured ≤ 2.5e-6 with full logits and with chunked log-probs alike.
ATOL = 5e-6


def _step_metrics(tp: int, pp: int, ckpt_dir: str) -> dict[str, float]:
    from megatron_kto.checkpointing.model_io import load_model, read_architecture
    from megatron_kto.data.collate import kto_custom_collate
    from megatron_kto.data.dataset import build_kto_dataset
    from megatron_kto.data.kl_pairs import BatchKLPartners, batch_partners
    from megatron_kto.data.samplers import rank_share
    from megatron_kto.data.tokenizers import load_tokenizer
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks
    from megatron_kto.models.kto_model import REF_KL, REF_SAMPLES, KTOSettings, MegatronGPTKTOModel
    from megatron_kto.models.reference import SeparateReference
    from megatron_kto.models.schedule import to_device
    from megatron_kto.models.training_setup import wrap_ddp
    from megatron_kto.runtime import init_runtime

    # init_runtime re-creates megatron's groups for the new layout; the world stays up.
    rt = init_runtime(tp, pp, seed=11)
    root = Path(ckpt_dir)
    arch = read_architecture(root / "policy")
    layout = ParallelLayout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    policy = build_gpt_chunks(arch, layout, rt.device)
    load_model(root / "policy", policy)
    reference = build_gpt_chunks(arch, layout, rt.device)
    load_model(root / "reference", reference)
    settings = KTOSettings(
        beta=0.5,
        desirable_weight=1.0,
        undesirable_weight=1.3,
        loss_type="kto",
        sft_loss_weight=0.2,
        micro_batch_size=1,
        forward_micro_batch_size=1,
        vocab_size=arch.vocab_size,
    )
    chunks = wrap_ddp(policy, use_distributed_optimizer=False)
    model = MegatronGPTKTOModel(chunks, SeparateReference(reference), settings)

    tok = load_tokenizer("sentencepiece", str(TOKENIZER))
    dataset, _ = build_kto_dataset([TRAIN_DATA], tok, 64, use_cache=False)
    rows = list(range(GLOBAL_BATCH))
    partners = batch_partners(np.arange(GLOBAL_BATCH), 0, GLOBAL_BATCH, dataset.prompt_keys)
    keys = rank_share(rows, rt.data_parallel_rank, rt.data_parallel_size, partners)
    data = BatchKLPartners(dataset)
    collate = functools.partial(kto_custom_collate, pad_id=tok.pad_id, max_length=64)
    batch = to_device(collate([data[k] for k in keys]), rt.device)
    batch[REF_SAMPLES], batch[REF_KL] = model.get_ref_policy_logprobs(batch).chunk(2)
    for c in chunks:
        c.zero_grad_buffer()
    _, metrics = model.get_loss_and_metrics(batch, forward_only=False)
    return metrics


def _reference_worker(rank: int, world_size: int, ckpt_dir: str) -> dict[str, float]:
    from megatron_kto.checkpointing.model_io import save_model
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks
    from megatron_kto.runtime import init_runtime, teardown

    rt = init_runtime(1, 1, seed=3)
    arch = tiny_architecture()
    chunks = build_gpt_chunks(arch, ParallelLayout(), rt.device)
    for name in ("policy", "reference"):
        (Path(ckpt_dir) / name).mkdir()
    save_model(Path(ckpt_dir) / "reference", chunks, arch)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    save_model(Path(ckpt_dir) / "policy", chunks, arch)
    metrics = _step_metrics(1, 1, ckpt_dir)
    teardown()
    return metrics


def _layouts_worker(rank: int, world_size: int, ckpt_dir: str) -> dict[str, dict[str, float]]:
    from megatron_kto.runtime import teardown

    out = {name: _step_metrics(tp, pp, ckpt_dir) for name, (tp, pp) in LAYOUTS.items()}
    teardown()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ckpt_dir = str(tmp_path_factory.mktemp("kto_step"))
    single = run_multirank(_reference_worker, 1, ckpt_dir, timeout=240)[0]
    per_rank = run_multirank(_layouts_worker, 4, ckpt_dir, timeout=400)
    return single, per_rank


def test_reference_step_is_informative(results):
    single, _ = results
    assert single["kl"] > 0.1, "z₀ must be well above its clamp for the comparison to test it"
    assert single["rewards/chosen"] != single["rewards/rejected"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_tp1(results, name):
    single, per_rank = results
    for rank, reports in enumerate(per_rank):
        got = reports[name]
        assert got.keys() == single.keys()
        for key, want in single.items():
            assert got[key] == pytest.approx(want, rel=RTOL, abs=ATOL), (name, rank, key)
