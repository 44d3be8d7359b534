"""Sequence parallelism without Transformer Engine: one KTO step with SP equals the step without
it, and activation recomputation under SP replays dropout exactly (2 gloo ranks, TP=2, fp32).

Rank 0 saves a reference checkpoint and a policy checkpoint (reference + noise, so that r > 0
on the KL rows and z₀ > 0 is exercised), as `test_kto_model_parallel.py` does. Both ranks then
take one full KTO training step per variant through the real path — `MegatronGPTKTOModel`
(reference pass, forward-only KL pass → z₀, forward+backward over the samples in micro-batches),
megatron DDP with `finalize_model_grads`, megatron's Adam optimizer — on the same global batch of
bundled examples, whose length is made odd so the automatic padding to a multiple of TP runs.

Each rank compares its own TP shard of every weight after the step across variants (same
layout, so the shards correspond one to one), plus the loss, z₀ (`kl`), every TRL metric and the
optimizer's global gradient norm.

A control variant removes the `sequence_parallel` mark from the norms' parameters: then
megatron-core no longer sums their gradients over the TP group and the step must differ —
the SP comparison is able to fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from e2e_cli import TOKENIZER, TRAIN_DATA, tiny_architecture
from multirank import run_multirank, solo_world

pytestmark = pytest.mark.multirank

WORLD = 2
GLOBAL_BATCH = 8
RTOL = 1e-5
WEIGHT_TOL = 1e-5
# See test_parallel_optimizer.py: an Adam eps far above fp32 reduction noise keeps the first
# step's update proportional to the gradient instead of lr·sign(g).
ADAM_EPS = 1e-5
DROPOUT = {"hidden_dropout": 0.1, "attention_dropout": 0.1}
#: name -> (ParallelLayout overrides (TP=2 always), architecture overrides, clear the norms'
#: SP marks, the variant it must equal (None: it is a baseline))
VARIANTS = {
    "sp_off": ({"sequence_parallel": False}, {}, False, None),
    "sp_on": ({"sequence_parallel": True}, {}, False, "sp_off"),
    "sp_off_local_attention": (
        {"sequence_parallel": False, "attention_backend": "local"},
        {},
        False,
        None,
    ),
    "sp_on_local_attention": (
        {"sequence_parallel": True, "attention_backend": "local"},
        {},
        False,
        "sp_off_local_attention",
    ),
    "sp_on_unmarked_norms": ({"sequence_parallel": True}, {}, True, "sp_off"),
    "sp_dropout": ({"sequence_parallel": True}, DROPOUT, False, "sp_off"),
    "sp_dropout_selective": (
        {"sequence_parallel": True, "activations_checkpoint_granularity": "selective"},
        DROPOUT,
        False,
        "sp_dropout",
    ),
    "sp_dropout_full_uniform": (
        {
            "sequence_parallel": True,
            "activations_checkpoint_granularity": "full",
            "activations_checkpoint_method": "uniform",
            "activations_checkpoint_num_layers": 1,
        },
        DROPOUT,
        False,
        "sp_dropout",
    ),
}


def _odd_length_batch(rt, tokenizer) -> dict[str, torch.Tensor]:
    """The first GLOBAL_BATCH bundled examples (all on this rank: DP=1) with their in-batch KL
    rows, collated by `kto_custom_collate`, plus one pad column when the length is even (TP=2
    must then pad it back to an even length)."""
    from megatron_kto.data.collate import IGNORE_INDEX, kto_custom_collate
    from megatron_kto.data.dataset import build_kto_dataset
    from megatron_kto.models.schedule import to_device

    dataset, _ = build_kto_dataset([TRAIN_DATA], tokenizer, 64, use_cache=False)
    examples = [dataset[i] for i in range(GLOBAL_BATCH)]
    batch = kto_custom_collate(examples, pad_id=tokenizer.pad_id, max_length=64)
    length = batch["samples"].shape[1]
    if length % 2 == 0:
        fills = {
            "samples": tokenizer.pad_id,
            "kl_samples": tokenizer.pad_id,
            "sample_labels": IGNORE_INDEX,
            "kl_sample_labels": IGNORE_INDEX,
            "position_ids": length,
        }
        for key, fill in fills.items():
            batch[key] = torch.nn.functional.pad(batch[key], (0, 1), value=fill)
    return to_device(batch, rt.device)


def _float_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: v.detach().clone()
        for k, v in model.state_dict().items()
        if torch.is_tensor(v) and v.is_floating_point() and "_extra_state" not in k
    }


def _kto_step(ckpt_dir: Path, name: str) -> dict:
    """One KTO training step of `name` at TP=2; metrics, grad norm, this rank's weight shards."""
    from megatron_kto.checkpointing.model_io import load_model, read_architecture
    from megatron_kto.data.tokenizers import load_tokenizer
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks, unwrap
    from megatron_kto.models.kto_model import REF_KL, REF_SAMPLES, KTOSettings, MegatronGPTKTOModel
    from megatron_kto.models.norms import LocalNorm
    from megatron_kto.models.reference import SeparateReference
    from megatron_kto.models.training_setup import build_optimizer, wrap_ddp, zero_grads
    from megatron_kto.runtime import init_runtime

    layout_overrides, arch_overrides, unmark_norms, _ = VARIANTS[name]
    rt = init_runtime(2, 1, seed=11)
    arch = read_architecture(ckpt_dir / "policy")
    for key, value in arch_overrides.items():
        setattr(arch, key, value)
    layout = ParallelLayout(tensor_model_parallel_size=2, **layout_overrides)
    policy = build_gpt_chunks(arch, layout, rt.device)
    load_model(ckpt_dir / "policy", policy)
    reference = build_gpt_chunks(arch, layout, rt.device)
    load_model(ckpt_dir / "reference", reference)
    if unmark_norms:
        for module in policy[0].modules():
            if isinstance(module, LocalNorm):
                for p in module.parameters():
                    p.sequence_parallel = False
    settings = KTOSettings(
        beta=0.5,
        desirable_weight=1.0,
        undesirable_weight=1.3,
        loss_type="kto",
        sft_loss_weight=0.2,
        micro_batch_size=2,
        forward_micro_batch_size=4,
        vocab_size=arch.vocab_size,
        # megatron's unfused attention cannot take packed rows (config validation refuses it).
        pack_sequences=layout.attention_backend != "local",
    )
    chunks = wrap_ddp(policy, use_distributed_optimizer=False)
    optimizer = build_optimizer(
        chunks,
        lr=1e-2,
        min_lr=1e-2,
        weight_decay=0.01,
        betas=(0.9, 0.98),
        eps=ADAM_EPS,
        clip_grad=1.0,
        precision="32",
        use_distributed_optimizer=False,
    )
    model = MegatronGPTKTOModel(chunks, SeparateReference(reference), settings)
    initial = _float_state(unwrap(chunks[0]))
    batch = _odd_length_batch(rt, load_tokenizer("sentencepiece", str(TOKENIZER)))
    batch[REF_SAMPLES], batch[REF_KL] = model.get_ref_policy_logprobs(batch).chunk(2)
    zero_grads(chunks, optimizer)
    _, metrics = model.get_loss_and_metrics(batch, forward_only=False)
    ok, grad_norm, _ = optimizer.step()
    assert ok, "optimizer step skipped"
    weights = _float_state(unwrap(chunks[0]))
    return {
        "metrics": metrics,
        "grad_norm": float(grad_norm),
        "weights": weights,
        "max_update": max((weights[k] - initial[k]).abs().max().item() for k in weights),
        "length": batch["samples"].shape[1],
    }


