"""PreemptionHandler turns SIGTERM/SIGUSR1 into a flag and restores handlers; max_time parsing;
how `DPOTrainer.fit` stops, saves and resumes its data position (the model step stubbed out —
`tests/test_e2e_resume.py` runs the real one)."""

from __future__ import annotations

import datetime
import os
import signal

import pytest
import torch

from megatron_kto.algorithms.dpo import DPOTrainer, LoopSettings, TrainerState
from megatron_kto.checkpointing.preemption import PreemptionHandler
from megatron_kto.config.max_time import parse_max_time


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_sets_flag_instead_of_killing(sig) -> None:
    with PreemptionHandler() as handler:
        assert not handler.requested
        os.kill(os.getpid(), sig)  # delivered to the main thread before the next bytecode
        assert handler.requested
        assert handler.received == sig
        os.kill(os.getpid(), signal.SIGUSR1)  # a second signal keeps the first reason
        assert handler.received == sig


def test_previous_handlers_are_restored() -> None:
    calls = []

    def mine(signum, frame):
        calls.append(signum)

    before_term = signal.getsignal(signal.SIGTERM)
    previous_usr1 = signal.signal(signal.SIGUSR1, mine)
    try:
        with PreemptionHandler() as handler:
            assert signal.getsignal(signal.SIGUSR1) == handler._handle
        assert signal.getsignal(signal.SIGUSR1) is mine
        assert signal.getsignal(signal.SIGTERM) == before_term
        os.kill(os.getpid(), signal.SIGUSR1)
        assert calls == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous_usr1)


def test_handlers_restored_when_body_raises() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError), PreemptionHandler():
        raise RuntimeError("training failed")
    assert signal.getsignal(signal.SIGTERM) == before


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("00:03:55:00", 3 * 3600 + 55 * 60),
        ("01:00:00:01", 86400 + 1),
        ("0:48:00:00", 48 * 3600),  # fields may overflow, as in Lightning
        (" 00:00:00:30 ", 30),
        (datetime.timedelta(hours=2), 7200),
        ({"days": 1, "hours": 2}, 93600),
        (90, 90),
        (1.5, 1.5),
    ],
)
def test_parse_max_time(value, seconds) -> None:
    assert parse_max_time(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", [None, "", "null", "None"])
def test_parse_max_time_unset(value) -> None:
    assert parse_max_time(value) is None


@pytest.mark.parametrize(
    "value", ["03:55:00", "1:2:3:4:5", "aa:bb:cc:dd", "00:00:00:00", -5, True, {"weeks": 1}, [1]]
)
def test_parse_max_time_rejects(value) -> None:
    with pytest.raises(ValueError):
        parse_max_time(value)


class _LoopOnly(DPOTrainer):
    """The real `fit` loop; the model step and the cross-rank vote are one-process stand-ins."""

    def augment_dataloader(self, dataloader):
        yield from dataloader

    def train_single_step(self, batch, started):
        self.trained.append(batch)
        return {"loss": 0.0}

    def _should_stop(self) -> bool:  # the real one all-reduces this over the ranks
        return self.stop_requested() or self._time_is_up()


class _Null:
    def log(self, *args) -> None: ...
    def update(self, *args) -> None: ...
    def validation(self, *args) -> None: ...
    def close(self) -> None: ...


def _trainer(stop_after: int | None, state: TrainerState | None = None, max_steps: int = 6):
    """A loop of `max_steps` steps, 4 per epoch; `stop_after`: signal once that many steps ran."""
    loaders, hooks = [], []

    def train_loader(epoch: int, done: int):
        loaders.append((epoch, done))
        return [(epoch, i) for i in range(done, 4)]

    loop = LoopSettings(
        max_steps=max_steps,
        steps_per_epoch=4,
        val_check_interval=100,
        limit_val_batches=0,
        save_interval=0,
        log_every_n_steps=1,
        global_batch_size=8,
    )
    trainer = _LoopOnly(
        model=None,
        optimizer=None,
        scheduler=None,
        train_loader=train_loader,
        val_loader=None,
        loop=loop,
        device=torch.device("cpu"),
        logger=_Null(),
        progress=_Null(),
        checkpoint_hook=lambda s, final: hooks.append((s.step, s.epoch, final)),
        stop_requested=lambda: stop_after is not None and len(trainer.trained) >= stop_after,
        state=state,
    )
    trainer.trained = []
    return trainer, loaders, hooks


def test_signal_mid_run_saves_once_at_that_step() -> None:
    trainer, loaders, hooks = _trainer(stop_after=2)
    final = trainer.fit()
    assert (final.step, final.consumed_samples) == (2, 16)
    assert hooks == [(2, 0, True)]
    assert loaders == [(0, 0)]


def test_resume_continues_mid_epoch_and_crosses_the_epoch() -> None:
    trainer, loaders, hooks = _trainer(None, TrainerState(step=3, epoch=0, consumed_samples=24))
    final = trainer.fit()
    assert loaders == [(0, 3), (1, 0)]  # the rest of epoch 0, then epoch 1 from its start
    assert trainer.trained == [(0, 3), (1, 0), (1, 1)]
    assert (final.step, final.epoch, final.consumed_samples) == (6, 1, 48)
    assert hooks == [(6, 1, True)]


def test_signal_before_the_first_step_trains_nothing() -> None:
    # Fresh run: nothing to save (a step-0 checkpoint has no optimizer state to resume).
    trainer, loaders, hooks = _trainer(stop_after=0)
    assert trainer.fit().step == 0
    assert trainer.trained == [] and loaders == [] and hooks == []
    # Resumed run: the hook is told the resumed step (the manager knows it is saved already).
    trainer, loaders, hooks = _trainer(0, TrainerState(step=3, epoch=0, consumed_samples=24))
    assert trainer.fit().step == 3
    assert trainer.trained == [] and hooks == [(3, 0, True)]
