"""`load_scheduler_state`: exact restore, and a warning when the config's schedule differs.

megatron-core's `OptimizerParamScheduler` keeps the checkpoint's schedule settings on load
(`use_checkpoint_opt_param_scheduler`), so a run resumed with another `max_steps` or
`model.optim.lr` silently follows the old schedule unless we say so.
"""

from __future__ import annotations

import logging

import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_kto.checkpointing.optimizer_state import load_scheduler_state


def _scheduler(max_lr: float, decay_steps: int) -> OptimizerParamScheduler:
    # The scheduler only reads and writes `param_groups`: a plain torch optimizer will do.
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=max_lr)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=max_lr / 3,
        max_lr=max_lr,
        min_lr=max_lr / 10,
        lr_warmup_steps=2,
        lr_decay_steps=decay_steps,
        lr_decay_style="cosine",
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )


def _lr(s: OptimizerParamScheduler) -> float:
    return s.optimizer.param_groups[0]["lr"]


def test_same_schedule_restores_exactly_without_warning(caplog) -> None:
    saved = _scheduler(1e-3, 10)
    saved.step(increment=4)
    resumed = _scheduler(1e-3, 10)
    resumed.step(increment=1)  # already stepped: the load must not add to it
    with caplog.at_level(logging.WARNING):
        load_scheduler_state(resumed, saved.state_dict())
    assert resumed.num_steps == 4
    assert _lr(resumed) == _lr(saved)
    assert not [r for r in caplog.records if "LR schedule" in r.getMessage()]
    saved.step(increment=1)
    resumed.step(increment=1)
    assert _lr(resumed) == _lr(saved)


def test_changed_schedule_warns_and_keeps_the_checkpoints(caplog) -> None:
    saved = _scheduler(1e-3, 6)
    saved.step(increment=4)
    resumed = _scheduler(2e-3, 12)  # e.g. max_steps and lr changed on resume
    with caplog.at_level(logging.WARNING):
        load_scheduler_state(resumed, saved.state_dict())
    (message,) = [r.getMessage() for r in caplog.records if "LR schedule" in r.getMessage()]
    assert "lr_decay_steps: checkpoint 6, config 12" in message
    assert "max_lr: checkpoint 0.001, config 0.002" in message
    assert "num_steps" not in message
    assert resumed.num_steps == 4 and _lr(resumed) == _lr(saved)