def _worker(rank: int, world_size: int, root: str) -> dict:
    from megatron_kto.checkpointing.model_io import save_model
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks
    from megatron_kto.runtime import init_runtime, teardown

    ckpt_dir = Path(root)
    if rank == 0:
        with solo_world():
            rt = init_runtime(1, 1, seed=3)
            arch = tiny_architecture()
            chunks = build_gpt_chunks(arch, ParallelLayout(), rt.device)
            save_model(ckpt_dir / "reference", chunks, arch)
            g = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for p in chunks[0].parameters():
                    p.add_(0.1 * torch.randn(p.shape, generator=g))
            save_model(ckpt_dir / "policy", chunks, arch)
            teardown()
    steps = {name: _kto_step(ckpt_dir, name) for name in VARIANTS}
    teardown()
    base = steps["sp_off"]
    report: dict = {
        "length": base["length"],
        "metrics": base["metrics"],
        "max_update": base["max_update"],
    }
    for name, step in steps.items():
        reference = steps[VARIANTS[name][3] or name]
        diffs = {
            k: (step["weights"][k] - reference["weights"][k]).abs().max().item()
            for k in reference["weights"]
        }
        report[name] = {
            "metrics": step["metrics"],
            "grad_norm": step["grad_norm"],
            "reference_grad_norm": reference["grad_norm"],
            "reference_metrics": reference["metrics"],
            "weight_max_abs_diff": max(diffs.values()),
            "worst_weight": max(diffs, key=diffs.get),
            "norm_weight_max_abs_diff": max(v for k, v in diffs.items() if "layernorm" in k),
        }
    return report


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("sequence_parallel")
    for sub in ("policy", "reference"):
        (root / sub).mkdir()
    return run_multirank(_worker, WORLD, str(root), timeout=400)


