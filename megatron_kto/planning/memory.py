"""The per-rank memory plan of a run: will it fit, before anything is allocated.

    peak(rank) = weights + gradients + optimizer state      (`model_state`, exact)
               + reference                                  (the strategy's device share)
               + max(training activations, forward-only pass, (gloo) collective staging)

(`activations`; on CPU, gloo's reduce-scatter copies its whole input — measured: a 4 MB
reduce-scatter allocates 4 MB, an all-gather its output, NCCL neither — so the distributed
optimizer's gradient reduce-scatter stages one fp32 bucket there.)

Reference strategies (`model.kto.reference_policy`, README "Reference policy"), P = this rank's
parameter bytes (unpadded, param dtype): `cpu_swap` +2P host, 0 device; `separate` +P device (a
second model, no DDP buffers); `precomputed` no weights, a host table of (1 + epochs) floats per
example; `adapters_off` (LoRA) nothing: the reference is the policy with its adapters switched off.

The plan is for the longest micro-batch the run can see (every row `max_length` tokens, all
of them scored) unless the caller states the tokens. The ranks of a layout differ (the first
pipeline stage keeps the most micro-batches in flight, the last holds the output layer; DP
ranks' optimizer shards differ by padding), so `plan_run` evaluates every (PP rank, DP rank) and
reports the largest.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.peft.settings import (
    reference_strategy,
    targets_and_layers,
    tuning_value,
    uses_lora,
)
from megatron_kto.planning.activations import (
    ActivationInputs,
    activation_bytes,
    forward_only_bytes,
)
from megatron_kto.planning.model_state import (
    FP32,
    PARAM_BYTES,
    LoRAShape,
    ModelState,
    ParallelDims,
    largest_bucket,
    model_state,
)

GiB = 2**30


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's predicted device memory, in bytes, and the host memory the strategy adds."""

    pp_rank: int
    dp_rank: int
    weights: int
    gradients: int
    optimizer: int
    reference: int
    activations: int
    """Saved activations of the micro-batches in flight plus the largest transient."""
    forward_only: int
    """Peak working set of a forward-only (reference / KL) pass."""
    collectives: int
    """gloo only: the distributed optimizer's reduce-scatter stages a copy of a whole fp32
    gradient bucket (at the end of the backward, activations freed)."""
    reference_host: int
    in_flight: int
    layer_activation: int

    @property
    def model_state(self) -> int:
        return self.weights + self.gradients + self.optimizer

    @property
    def peak(self) -> int:
        transient = max(self.activations, self.forward_only, self.collectives)
        return self.model_state + self.reference + transient


def plan_rank(
    arch: GPTArchitecture,
    dims: ParallelDims,
    x: ActivationInputs,
    reference_policy: str,
    pp_rank: int = 0,
    dp_rank: int = 0,
    torch_adam_steps: bool = False,
    lora: LoRAShape | None = None,
    expert_dp_rank: int | None = None,
    state: ModelState | None = None,
) -> MemoryPlan:
    """The plan of the rank at (`pp_rank`, `dp_rank`) (a LoRA run's when `lora` is given; of
    expert-DP rank `expert_dp_rank` for an MoE model, None: `model_state`'s default; `state`:
    its `model_state`, if already computed)."""
    if state is None:
        state = model_state(arch, dims, pp_rank, dp_rank, torch_adam_steps, lora, expert_dp_rank)
    param_bytes = state.parameters * PARAM_BYTES[dims.precision]
    acts = activation_bytes(arch, dims, x, pp_rank, lora)
    return MemoryPlan(
        pp_rank=pp_rank,
        dp_rank=dp_rank,
        weights=state.weights,
        gradients=state.gradients,
        optimizer=state.optimizer,
        reference=param_bytes if reference_policy == "separate" else 0,
        activations=acts.total,
        forward_only=forward_only_bytes(arch, dims, x),
        collectives=FP32 * largest_bucket(arch, dims, pp_rank, lora)
        if x.gloo and dims.distributed_optimizer and dims.dp > 1
        else 0,
        reference_host=2 * param_bytes if reference_policy == "cpu_swap" else 0,
        in_flight=acts.in_flight,
        layer_activation=acts.layer,
    )


