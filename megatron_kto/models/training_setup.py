"""Wire model chunks into megatron-core's training machinery: DDP, optimizer, LR schedule.

Nothing here re-implements megatron-core: it configures `DistributedDataParallel`,
`get_megatron_optimizer` and `OptimizerParamScheduler`, and installs the hooks the pipeline
schedules expect on the `TransformerConfig` (no_sync, finalize_model_grads).
"""

from __future__ import annotations

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP, TEGroupedMLP

from megatron_kto.runtime.gpu_settings import ddp_overlap_settings

#: megatron-core's routed-expert containers (shared experts are dense: not among them).
_EXPERT_MODULES = (GroupedMLP, SequentialMLP, TEGroupedMLP)
_DECAY_STYLE = {"CosineAnnealing": "cosine", "Constant": "constant", "Linear": "linear"}


def mark_experts_expert_parallel(chunk: torch.nn.Module) -> int:
    """Give every routed-expert parameter megatron-core's expert-parallel mark at any EP size.

    megatron-core marks expert weights `allreduce=False` only when EP > 1; DDP and
    `get_megatron_optimizer` then put them in their own gradient buffers and their own optimizer
    (reduced over the expert-data-parallel group), while at EP = 1 they share the dense one. The
    optimizer's state would then have a different structure at each EP size and a checkpoint
    could not resume at another one. Marked at EP = 1 too, the experts always get their own
    optimizer; the expert-data-parallel group is then the data-parallel group, so gradients and
    updates are the same (megatron-core's own EP = 1 grouping only sums in another order).
    Returns the number of parameters marked.
    """
    marked = 0
    for module in chunk.modules():
        if isinstance(module, _EXPERT_MODULES):
            for param in module.parameters():
                param.allreduce = False
                marked += 1
    return marked


def wrap_ddp(
    chunks: list[torch.nn.Module],
    use_distributed_optimizer: bool,
    overlap_grad_reduce: bool | None = None,
    bucket_size: int | None = None,
    overlap_param_gather: bool | None = None,
) -> list[DistributedDataParallel]:
    """Wrap each chunk in megatron-core DDP (contiguous fp32 grad buffers) and set schedule hooks.

    Args:
        chunks: this rank's model chunks.
        use_distributed_optimizer: shard optimizer state over DP (ZeRO-1).
        overlap_grad_reduce, overlap_param_gather: overlap the DP collectives with compute;
            None = on with the distributed optimizer (`gpu_settings.ddp_overlap_settings`).
        bucket_size: elements per reduction bucket (None: megatron-core's default).

    Returns:
        The DDP-wrapped chunks.
    """
    ddp_config = DistributedDataParallelConfig(
        # Gradients are accumulated and reduced in fp32 whatever the parameter dtype (bf16).
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=use_distributed_optimizer,
        bucket_size=bucket_size,
        **ddp_overlap_settings(
            use_distributed_optimizer, overlap_grad_reduce, overlap_param_gather
        ),
    )
    config = chunks[0].config
    for chunk in chunks:
        mark_experts_expert_parallel(chunk)
    wrapped = [
        DistributedDataParallel(
            config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0
        )
        for i, chunk in enumerate(chunks)
    ]
    # The schedules call these: without finalize_model_grads no DP all-reduce (or tied-embedding
    # sync across pipeline stages) would happen.
    config.no_sync_func = [c.no_sync for c in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def build_optimizer(
    ddp_chunks: list[DistributedDataParallel],
    *,
    lr: float,
    min_lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    clip_grad: float,
    precision: str,
    use_distributed_optimizer: bool,
):
    """megatron-core Adam(W) over the DDP chunks.

    Args:
        precision: '32', 'bf16' or '16'. Half precision keeps fp32 main weights in the
            optimizer; '16' adds megatron-core's dynamic loss scaling (starting at 2^16 as
            torch's GradScaler does — megatron's 2^32 default skips the first ~30 steps), whose
            scale the pipeline schedules apply through `grad_scale_func` (installed here).
    """
    bf16, fp16 = precision == "bf16", precision == "16"
    config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=min_lr,
        weight_decay=weight_decay,
        adam_beta1=betas[0],
        adam_beta2=betas[1],
        adam_eps=eps,
        clip_grad=clip_grad,
        bf16=bf16,
        fp16=fp16,
        initial_loss_scale=2.0**16,
        params_dtype=torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(config, ddp_chunks)
    if fp16:
        # The schedules multiply the loss by this before backward (megatron-core's contract).
        ddp_chunks[0].config.grad_scale_func = optimizer.scale_loss
    return optimizer


def build_scheduler(
    optimizer,
    *,
    name: str,
    lr: float,
    min_lr: float,
    warmup_steps: int,
    constant_steps: int,
    max_steps: int,
    weight_decay: float,
) -> OptimizerParamScheduler:
    """Warm-up + cosine/linear/constant LR schedule, stepped once per optimizer step."""
    decay_steps = max(1, max_steps - constant_steps)
    return OptimizerParamScheduler(
        optimizer,
        # Warm-up step k (0-based) uses lr·(k+1)/(warmup+1), so the first update is not lr 0.
        init_lr=lr / (warmup_steps + 1),
        max_lr=lr,
        min_lr=min_lr if name != "Constant" else lr,
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=max(decay_steps, warmup_steps + 1),
        lr_decay_style=_DECAY_STYLE[name],
        start_wd=weight_decay,
        end_wd=weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )


def zero_grads(ddp_chunks: list[DistributedDataParallel], optimizer) -> None:
    """Clear DDP grad buffers and the optimizer's grads before a step."""
    for chunk in ddp_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()


def finish_param_sync(chunks: list[torch.nn.Module]) -> None:
    """Complete the parameter all-gather that `overlap_param_gather` defers to the next forward.

    With it, an optimizer step leaves each rank's parameters updated only in its own distributed
    optimizer shard; the other shards are gathered by forward pre-hooks of the next forward
    pass. Code that reads or overwrites parameters outside a forward pass (the `cpu_swap`
    reference swap, checkpoint saves) must call this first, or it sees (and would restore) stale
    shards. A no-op for chunks without deferred gathers.
    """
    for chunk in chunks:
        if getattr(chunk, "use_forward_hook", False):
            chunk.start_param_sync(force_sync=True)