def test_step_is_informative(reports):
    """Odd length (so padding ran), z₀ well above its clamp, distinct class rewards, and the step
    moves the weights by far more than the comparison tolerance."""
    rep = reports[0]
    assert rep["length"] % 2 == 1
    assert rep["max_update"] > 100 * WEIGHT_TOL
    assert rep["metrics"]["kl"] > 0.1
    assert rep["metrics"]["rewards/chosen"] != rep["metrics"]["rewards/rejected"]


def _assert_same_step(got: dict, rank: int, name: str, exact: bool) -> None:
    want = got["reference_metrics"]
    print(
        f"\n{name} rank {rank}: weights max |diff| {got['weight_max_abs_diff']:.1e} "
        f"({got['worst_weight']}), grad norm {got['grad_norm']:.6g} vs "
        f"{got['reference_grad_norm']:.6g}"
    )
    assert got["metrics"].keys() == want.keys()
    # Rewards and z₀ are β × differences of summed log-probs: their fp32 rounding scales with
    # the sums, not with the (small) difference — 1e-6 of the sums' size — and packed
    # micro-batches under SP (padded to a multiple of TP) run other GEMM shapes than without SP.
    logp_scale = max(1.0, *(abs(v) for k, v in want.items() if k.startswith("logps/")))
    for key, value in want.items():
        if exact:
            assert got["metrics"][key] == value, (name, rank, key)
        else:
            assert got["metrics"][key] == pytest.approx(value, rel=RTOL, abs=1e-6 * logp_scale), (
                name,
                key,
            )
    if exact:
        assert got["grad_norm"] == got["reference_grad_norm"]
        assert got["weight_max_abs_diff"] == 0.0, got["worst_weight"]
    else:
        assert got["grad_norm"] == pytest.approx(got["reference_grad_norm"], rel=RTOL)
        assert got["weight_max_abs_diff"] <= WEIGHT_TOL, got["worst_weight"]


@pytest.mark.parametrize("name", ["sp_on", "sp_on_local_attention"])
def test_sequence_parallel_step_equals_no_sequence_parallel(reports, name):
    """Loss, z₀, metrics, grad norm to 1e-5 relative and every updated weight shard to 1e-5,
    with SDPA and with megatron's local attention."""
    for rank, rep in enumerate(reports):
        _assert_same_step(rep[name], rank, name, exact=False)


def test_unmarked_norms_break_the_step(reports):
    """Control: without the `sequence_parallel` mark the norms' gradients are not summed over TP,
    and the updated norm weights move away from the SP-off step by far more than the tolerance."""
    for rep in reports:
        got = rep["sp_on_unmarked_norms"]
        assert got["norm_weight_max_abs_diff"] > 100 * WEIGHT_TOL, got


@pytest.mark.parametrize("name", ["sp_dropout_selective", "sp_dropout_full_uniform"])
def test_recompute_under_sequence_parallel_replays_dropout(reports, name):
    """Hidden and attention dropout 0.1 under SP: recomputation gives bitwise the step of the
    run that keeps its activations (metrics, grad norm, weights); dropout really acts (the
    dropout step differs from the dropout-free one)."""
    for rank, rep in enumerate(reports):
        _assert_same_step(rep[name], rank, name, exact=True)
        assert rep["sp_dropout"]["weight_max_abs_diff"] > 100 * WEIGHT_TOL
