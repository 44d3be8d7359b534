"""Distributed optimizer with overlapped DP collectives (the default) trains exactly like without.

`overlap_param_gather` leaves each rank's parameters updated only in its own optimizer shard
after a step; forward pre-hooks gather the rest during the next forward pass. The `cpu_swap`
reference swap and checkpoint saves touch parameters *outside* a forward pass, so they must
finish that gather first (`training_setup.finish_param_sync`). On 4 ranks (PP=2 x DP=2), 3 KTO
steps with the cpu_swap reference are run with both overlaps off and on, and twice more with
one of the two `finish_param_sync` calls removed, to show each is needed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from multirank import run_multirank

pytestmark = pytest.mark.multirank

STEPS = 3


def _train(overlap: bool, root: Path) -> dict:
    import torch
    from test_checkpoint_harness import params_from_model_checkpoint
    from test_kto_model import VOCAB, _batch, _settings

    from megatron_kto.checkpointing.manager import CheckpointManager
    from megatron_kto.config.architecture import GPTArchitecture
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks, unwrap
    from megatron_kto.models.kto_model import REF_KL, REF_SAMPLES, MegatronGPTKTOModel
    from megatron_kto.models.reference import CPUSwapReference
    from megatron_kto.models.training_setup import (
        build_optimizer,
        finish_param_sync,
        wrap_ddp,
        zero_grads,
    )
    from megatron_kto.runtime import init_runtime

    rt = init_runtime(1, 2, seed=5)
    arch = GPTArchitecture(vocab_size=VOCAB, num_layers=2, hidden_size=32, ffn_hidden_size=64)
    chunks = wrap_ddp(
        build_gpt_chunks(arch, ParallelLayout(pipeline_model_parallel_size=2), rt.device),
        use_distributed_optimizer=True,
        overlap_grad_reduce=overlap,
        overlap_param_gather=overlap,
    )
    optimizer = build_optimizer(
        chunks,
        lr=5e-2,
        min_lr=0.0,
        weight_decay=0.0,
        betas=(0.9, 0.98),
        eps=1e-8,
        clip_grad=1.0,
        precision="32",
        use_distributed_optimizer=True,
    )
    model = MegatronGPTKTOModel(chunks, CPUSwapReference(chunks), _settings(2))
    losses, refs = [], []
    for step in range(STEPS):
        batch = _batch(seed=step)
        ref = model.get_ref_policy_logprobs(batch)
        # The reference scores of one fixed batch, each step: must never change.
        refs.append(model.get_ref_policy_logprobs(_batch(seed=99)))
        batch[REF_SAMPLES], batch[REF_KL] = ref.chunk(2)
        zero_grads(chunks, optimizer)
        loss, _ = model.get_loss_and_metrics(batch, forward_only=False)
        losses.append(loss)
        optimizer.step()
    manager = CheckpointManager(root / "ckpt")
    manager.save(STEPS, chunks, optimizer, None, {"epoch": 0, "consumed_samples": 0}, "", arch)
    finish_param_sync(chunks)
    params = {f"0.{n}": p.detach().clone() for n, p in unwrap(chunks[0]).named_parameters()}

    class _Run:  # what params_from_model_checkpoint needs
        pass

    run = _Run()
    run.arch = arch
    saved = params_from_model_checkpoint(root / "ckpt" / f"step_{STEPS}", run)
    return {
        "losses": losses,
        "refs": torch.stack(refs),
        "params": params,
        "saved_equals_live": all(torch.equal(saved[k], params[k]) for k in params),
    }


def _worker(rank: int, world_size: int, tmp: str) -> dict:
    import torch

    from megatron_kto.checkpointing import manager as manager_mod
    from megatron_kto.models import reference as reference_mod
    from megatron_kto.runtime import teardown

    tmp_path = Path(tmp)
    out = {"off": _train(False, tmp_path / "off"), "on": _train(True, tmp_path / "on")}
    for name, module in (("no_sync_in_swap", reference_mod), ("no_sync_in_save", manager_mod)):
        original = module.finish_param_sync
        module.finish_param_sync = lambda chunks: None
        try:
            out[name] = _train(True, tmp_path / name)
        finally:
            module.finish_param_sync = original
    base = out["off"]
    summary = {}
    for name, run in out.items():
        summary[name] = {
            "loss_diff": max(abs(a - b) for a, b in zip(run["losses"], base["losses"])),
            "ref_diff": (run["refs"] - base["refs"]).abs().max().item(),
            "param_diff": max(
                (run["params"][k] - base["params"][k]).abs().max().item() for k in base["params"]
            ),
            "saved_equals_live": run["saved_equals_live"],
        }
    summary["reference_moves"] = (base["refs"][0] - base["refs"][-1]).abs().max().item()
    summary["cpu"] = not torch.cuda.is_available()
    teardown()
    return summary


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_multirank(_worker, 4, str(tmp_path_factory.mktemp("overlap")), timeout=400)


def test_overlapped_collectives_change_nothing(results) -> None:
    for r in results:
        on = r["on"]
        assert on["loss_diff"] == 0.0 and on["ref_diff"] == 0.0 and on["param_diff"] == 0.0, on
        assert on["saved_equals_live"] and r["off"]["saved_equals_live"]
        assert r["reference_moves"] == 0.0, "the reference must stay the initial weights"


def test_swap_without_param_sync_trains_on_stale_shards(results) -> None:
    for r in results:
        assert r["no_sync_in_swap"]["param_diff"] > 1e-3, r["no_sync_in_swap"]


def test_save_without_param_sync_writes_stale_shards(results) -> None:
    for r in results:
        broken = r["no_sync_in_save"]
        assert broken["param_diff"] == 0.0  # training itself is fine...
    assert not any(r["no_sync_in_save"]["saved_equals_live"] for r in results)  # ...the file not
