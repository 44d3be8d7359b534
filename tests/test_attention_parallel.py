"""The SDPA backend under TP=2, PP=2 and TP=2 + sequence parallel equals megatron's local spec
at TP=1, in log-probs and in gradients (2 gloo ranks, fp32).

Rank 0 first builds a TP=1 model with megatron-core's own local spec (`attention_backend=local`:
unfused `DotProductAttention`), saves it as the starting point, and records the reference: the
per-token log-probs of a plain forward over the batch, and the gradient of the batch-mean loss
(`test_parallel_common.mean_completion_logprob_loss`) for every parameter. Then both ranks, for
each layout, build the model with `attention_backend=sdpa` at another seed, load the starting
point (dist_checkpointing reshards), run megatron's schedules over micro-batches of one row:
forward-only for log-probs, forward+backward (megatron DDP, finalize_model_grads) for gradients.

Gradients are compared in full by writing them *as the weights* of the model (param ← main_grad)
and saving that with `save_model`: dist_checkpointing then reassembles the TP/PP shards, and a
TP=1 model loads them for a tensor-by-tensor comparison with the reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from multirank import run_multirank, solo_world
from test_parallel_common import (
    SEQ_LEN,
    Layout,
    logprob_forward_step,
    make_batch,
    mean_completion_logprob_loss,
    tiny_arch,
    train_forward_step,
)

from megatron_kto.checkpointing.model_io import load_model, save_model
from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks, unwrap
from megatron_kto.models.logprobs import token_logprobs
from megatron_kto.models.schedule import (
    broadcast_from_last_stage,
    run_schedule,
    split_micro_batches,
)
from megatron_kto.models.training_setup import wrap_ddp
from megatron_kto.runtime import init_runtime, teardown

pytestmark = pytest.mark.multirank

WORLD = 2
#: name -> (layout, sequence_parallel)
LAYOUTS = {
    "tp2": (Layout("tp2", tp=2, pp=1), False),
    "pp2": (Layout("pp2", tp=1, pp=2), False),
    "tp2_sp": (Layout("tp2_sp", tp=2, pp=1), True),
}
TOLERANCE = 1e-5


def _float_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: v.detach().clone()
        for k, v in unwrap(model).state_dict().items()
        if torch.is_tensor(v) and v.is_floating_point() and "_extra_state" not in k
    }


def _grads_as_weights(chunks: list[torch.nn.Module], use_main_grad: bool) -> None:
    """Overwrite every parameter with its gradient, so that saving the model saves the grads."""
    with torch.no_grad():
        for chunk in chunks:
            for p in chunk.parameters():
                p.copy_(p.main_grad if use_main_grad else p.grad)


def _reference(root: Path, arch, batch: dict) -> torch.Tensor:
    """TP=1, megatron's local attention: save the start weights and the reference grads."""
    rt = init_runtime(1, 1, seed=1)
    (model,) = build_gpt_chunks(arch, ParallelLayout(attention_backend="local"), rt.device)
    save_model(root / "init", [model], arch)
    logits = model(batch["samples"], batch["position_ids"], None)
    # megatron's vocab-parallel cross entropy normalises fp32 logits in place: use a copy.
    logp = token_logprobs(logits.detach().clone(), batch["labels"])
    loss, _ = mean_completion_logprob_loss(batch, logits)
    loss.backward()
    _grads_as_weights([model], use_main_grad=False)
    save_model(root / "reference_grads", [model], arch)
    teardown()
    return logp.detach()


def _layout_run(root: Path, arch, batch: dict, name: str) -> torch.Tensor:
    """Log-probs [B, T] (every rank) under the layout; saves its gradients as `grads_<name>`."""
    from megatron.core import parallel_state

    layout, sequence_parallel = LAYOUTS[name]
    rt = init_runtime(layout.tp, layout.pp, seed=2)
    parallel = ParallelLayout(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        sequence_parallel=sequence_parallel,
        attention_backend="sdpa",
    )
    chunks = build_gpt_chunks(arch, parallel, rt.device)
    load_model(root / "init", chunks)
    micro = split_micro_batches(batch, micro_batch_size=1)
    for c in chunks:
        c.eval()
    with torch.no_grad():
        results = run_schedule(
            chunks, micro, logprob_forward_step, forward_only=True, collect_non_loss_data=True
        )
    is_last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    logp = broadcast_from_last_stage(
        torch.cat(results) if is_last else None, batch["labels"].shape, torch.float32, rt.device
    )
    ddp = wrap_ddp(chunks, use_distributed_optimizer=False)
    for c in ddp:
        c.train()
        c.zero_grad_buffer()
    run_schedule(ddp, micro, train_forward_step, forward_only=False)
    _grads_as_weights(ddp, use_main_grad=True)
    save_model(root / f"grads_{name}", ddp, arch)
    return logp


def _worker(rank: int, world_size: int, root: str) -> dict:
    root_dir = Path(root)
    arch = tiny_arch()
    batch = make_batch(arch.vocab_size, seed=4)
    report: dict = {}
    if rank == 0:
        with solo_world():
            report["reference_logprobs"] = _reference(root_dir, arch, batch)
    # The 2-rank world forms only after rank 0's reference is saved (init waits for all ranks).
    for name in LAYOUTS:
        report[name] = {"logprobs": _layout_run(root_dir, arch, batch, name)}

    rt = init_runtime(1, 1, seed=3)
    (model,) = build_gpt_chunks(arch, ParallelLayout(attention_backend="local"), rt.device)
    load_model(root_dir / "reference_grads", [model])
    reference = _float_state(model)
    report["min_reference_grad"] = min(g.abs().max().item() for g in reference.values())
    for name in LAYOUTS:
        load_model(root_dir / f"grads_{name}", [model])
        got = _float_state(model)
        assert got.keys() == reference.keys()
        diffs = {k: (got[k] - reference[k]).abs().max().item() for k in reference}
        worst = max(diffs, key=diffs.get)
        report[name]["grad_max_abs_diff"] = diffs[worst]
        report[name]["worst_grad"] = worst
    teardown()
    return report


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("sdpa_parallel")
    for sub in ("init", "reference_grads", *(f"grads_{n}" for n in LAYOUTS)):
        (root / sub).mkdir()
    return run_multirank(_worker, WORLD, str(root), timeout=300)


def test_reference_is_informative(reports):
    ref = reports[0]["reference_logprobs"]
    assert ref.shape[1] == SEQ_LEN
    assert ref[ref != 0].std() > 0.3
    assert reports[0]["min_reference_grad"] > 1e-3, "every parameter has a real gradient"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sdpa_layout_matches_local_tp1(reports, name):
    """Every rank's log-probs and the reassembled gradient of every parameter equal the TP=1
    local-spec reference to 1e-5."""
    ref = reports[0]["reference_logprobs"]
    for rank, rep in enumerate(reports):
        got = rep[name]
        print(
            f"\n{name} rank {rank}: log-probs max |diff| "
            f"{(got['logprobs'] - ref).abs().max().item():.1e}, gradients max |diff| "
            f"{got['grad_max_abs_diff']:.1e} ({got['worst_grad']})"
        )
        assert (got["logprobs"] - ref).abs().max() <= TOLERANCE, (rank, name)
        assert got["grad_max_abs_diff"] <= TOLERANCE, (rank, name, got["worst_grad"])
