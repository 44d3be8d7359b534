"""Optimizer state in dist checkpoints, with our workarounds for megatron-core 0.16.1.

Both megatron optimizers store their state as sharded tensors keyed by the model parameters'
global names, so a checkpoint reshards to another TP/PP/DP layout: the non-distributed
optimizer natively, the distributed optimizer with the `fully_reshardable` format.

Distributed-optimizer formats in megatron-core 0.16.1 (`DistributedOptimizer.sharded_state_dict`):
`fully_sharded_model_space` (its default) cannot be saved at all — dist_checkpointing rejects its
flattened ShardedTensors ("flattened_range is not supported", mapping.py); `dp_reshardable`
saves each rank's shard without any exchange but only reshards over DP (TP and PP must stay);
`fully_reshardable` stores model-shaped tensors that load under any layout. It gathers each
model-parallel shard's fp32 state (param, exp_avg, exp_avg_sq: 12 bytes per parameter) on the
host; by default with an all-gather to every DP rank, with megatron-core's memory-efficient
option (`distrib_optim_fully_reshardable_mem_efficient`, used here) with a gloo gather to DP
rank 0 only, the other ranks holding just their own 12/DP bytes per parameter. The two variants
are interchangeable on load. Loading still materialises the full 12 bytes per parameter of the
model-parallel shard on every rank (megatron-core reads the whole shard, then slices).

The workarounds below are needed on the torch `Adam`/`AdamW` fallback that megatron-core uses
when neither Apex nor Transformer Engine is installed (always on CPU). Each names the
megatron-core function it compensates for; `tests/test_checkpoint_roundtrip.py` has a test that
fails without each of them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.optimizer import ChainedOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from megatron_kto.checkpointing.errors import CheckpointError

logger = logging.getLogger(__name__)

#: Passed to `MegatronOptimizer.sharded_state_dict` for save and load alike.
SHARDING_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    # Keys without a "chained_<i>." prefix: the same key whatever the optimizer grouping.
    "chained_optim_avoid_prefix": True,
}
#: Added for saves only: gather to DP rank 0 over gloo instead of an all-gather to every DP
#: rank (see above). A load exchanges no data either way, and the two variants read the same.
SAVE_METADATA = {**SHARDING_METADATA, "distrib_optim_fully_reshardable_mem_efficient": True}


def inner_optimizers(optimizer: Any) -> list[Any]:
    """The optimizers a `ChainedOptimizer` wraps (get_megatron_optimizer always returns one)."""
    if isinstance(optimizer, ChainedOptimizer):
        return list(optimizer.chained_optimizers)
    return [optimizer]


def optimizer_kind(optimizer: Any) -> str | None:
    """'distributed', 'standard' or None (no optimizer) — recorded in checkpoint.json."""
    if optimizer is None:
        return None
    inner = inner_optimizers(optimizer)
    return "distributed" if any(isinstance(o, DistributedOptimizer) for o in inner) else "standard"


def _torch_adams(optimizer: Any) -> Iterator[tuple[DistributedOptimizer, torch.optim.Optimizer]]:
    for opt in inner_optimizers(optimizer):
        if isinstance(opt, DistributedOptimizer) and isinstance(
            opt.optimizer, (torch.optim.Adam, torch.optim.AdamW)
        ):
            yield opt, opt.optimizer


def _scalar_step(param: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    # Same dtype/device as torch.optim.Adam's own lazy initialisation of `step`.
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    if group.get("capturable") or group.get("fused"):
        return torch.zeros((), dtype=dtype, device=param.device)
    return torch.tensor(0.0, dtype=dtype)


def init_empty_adam_state(optimizer: Any) -> None:
    """Give a distributed optimizer that has not stepped yet its (zero) Adam state.

    Workaround: `DistributedOptimizer.state_dict()` (megatron-core 0.16.1, ~642) asserts that all
    parameters share one `step`, which fails while the torch optimizer has no state at all —
    and `DistributedOptimizer.sharded_state_dict()` calls it for save *and* for load. The state
    created here (step 0, zero moments) is exactly what torch Adam creates lazily on its first
    step, so training is unchanged.
    """
    for _, adam in _torch_adams(optimizer):
        if len(adam.state) > 0:
            continue
        for group in adam.param_groups:
            for p in group["params"]:
                adam.state[p] = {
                    "step": _scalar_step(p, group),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
                if group.get("amsgrad"):
                    adam.state[p]["max_exp_avg_sq"] = torch.zeros_like(p)


def untie_steps(optimizer: Any) -> None:
    """Give every parameter its own `step` tensor.

    Workaround: `DistributedOptimizer.load_state_dict()` (megatron-core 0.16.1, ~812) stores ONE
    `step` tensor object in every parameter's state. torch Adam increments `state["step"]` in
    place once per parameter, so after a resume the shared counter advances by the number of
    parameters per step and the bias correction is wrong from the first step on.
    """
    for _, adam in _torch_adams(optimizer):
        for state in adam.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


def sharded_state_dict(optimizer: Any, model_sd: dict[str, Any], is_loading: bool) -> Any:
    """`optimizer.sharded_state_dict` for a save (`is_loading=False`) or a load."""
    init_empty_adam_state(optimizer)
    metadata = SHARDING_METADATA if is_loading else SAVE_METADATA
    sd = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    if is_loading:
        # sharded_state_dict(is_loading=True) itself runs load_state_dict(state_dict()).
        untie_steps(optimizer)
    return sd


def _load_distributed(opt: DistributedOptimizer, state: dict[str, Any]) -> None:
    """`DistributedOptimizer.load_state_dict` for a `fully_reshardable` state, step handled.

    Workaround: on the torch-Adam path `DistributedOptimizer.load_state_dict()` first puts a
    `step` into every parameter state and then `_set_main_param_and_optimizer_states()`
    (megatron-core 0.16.1, ~940) copies *every* key of that state from the checkpoint, which
    never contains `step` (it is in the param groups) → `KeyError: 'step'`. We run the two
    halves ourselves with `step` held aside during the tensor copy.
    """
    state = dict(state)
    param_state = state.pop("param_state", None)
    sharding = state.pop("param_state_sharding_type", None)
    opt.load_state_dict(state)  # param groups, step, grad scaler — no tensors
    if param_state is None:
        return
    if sharding != "fully_reshardable":
        raise CheckpointError(
            f"distributed optimizer state in format {sharding!r}; only 'fully_reshardable' "
            "(what megatron_kto writes) can be loaded"
        )
    adam = opt.optimizer
    steps = {p: s.pop("step") for p, s in adam.state.items() if "step" in s}
    try:
        opt.load_parameter_state_from_fully_reshardable(param_state)
    finally:
        for p, step in steps.items():
            adam.state[p]["step"] = step  # still one shared tensor: load_state_dict unties it


def load_state_dict(optimizer: Any, loaded: Any) -> None:
    """Apply an optimizer state returned by `dist_checkpointing.load` (see `sharded_state_dict`)."""
    inner = inner_optimizers(optimizer)
    if len(inner) == 1:
        parts = [loaded]
    else:
        parts = [loaded[i] for i in sorted(loaded)] if isinstance(loaded, dict) else list(loaded)
    for opt, part in zip(inner, parts, strict=True):
        if isinstance(opt, DistributedOptimizer):
            _load_distributed(opt, part)
        else:
            opt.load_state_dict(part)
    untie_steps(optimizer)


def load_scheduler_state(scheduler: Any, state: dict[str, Any]) -> None:
    """Set an `OptimizerParamScheduler` (fresh or already stepped) to a saved state.

    Workaround: `OptimizerParamScheduler.load_state_dict()` (megatron-core 0.16.1) ends with
    `self.step(increment=num_steps)`, i.e. it *adds* the saved step count to the current one;
    loading into a scheduler that has already stepped (a fallback after a failed load, or a
    reload within one process) would overshoot. Start from 0.
    """
    current = scheduler.state_dict()
    changed = {
        k: (state[k], v)
        for k, v in current.items()
        if k != "num_steps" and k in state and state[k] != v
    }
    if changed and (not dist.is_initialized() or dist.get_rank() == 0):
        # megatron-core keeps the checkpoint's values (use_checkpoint_opt_param_scheduler);
        # say so, or a changed model.optim.* or max_steps would be ignored without a word.
        logger.warning(
            "the LR schedule of this run differs from the checkpoint's (%s); resuming with the "
            "checkpoint's schedule, as megatron-core does",
            ", ".join(f"{k}: checkpoint {a}, config {b}" for k, (a, b) in sorted(changed.items())),
        )
    scheduler.num_steps = 0
    scheduler.load_state_dict(state)
    # load_state_dict sets the LR/WD before it reads the checkpoint's weight-decay settings;
    # re-apply so the param groups reflect all of them.
    scheduler.step(increment=0)