def worst_rank(
    arch: GPTArchitecture,
    dims: ParallelDims,
    x: ActivationInputs,
    reference_policy: str,
    torch_adam_steps: bool = False,
    lora: LoRAShape | None = None,
    states: dict[tuple[int, int], ModelState] | None = None,
) -> MemoryPlan:
    """The rank with the largest predicted peak (DP ranks only differ under the distributed
    optimizer, so only then are they all evaluated; an MoE model's DP rank d as expert-DP rank
    d mod expert-DP). `states`: `rank_states`' result, if already computed."""
    if states is None:
        states = rank_states(arch, dims, torch_adam_steps, lora)
    plans = [
        plan_rank(arch, dims, x, reference_policy, pp, dp, torch_adam_steps, lora, state=state)
        for (pp, dp), state in states.items()
    ]
    return max(plans, key=lambda p: p.peak)


def rank_states(
    arch: GPTArchitecture,
    dims: ParallelDims,
    torch_adam_steps: bool = False,
    lora: LoRAShape | None = None,
) -> dict[tuple[int, int], ModelState]:
    """`model_state` of every (PP rank, DP rank) whose state can differ (DP ranks only under
    the distributed optimizer)."""
    dp_ranks = range(dims.dp) if dims.distributed_optimizer else [0]
    return {
        (pp, dp): model_state(arch, dims, pp, dp, torch_adam_steps, lora)
        for pp in range(dims.pp)
        for dp in dp_ranks
    }


