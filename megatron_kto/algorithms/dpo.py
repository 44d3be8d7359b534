"""DPOTrainer: the training loop shared by DPO and KTO (`KTOTrainer` subclasses it).

`fit()` owns epochs, `max_steps`, validation cadence, gradient clipping (inside the megatron
optimizer), LR scheduling, logging, checkpoint hooks, the run-time limit and preemption.
What differs between algorithms is only `augment_dataloader` (which reference log-probs a batch
needs) and the model's `get_loss_and_metrics`.
"""

from __future__ import annotations

import itertools
import resource
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch

from megatron_kto.algorithms import non_finite as nf
from megatron_kto.algorithms.aggregation import (
    MetricAccumulator,
    StepCost,
    TrainInterval,
    throughput_fields,
)
from megatron_kto.algorithms.errors import OutputWriteFailed
from megatron_kto.logging.throughput import FWD_BWD_MULTIPLIER, ModelFlops, dpo_pass_tokens
from megatron_kto.models.dpo_model import REF_CHOSEN, REF_REJECTED
from megatron_kto.models.forward import data_parallel_all_reduce, eval_mode
from megatron_kto.models.reference import holding
from megatron_kto.models.schedule import Batch, to_device
from megatron_kto.models.training_setup import zero_grads
from megatron_kto.runtime.peers import mark_step


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this process so far: device allocations on CUDA, max RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB


class PreferenceModel(Protocol):
    """What the trainer needs from MegatronGPTKTOModel / MegatronGPTDPOModel."""

    chunks: list[torch.nn.Module]
    needs_reference: bool
    """False: the objective reads no reference log-probs, and no reference pass is run."""

    def get_ref_policy_logprobs(self, batch: Batch) -> torch.Tensor: ...

    def get_loss_and_metric_sums(
        self, batch: Batch, forward_only: bool
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...

    def finalize_metrics(
        self, sums: torch.Tensor, scalars: dict[str, torch.Tensor]
    ) -> dict[str, float]: ...


@dataclass
class TrainerState:
    """Progress of a run; saved in checkpoints."""

    step: int = 0
    """Optimizer steps taken."""
    epoch: int = 0
    """Current epoch (0-based)."""
    consumed_samples: int = 0
    """Training examples consumed across all DP ranks."""
    skipped_steps: int = 0
    """Steps whose update `trainer.non_finite=skip` left out (a non-finite loss or gradient)."""


@dataclass
class LoopSettings:
    """Resolved loop limits (from `trainer.kto` / `trainer.dpo`)."""

    max_steps: int
    steps_per_epoch: int
    val_check_interval: int
    limit_val_batches: int
    save_interval: int
    log_every_n_steps: int
    global_batch_size: int
    max_time_seconds: float | None = None


def resolve_loop(
    loop: Any,
    train_batches: int,
    val_batches: int,
    global_batch_size: int,
    log_every_n_steps: int,
    max_time_seconds: float | None,
) -> LoopSettings:
    """Turn NeMo-style loop config (float fractions or int counts) into step counts.

    Args:
        loop: `trainer.kto`/`trainer.dpo` config node.
        train_batches: full global batches per epoch in the training data.
        val_batches: full global batches in the validation data.
    """

    def limit(value: int | float, total: int) -> int:
        # NeMo/Lightning: an int is a number of batches, a float a fraction (so 1 != 1.0).
        if isinstance(value, int) and not isinstance(value, bool):
            return min(total, value)
        return int(total * value)

    steps_per_epoch = limit(loop.limit_train_batches, train_batches)
    if steps_per_epoch < 1:
        raise ValueError(
            f"model.data.data_prefix.train: fewer examples than one global batch "
            f"({global_batch_size}); lower model.global_batch_size or add data"
        )
    max_steps = loop.max_steps if loop.max_steps > 0 else loop.max_epochs * steps_per_epoch
    v = loop.val_check_interval
    # An int is a number of steps; a float a fraction of an epoch (1.0: once per epoch).
    is_steps = isinstance(v, int) and not isinstance(v, bool)
    val_every = v if is_steps else max(1, int(v * steps_per_epoch))
    return LoopSettings(
        max_steps=max_steps,
        steps_per_epoch=steps_per_epoch,
        val_check_interval=val_every,
        limit_val_batches=limit(loop.limit_val_batches, val_batches),
        save_interval=loop.save_interval,
        log_every_n_steps=log_every_n_steps,
        global_batch_size=global_batch_size,
        max_time_seconds=max_time_seconds,
    )


class DPOTrainer:
    """Runs `fit()` for a preference model (DPO here; KTO via `KTOTrainer`)."""

    #: Blocks of `forward_logprobs`' rows that belong to the batch's own examples (chosen, rejected).
    example_blocks = 2

    def __init__(
        self,
        model: PreferenceModel,
        optimizer,
        scheduler,
        train_loader: Callable[[int, int], Iterable[Batch]],
        val_loader: Callable[[], Iterable[Batch]] | None,
        loop: LoopSettings,
        device: torch.device,
        logger,
        progress,
        model_flops: ModelFlops | None = None,
        peak_flops: float | None = None,
        world_size: int = 1,
        checkpoint_hook: Callable[[TrainerState, bool], None] | None = None,
        stop_requested: Callable[[], bool] | None = None,
        state: TrainerState | None = None,
        non_finite: str = "stop",
        check_gradients: bool = True,
        row_sources: Callable[[list[int]], list[str]] | None = None,
    ):
        """
        Args:
            model: policy + reference + loss.
            optimizer, scheduler: megatron-core optimizer and OptimizerParamScheduler.
            train_loader: (epoch, batches already consumed in that epoch) -> this rank's batches.
            val_loader: () -> this rank's validation batches, or None.
            loop: resolved limits.
            device: where batches go.
            logger: `.log(split, step, consumed_samples, metrics)`.
            progress: `.update(step, metrics)` / `.validation(step, metrics)` / `.close()`.
            model_flops: the model's FLOPs per row length (for MFU), or None.
            peak_flops: peak FLOP/s of one device (for MFU), or None.
            world_size: number of devices in the job.
            checkpoint_hook: `(state, final)` called when a checkpoint is due.
            stop_requested: returns True when preemption was signalled.
            state: progress to resume from.
            non_finite: `trainer.non_finite`: 'stop' raises `non_finite.NonFiniteStep` on
                every rank; 'skip' leaves the step's update out and counts it.
            check_gradients: look for non-finite gradients (False under fp16, whose loss
                scaler skips overflowing steps itself).
            row_sources: training dataset indices -> `file:line` (for the rows a non-finite
                step names); None names the indices.
        """
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.loop = loop
        self.device = device
        self.logger = logger
        self.progress = progress
        self.model_flops = model_flops
        self.peak_flops = peak_flops
        self.world_size = world_size
        self.checkpoint_hook = checkpoint_hook
        self.stop_requested = stop_requested or (lambda: False)
        self.state = state or TrainerState()
        self.non_finite = non_finite
        self.check_gradients = check_gradients
        self.row_sources = row_sources or (lambda indices: [f"example {i}" for i in indices])
        self._start_time = time.monotonic()
        self._interval = TrainInterval()

    # --- per-algorithm -------------------------------------------------------------------------
    def augment_dataloader(self, dataloader: Iterable[Batch]) -> Iterator[Batch]:
        """Move each batch to the device and attach its reference log-probs (none for a
        reference-free objective)."""
        for batch in dataloader:
            batch = to_device(batch, self.device)
            if self._needs_reference:
                self.attach_reference(batch, self.model.get_ref_policy_logprobs(batch))
            yield batch

    @property
    def _needs_reference(self) -> bool:
        # Stand-in models in tests may predate the attribute: they all read a reference.
        return getattr(self.model, "needs_reference", True)

    def attach_reference(self, batch: Batch, ref: torch.Tensor) -> None:
        """Store reference log-probs [2B] in the batch, split into the chosen and rejected
        halves (`ref_policy_log_probs_chosen` / `_rejected`, [B] each)."""
        batch[REF_CHOSEN], batch[REF_REJECTED] = ref.chunk(2)

    def reference_logps(self, batch: Batch) -> torch.Tensor:
        """The reference log-probs attached to `batch`, in `forward_logprobs`' row order; a
        reference-free objective has none: zeros, one per row (finite, so they flag nothing)."""
        if not self._needs_reference:
            chosen = batch["chosen"]
            return torch.zeros(2 * chosen.shape[0], device=chosen.device)
        return torch.cat([batch[REF_CHOSEN], batch[REF_REJECTED]])

    def step_cost(self, batch: Batch) -> tuple[float, float]:
        """(real tokens in this rank's batch, model FLOPs of its step for MFU; 0 without
        `model_flops`).

        DPO: reference forward over chosen+rejected (1x; none for a reference-free objective),
        a policy forward over them for a loss that sorts the global batch (1x; aot) and policy
        forward+backward (3x).
        """
        lengths = torch.cat([batch["chosen_lengths"], batch["rejected_lengths"]])
        flops = self.model_flops.rows(lengths) if self.model_flops else 0.0
        forward_only, forward_backward = dpo_pass_tokens(
            flops, self._needs_reference, getattr(self.model, "sorts_batch", False)
        )
        return float(lengths.sum()), forward_only + FWD_BWD_MULTIPLIER * forward_backward

    # --- loop ----------------------------------------------------------------------------------
    def train_single_step(self, batch: Batch, started: float) -> dict[str, float]:
        """One optimizer step on a batch that already carries its reference log-probs.

        Returns this step's metrics (for the progress display); the step is also added to the
        current logging interval (`aggregation.TrainInterval`).
        """
        for chunk in self.model.chunks:
            chunk.train()
        zero_grads(self.model.chunks, self.optimizer)
        sums, scalars = self.model.get_loss_and_metric_sums(batch, forward_only=False)
        # The rate this update uses; after `scheduler.step` the optimizer holds the next one.
        lr = float(self.optimizer.param_groups[0]["lr"])
        problems = self._non_finite(batch, sums, scalars)
        if problems:
            self._on_non_finite(batch, problems)  # raises under `stop`
            update_ok, grad_norm = False, None
        else:
            update_ok, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        elapsed = time.monotonic() - started
        tokens, flops = self.step_cost(batch)
        totals = data_parallel_all_reduce(
            torch.tensor([tokens, flops], dtype=torch.float64, device=self.device)
        )
        cost = StepCost(
            lr=lr,
            grad_norm=float(grad_norm) if grad_norm is not None else 0.0,
            skipped=not update_ok,
            seconds=elapsed,
            tokens=float(totals[0]),
            flops=float(totals[1]),
            samples=self.loop.global_batch_size,
            peak_memory_gb=peak_memory_gb(self.device),
        )
        if problems:  # its NaN must not spoil the interval's means: the row counts it instead
            self._interval.add_skipped(cost)
        else:
            self._interval.add(sums, scalars, cost)
        metrics = self.model.finalize_metrics(sums, scalars)
        metrics.update(throughput_fields([cost], self.peak_flops, self.world_size))
        return metrics

    def _non_finite(
        self, batch: Batch, sums: torch.Tensor, scalars: dict[str, torch.Tensor]
    ) -> list[str]:
        """What was non-finite in this step (empty: nothing), the same list on every rank."""
        names = nf.non_finite_names(self.model.finalize_metrics(sums, scalars))
        grads = nf.gradients_finite(self.model.chunks) if self.check_gradients else None
        return names + nf.agreed_flags(self.reference_logps(batch), grads)

    def _on_non_finite(self, batch: Batch, problems: list[str]) -> None:
        """Raise `NonFiniteStep` (`stop`), or warn on rank 0 and count the skipped step."""
        step = self.state.step + 1
        rows = batch["samples" if "samples" in batch else "chosen"].shape[0]
        with eval_mode(self.model.chunks), torch.no_grad():
            policy = self.model.forward_logprobs(batch, self.model.chunks)
        bad, everything = nf.gather_rows(
            batch["index"],
            nf.bad_rows(policy, self.reference_logps(batch), rows, self.example_blocks),
        )
        error = nf.NonFiniteStep(step, problems, self.row_sources(bad or everything), not bad)
        if self.non_finite == "stop":
            raise error
        self.state.skipped_steps += 1
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            print(
                f"warning: {error.describe()}; update skipped (trainer.non_finite=skip, "
                f"{self.state.skipped_steps} skipped so far)",
                flush=True,
            )

    def _warn_non_finite_validation(self, metrics: dict[str, float]) -> None:
        """One rank-0 warning when validation metrics are NaN/Inf (metrics.jsonl holds null)."""
        names = nf.non_finite_names(metrics)
        if names and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
            print(
                f"warning: validation after step {self.state.step}: non-finite "
                f"{', '.join(names)} (null in metrics.jsonl)",
                flush=True,
            )

    def _train_row(self, last_step_metrics: dict[str, float]) -> dict[str, float]:
        """The logged row of the interval that just ended: its count-weighted metrics."""
        # A `train_single_step` that records no interval (a stand-in in tests) logs its own.
        if not self._interval.steps:
            return last_step_metrics
        return self._interval.pop(self.model.finalize_metrics, self.peak_flops, self.world_size)

    def _validation_batches(self) -> Iterator[Batch]:
        """The first `limit_val_batches` validation batches with their reference log-probs.

        The reference log-probs of all of them are computed first, in one scope (for
        `cpu_swap`: one swap of the weights per validation pass, not one per batch; only the
        [2B] log-probs per batch are kept), then the loader is replayed (validation order is
        fixed) and each batch gets its log-probs attached.
        """
        limit = self.loop.limit_val_batches
        if not self._needs_reference:
            for batch in itertools.islice(self.val_loader(), limit):
                yield to_device(batch, self.device)
            return
        refs = []
        with holding(self.model.reference):
            for batch in itertools.islice(self.val_loader(), limit):
                refs.append(self.model.get_ref_policy_logprobs(to_device(batch, self.device)))
        for batch, ref in zip(itertools.islice(self.val_loader(), limit), refs, strict=True):
            batch = to_device(batch, self.device)
            self.attach_reference(batch, ref)
            yield batch

    def run_validation(self) -> dict[str, float] | None:
        """Validation metrics over `limit_val_batches` global batches (None if no data).

        The (sum, count) tensors of all batches are added and finalised once: each metric is
        the mean over every validation example (`aggregation.MetricAccumulator`).
        """
        if self.val_loader is None or self.loop.limit_val_batches == 0:
            return None
        total = MetricAccumulator()
        with eval_mode(self.model.chunks):
            for batch in self._validation_batches():
                total.add(*self.model.get_loss_and_metric_sums(batch, forward_only=True))
        return total.result(self.model.finalize_metrics) if total.batches else None

    def _time_is_up(self) -> bool:
        limit = self.loop.max_time_seconds
        return limit is not None and time.monotonic() - self._start_time >= limit

    def _should_stop(self) -> bool:
        """Whether any rank was asked to stop (signal, time limit).

        Raises:
            OutputWriteFailed: on every rank, when rank 0 could not write the metrics (a full
                disk): the others would otherwise wait for it in their next collective.
        """
        # Every rank must agree, or one would save/exit while the others wait in a collective.
        failure = getattr(self.logger, "failure", None)
        flag = torch.tensor(
            [float(self.stop_requested() or self._time_is_up()), float(failure is not None)],
            device=self.device,
        )
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        stop, failed = flag.tolist()
        if failed:
            raise OutputWriteFailed(*(failure or (None, None)))
        return bool(stop)

    def fit(self) -> TrainerState:
        """Train until `max_steps`, the time limit, or a preemption signal; returns the final state."""
        s, loop = self.state, self.loop
        # A signal that arrived during start-up stops the run before it trains anything.
        stopped_early = s.step < loop.max_steps and self._should_stop()
        while s.step < loop.max_steps and not stopped_early:
            s.epoch = s.step // loop.steps_per_epoch
            done_in_epoch = s.step % loop.steps_per_epoch
            batches = self.augment_dataloader(self.train_loader(s.epoch, done_in_epoch))
            started = time.monotonic()
            for batch in batches:
                mark_step(s.step + 1)  # where a rank stuck in this step stopped (timeouts)
                metrics = self.train_single_step(batch, started)
                s.step += 1
                s.consumed_samples += loop.global_batch_size
                if s.step % loop.log_every_n_steps == 0 or s.step == loop.max_steps:
                    row = self._train_row(metrics)
                    if self.non_finite == "skip":
                        row["skipped_steps"] = s.skipped_steps
                    self.logger.log("train", s.step, s.consumed_samples, row)
                self.progress.update(s.step, metrics)
                if s.step % loop.val_check_interval == 0 or s.step == loop.max_steps:
                    val = self.run_validation()
                    if val is not None:
                        self._warn_non_finite_validation(val)
                        self.logger.log("val", s.step, s.consumed_samples, val)
                        self.progress.validation(s.step, val)
                if (
                    self.checkpoint_hook
                    and loop.save_interval > 0
                    and s.step % loop.save_interval == 0
                    and s.step < loop.max_steps
                ):
                    self.checkpoint_hook(s, False)
                if s.step >= loop.max_steps or s.step % loop.steps_per_epoch == 0:
                    break
                if self._should_stop():
                    stopped_early = True
                    break
                started = time.monotonic()
            else:
                if s.step % loop.steps_per_epoch != 0:  # loader ran dry before the epoch's end
                    raise RuntimeError(
                        f"training data ended after step {s.step}, before epoch {s.epoch} was complete"
                    )
            if not stopped_early and self._should_stop() and s.step < loop.max_steps:
                stopped_early = True
        s.epoch = s.step // loop.steps_per_epoch
        # Step 0 has nothing to save: the weights are the initial ones, and an optimizer that
        # has never stepped has no state to resume.
        if self.checkpoint_hook and s.step > 0:
            self.checkpoint_hook(s, True)
        self.progress.close()
        return s

    def state_dict(self) -> dict[str, int]:
        """Trainer progress as plain numbers."""
        return asdict(self.state)
