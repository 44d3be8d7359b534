"""One megatron-core optimizer step gives the same weights under every parallel layout.

One spawn of 4 ranks. Rank 0 first runs the reference in a private world of one
(`multirank.solo_world`): TP=1/PP=1, the whole global batch on one rank (micro-batches of 2),
megatron-core `DistributedDataParallel` + `get_megatron_optimizer` (Adam, lr 1e-2, weight decay
0.01, global-norm clip 1.0, fp32), forward+backward through `run_schedule`, `optimizer.step()`.
It saves the initial weights and the stepped weights with `save_model`. Then all 4 ranks join
the real world and, for each layout, load the initial weights (resharded by dist_checkpointing),
take the same step on their DP shard of the batch (micro-batches of 1) and save the result.
Finally every stepped checkpoint is loaded into a TP=1/PP=1 model and compared to the
reference, parameter by parameter.

Loss scaling (why the layouts agree): the loss function returns the *mean* over its
micro-batch's rows; megatron's schedule divides it in place by the number of micro-batches and
megatron DDP scales gradients by 1/DP before its all-reduce (sum). So every layout computes the
gradient of the mean over the global batch, whatever the micro-batch size and DP degree.

The model ties input embedding and output layer, so PP>1 also exercises the embedding-group
gradient all-reduce between the first and last stage (megatron's `finalize_model_grads`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from multirank import run_multirank, solo_world
from test_parallel_common import (
    Layout,
    dp_shard,
    make_batch,
    tiny_arch,
    train_forward_step,
)

from megatron_kto.checkpointing.model_io import load_model, save_model
from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks, unwrap
from megatron_kto.models.schedule import run_schedule, split_micro_batches
from megatron_kto.runtime import init_runtime, teardown

pytestmark = pytest.mark.multirank

WORLD = 4
# (layout, use_distributed_optimizer)
CASES = [
    (Layout("tp2_dp2", tp=2, pp=1), False),
    (Layout("pp2_dp2", tp=1, pp=2), False),
    (Layout("dp4", tp=1, pp=1), False),
    (Layout("tp2_pp2", tp=2, pp=2), False),
    (Layout("pp2_vpp2_dp2", tp=1, pp=2, vpp=2), False),
    (Layout("dp4", tp=1, pp=1), True),
    (Layout("tp2_dp2", tp=2, pp=1), True),
]
TOLERANCE = 1e-5
# Not megatron's default 1e-8. Adam's first step moves a weight by lr·g/(|g|+eps) (g after
# clipping). Its slope lr/(4·eps) at |g|≈eps turned fp32 reduction-order differences of ~6e-10
# in the clipped gradient (measured between TP1 and TP2, gradients otherwise equal to 1e-8)
# into 2.4e-4 weight differences at eps=1e-8; and for |g| >> eps the step is just lr·sign(g),
# blind to a mis-scaled gradient. With eps=1e-5 most clipped gradients (median ~5e-6) sit in
# the linear regime, so the step tests gradient values, and the slope is 1000x smaller.
ADAM_EPS = 1e-5


def _case_id(case: tuple[Layout, bool]) -> str:
    layout, dist_opt = case
    return layout.name + ("_distopt" if dist_opt else "")


def _arch():
    return tiny_arch(share_embeddings_and_output_weights=True)


def _train_one_step(
    layout: ParallelLayout, init_ckpt: str, batch: dict, micro_batch_size: int, dist_opt: bool
) -> tuple[list, dict]:
    """Build, load `init_ckpt`, take one optimizer step on this rank's DP shard.

    Returns:
        (DDP-wrapped chunks, {"grad_norm", "losses"}).
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    arch = _arch()
    rt = init_runtime(
        layout.tensor_model_parallel_size,
        layout.pipeline_model_parallel_size,
        layout.virtual_pipeline_model_parallel_size,
        seed=2,
    )
    chunks = build_gpt_chunks(arch, layout, rt.device)
    load_model(init_ckpt, chunks)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=dist_opt,
    )
    config = chunks[0].config
    ddp = [
        DistributedDataParallel(
            config=config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0
        )
        for i, c in enumerate(chunks)
    ]
    # Without these hooks the schedule would skip the DP all-reduce and the tied-embedding sync.
    config.no_sync_func = [d.no_sync for d in ddp] if len(ddp) > 1 else ddp[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-2,
            weight_decay=0.01,
            adam_eps=ADAM_EPS,
            clip_grad=1.0,
            bf16=False,
            params_dtype=torch.float32,
            use_distributed_optimizer=dist_opt,
        ),
        ddp,
    )
    for d in ddp:
        d.zero_grad_buffer()
    optimizer.zero_grad()
    local = dp_shard(batch, rt.data_parallel_rank, rt.data_parallel_size)
    micro = split_micro_batches(local, micro_batch_size)
    reported = run_schedule(ddp, micro, train_forward_step, forward_only=False)
    ok, grad_norm, _ = optimizer.step()
    assert ok, "optimizer step skipped"
    is_last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    assert len(reported) == (len(micro) if is_last else 0)
    losses = [r["loss"].item() for r in reported]
    return ddp, {"grad_norm": float(grad_norm), "losses": losses}