def run_inputs(
    cfg: Any, arch: GPTArchitecture, world_size: int, device_type: str, algorithm: str = "kto"
):
    """(`ParallelDims`, `ActivationInputs`, reference policy, `LoRAShape` or None) of a prepared
    run config, for its longest possible micro-batch (a DPO micro-batch holds `micro_batch_size`
    pairs: twice the rows)."""
    m = cfg.model
    tp, pp, cp = (
        m.tensor_model_parallel_size,
        m.pipeline_model_parallel_size,
        m.context_parallel_size,
    )
    # The gradient and distributed-optimizer groups span DP x CP (megatron-core's dp_cp group);
    # the data is split over DP alone, and each row over CP.
    dp = max(1, world_size // (tp * pp))
    data_dp = max(1, dp // cp)
    dims = ParallelDims(
        tp=tp,
        pp=pp,
        dp=dp,
        vpp=m.virtual_pipeline_model_parallel_size,
        sequence_parallel=m.sequence_parallel,
        precision=str(cfg.trainer.precision),
        distributed_optimizer=m.optim.name == "distributed_fused_adam",
        overlap_grad_reduce=m.optim.overlap_grad_sync,
        bucket_size=None
        if m.optim.bucket_cap_mb is None
        else max(1, int(m.optim.bucket_cap_mb * 2**20 / 4)),
        ep=m.expert_model_parallel_size,
        etp=m.expert_tensor_parallel_size,
        first=m.num_layers_in_first_pipeline_stage,
        last=m.num_layers_in_last_pipeline_stage,
    )
    loss = m.kto if algorithm == "kto" else m.dpo
    max_length = m.data.max_length or arch.encoder_seq_length
    rows = 1 if algorithm == "kto" else 2
    mbs = m.micro_batch_size * rows
    fwd = loss.log_prob_forward_micro_batch_size or m.micro_batch_size
    # Under CP a rank holds 1/CP of every row (`models.context_parallel`; the keys and values it
    # gathers per layer, 2 x groups/TP x head dim per token — MLA's heads/TP x (qk + v head
    # dims) — are not modelled).
    per_rank = -(-max_length // cp)
    x = ActivationInputs(
        tokens=mbs * per_rank,
        seq_len=per_rank,
        scored=mbs * per_rank,
        micro_batches=max(1, m.global_batch_size // (m.micro_batch_size * data_dp)),
        packed=m.data.pack_sequences,
        recompute=m.activations_checkpoint_granularity,
        recompute_method=m.activations_checkpoint_method,
        recompute_num_layers=m.activations_checkpoint_num_layers,
        chunk_size=m.logprob_chunk_size,
        forward_tokens=fwd * per_rank,
        native_gqa=device_type == "cpu" or dims.precision != "32",
        keep_pipeline_outputs=device_type != "cuda",
        gloo=device_type == "cpu",
    )
    return dims, x, reference_strategy(m, algorithm), run_lora(m)


def run_lora(model_cfg: Any) -> LoRAShape | None:
    """The `LoRAShape` of a run's `model` config (None without LoRA)."""
    if not uses_lora(model_cfg):
        return None
    targets, layers = targets_and_layers(model_cfg, model_cfg)  # the model config holds the shape
    return LoRAShape(
        rank=int(tuning_value(model_cfg, "adapter_dim")),
        targets=tuple(targets),
        layers=None if layers is None else tuple(layers),
    )


def size(n: float) -> str:
    """Bytes as '1.23 GiB' / '45.6 MiB' / '7.8 KiB'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{int(n)} B"


_PRECISION = {"32": "fp32", "bf16": "bf16", "16": "fp16"}


def format_plan(
    plan: MemoryPlan,
    dims: ParallelDims,
    x: ActivationInputs,
    device_bytes: int | None,
    device_name: str,
    reference_policy: str = "",
    lora: LoRAShape | None = None,
) -> list[str]:
    """A few lines for the start-up console: the largest rank's plan against the device."""
    layout = f"TP={dims.tp} PP={dims.pp}" + (f" VPP={dims.vpp}" if dims.vpp else "")
    layout += f" DP={dims.dp}" + (" SP" if dims.sequence_parallel else "")
    if dims.ep > 1 or dims.etp is not None:
        layout += f" EP={dims.ep} ETP={dims.expert_tp}"
    mbs = "micro-batch" if plan.in_flight == 1 else "micro-batches"
    reference = f"reference {size(plan.reference)}"
    if reference_policy == "none":  # losses.dpo_types.NO_REFERENCE
        reference = "no reference model (reference-free loss)"
    elif reference_policy:
        reference += f" ({reference_policy}" + (
            f", +{size(plan.reference_host)} host)" if plan.reference_host else ")"
        )
    lines = [
        f"memory plan per rank ({layout}, {_PRECISION[dims.precision]}, micro-batch of "
        f"{x.tokens} tokens{' packed' if x.packed else ''}, recompute {x.recompute or 'none'}; "
        f"largest: PP rank {plan.pp_rank}, DP rank {plan.dp_rank}"
        f"{f'; LoRA rank {lora.rank}: gradients and optimizer state of the adapters' if lora else ''}):",
        f"  weights {size(plan.weights)} | gradients {size(plan.gradients)} | optimizer "
        f"{size(plan.optimizer)}{' (sharded over DP)' if dims.distributed_optimizer else ''} | "
        f"{reference}",
        f"  activations {size(plan.activations)} ({plan.in_flight} {mbs} in flight, "
        f"{size(plan.layer_activation)} per layer each) | forward-only pass "
        f"{size(plan.forward_only)} | peak {size(plan.peak)}",
    ]
    if device_bytes:
        verdict = (
            "fits"
            if plan.peak <= device_bytes
            else "EXCEEDS it: lower model.micro_batch_size, raise TP/PP, turn on activation "
            "recomputation or the distributed optimizer (tools/plan_layout.py suggests a layout)"
        )
        prefix = "  " if plan.peak <= device_bytes else "warning: "
        lines.append(
            f"{prefix}{device_name}: {size(device_bytes)}, peak {plan.peak / device_bytes:.0%}: "
            f"{verdict}"
        )
    else:
        lines.append(f"  {device_name}: no device memory limit (information only)")
    return lines


def with_tokens(x: ActivationInputs, tokens: int, scored: int, seq_len: int) -> ActivationInputs:
    """`x` for a measured micro-batch shape instead of the longest possible one."""
    return replace(x, tokens=tokens, scored=scored, seq_len=seq_len, forward_tokens=0)


def startup_lines(
    cfg: Any, arch: GPTArchitecture, world_size: int, device: Any, algorithm: str = "kto"
) -> list[str]:
    """The start-up report of a prepared run on `device` (a `torch.device`): its worst rank's
    plan against the device's memory on CUDA, as information elsewhere."""
    import torch

    try:
        from megatron.core.optimizer import USING_PYTORCH_OPTIMIZER as torch_adam
    except ImportError:  # megatron-core moved it: the steps are a few bytes either way
        torch_adam = False
    dims, x, strategy, lora = run_inputs(cfg, arch, world_size, device.type, algorithm)
    plan = worst_rank(arch, dims, x, strategy, torch_adam, lora)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return format_plan(plan, dims, x, props.total_memory, props.name, strategy, lora)
    return format_plan(plan, dims, x, None, device.type.upper(), strategy, lora)