def _state(chunks) -> dict[str, torch.Tensor]:
    return {
        k: v.detach().clone()
        for k, v in unwrap(chunks[0]).state_dict().items()
        if torch.is_tensor(v) and v.is_floating_point() and "_extra_state" not in k
    }


def _worker(rank: int, world_size: int, root: str) -> dict:
    arch = _arch()
    batch = make_batch(arch.vocab_size, seed=3)
    root_dir = Path(root)
    report: dict = {}
    if rank == 0:
        with solo_world():
            rt = init_runtime(1, 1, seed=1)
            init = build_gpt_chunks(arch, ParallelLayout(), rt.device)
            save_model(root_dir / "init", init, arch)
            ddp, info = _train_one_step(
                ParallelLayout(), str(root_dir / "init"), batch, micro_batch_size=2, dist_opt=False
            )
            save_model(root_dir / "reference", ddp, arch)
            report["reference"] = info
            teardown()

    # The real world forms only once rank 0 has finished the reference (init_process_group
    # waits for every rank), so "init" and "reference" exist from here on.
    for layout, dist_opt in CASES:
        name = _case_id((layout, dist_opt))
        (root_dir / name).mkdir(exist_ok=True)
        ddp, info = _train_one_step(
            layout.parallel_layout(), str(root_dir / "init"), batch, 1, dist_opt
        )
        save_model(root_dir / name, ddp, arch)
        report[name] = info

    rt = init_runtime(1, 1, seed=3)
    (model,) = build_gpt_chunks(arch, ParallelLayout(), rt.device)
    load_model(root_dir / "init", [model])
    initial = _state([model])
    load_model(root_dir / "reference", [model])
    reference = _state([model])
    report["max_update"] = max((reference[k] - initial[k]).abs().max().item() for k in initial)
    for case in CASES:
        load_model(root_dir / _case_id(case), [model])
        got = _state([model])
        assert got.keys() == reference.keys()
        diffs = {k: (got[k] - reference[k]).abs().max().item() for k in reference}
        report[_case_id(case)]["max_abs_diff"] = max(diffs.values())
        report[_case_id(case)]["worst_param"] = max(diffs, key=diffs.get)
    teardown()
    return report


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("optim_step")
    (root / "init").mkdir()
    (root / "reference").mkdir()
    return run_multirank(_worker, WORLD, str(root), timeout=300)


def test_reference_step_is_informative(reports):
    """The step moves weights well beyond the tolerance, and gradient clipping is active."""
    ref = reports[0]["reference"]
    assert reports[0]["max_update"] > 1e-3
    assert ref["grad_norm"] > 1.0, "clip_grad=1.0 should be exercised"
    assert len(ref["losses"]) == 4


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_step_matches_single_rank(reports, case):
    """Stepped weights under the layout equal the single-rank step to 1e-5, and so does the
    (pre-clip) global gradient norm that megatron reduces over TP/PP/DP."""
    ref = reports[0]["reference"]
    for rank, rep in enumerate(reports):
        got = rep[_case_id(case)]
        assert got["max_abs_diff"] <= TOLERANCE, f"rank {rank}: {got}"
        assert abs(got["grad_norm"] - ref["grad_norm"]) <= 1e-5 * ref["grad_norm"], (
            f"rank {rank}: grad norm {got['grad_norm']} vs {ref['grad_norm']}"
        )
