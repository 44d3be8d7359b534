"""Compose a run from a validated config: runtime → data → model → reference → optimization →
trainer → fit (with checkpoints and the Hugging Face output) → teardown.

The example scripts are thin Hydra mains around `run_alignment`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from megatron_kto.algorithms.dpo import DPOTrainer, TrainerState, resolve_loop
from megatron_kto.algorithms.errors import NonFiniteError, OutputError, OutputWriteFailed
from megatron_kto.algorithms.kto import KTOTrainer
from megatron_kto.algorithms.non_finite import NonFiniteStep, stop_message
from megatron_kto.algorithms.reference_strategies import (
    ReferenceStrategy,
    TrainingInputs,
    choose_reference,
)
from megatron_kto.checkpointing.disk_space import (
    free_bytes,
    kept_line,
    no_space_cause,
    write_failure_line,
)
from megatron_kto.checkpointing.model_io import CheckpointError
from megatron_kto.config.validate import ConfigError
from megatron_kto.console import error_summary
from megatron_kto.data.pipeline import build_split, resolve_path
from megatron_kto.data.provenance import row_sources
from megatron_kto.data.tokenizers import load_tokenizer
from megatron_kto.hf_writer.output import hf_output_of_run
from megatron_kto.logging.metrics_logger import MetricsLogger
from megatron_kto.logging.progress import ProgressReporter
from megatron_kto.logging.startup import StartupClock
from megatron_kto.logging.throughput import architecture_flops, peak_flops_per_device
from megatron_kto.losses.dpo_types import NO_REFERENCE
from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks
from megatron_kto.models.dpo_model import MegatronGPTDPOModel
from megatron_kto.models.kto_model import MegatronGPTKTOModel
from megatron_kto.models.loss_settings import loss_settings
from megatron_kto.models.training_setup import build_optimizer, build_scheduler, wrap_ddp
from megatron_kto.peft.run_adapters import add_adapters, base_record_of_run, reference_words
from megatron_kto.peft.settings import uses_lora
from megatron_kto.peft.wiring import parameter_counts
from megatron_kto.planning.memory import startup_lines
from megatron_kto.prepare import prepare_run_config
from megatron_kto.runtime.distributed import init_runtime, teardown
from megatron_kto.runtime.launcher_env import adopt_launcher_env
from megatron_kto.runtime.peers import is_peer_failure, peer_lost
from megatron_kto.runtime.precision import PRECISION_DTYPES


def _say(rank0: bool, message: str) -> None:
    if rank0:
        print(message, flush=True)


def _layout(cfg: Any) -> ParallelLayout:
    m = cfg.model
    return ParallelLayout(
        tensor_model_parallel_size=m.tensor_model_parallel_size,
        pipeline_model_parallel_size=m.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=m.virtual_pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage=m.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=m.num_layers_in_last_pipeline_stage,
        expert_model_parallel_size=m.expert_model_parallel_size,
        expert_tensor_parallel_size=m.expert_tensor_parallel_size,
        context_parallel_size=m.context_parallel_size,
        sequence_parallel=m.sequence_parallel,
        precision=str(cfg.trainer.precision),
        activations_checkpoint_granularity=m.activations_checkpoint_granularity,
        activations_checkpoint_method=m.activations_checkpoint_method,
        activations_checkpoint_num_layers=m.activations_checkpoint_num_layers,
        attention_backend=m.attention_backend,
        pack_sequences=m.data.pack_sequences,
        moe_router_bias_update_rate=m.moe_router_bias_update_rate,
    )


def _parse_max_time(value: str | None) -> float | None:
    if not value:
        return None
    from megatron_kto.config.max_time import parse_max_time

    try:
        return parse_max_time(value)
    except ValueError as e:
        raise ConfigError(f"trainer.max_time: {e}") from e


def _build_policy(
    cfg: Any, algorithm: str, arch, layout: ParallelLayout, runtime, reference: ReferenceStrategy
):
    """Policy chunks (restored if configured, DDP-wrapped) and the preference model around them,
    with the reference `reference` gives it once the policy is wrapped."""
    from megatron_kto.checkpointing.manager import restore_pretrained

    m = cfg.model
    chunks = build_gpt_chunks(arch, layout, runtime.device)
    if cfg.pretrained_checkpoint.restore_from_path:
        restore_pretrained(cfg.pretrained_checkpoint.restore_from_path, chunks)
        _say(
            runtime.is_rank0, f"restored weights from {cfg.pretrained_checkpoint.restore_from_path}"
        )
    lora = uses_lora(m)
    if lora:  # after the base weights are in, before DDP: only adapters get grad buffers
        add_adapters(cfg, arch, chunks, runtime.is_rank0, reference.name != NO_REFERENCE)
    reference.before_ddp(chunks, lambda: build_gpt_chunks(arch, layout, runtime.device))
    chunks = wrap_ddp(
        chunks,
        use_distributed_optimizer=m.optim.name == "distributed_fused_adam",
        overlap_grad_reduce=m.optim.overlap_grad_sync,
        bucket_size=_bucket_size(m.optim.bucket_cap_mb),
    )
    reference_policy = reference.after_ddp(chunks)
    if lora:
        trainable, total = parameter_counts(chunks)
        _say(
            runtime.is_rank0,
            f"LoRA: {trainable:,} trainable of {total:,} parameters "
            f"({100 * trainable / total:.3f}%); reference = "
            f"{reference_words(m, reference.name != NO_REFERENCE)}",
        )
    settings = loss_settings(cfg, algorithm, arch.vocab_size)
    model_cls = MegatronGPTKTOModel if algorithm == "kto" else MegatronGPTDPOModel
    return model_cls(chunks, reference_policy, settings)


def _bucket_size(bucket_cap_mb: float | None) -> int | None:
    """NeMo's bucket_cap_mb (MiB) as megatron DDP's bucket_size (elements): the buckets hold
    fp32 gradients (`grad_reduce_in_fp32`), 4 bytes each."""
    return None if bucket_cap_mb is None else max(1, int(bucket_cap_mb * 2**20 / 4))


def _build_optimization(cfg: Any, algorithm: str, chunks, loop, precision: str):
    o = cfg.model.optim
    loop_cfg = cfg.trainer.kto if algorithm == "kto" else cfg.trainer.dpo
    optimizer = build_optimizer(
        chunks,
        lr=o.lr,
        min_lr=o.sched.min_lr,
        weight_decay=o.weight_decay,
        betas=(o.betas[0], o.betas[1]),
        eps=o.eps,
        clip_grad=loop_cfg.gradient_clip_val,
        precision=precision,
        use_distributed_optimizer=o.name == "distributed_fused_adam",
    )
    scheduler = build_scheduler(
        optimizer,
        name=o.sched.name,
        lr=o.lr,
        min_lr=o.sched.min_lr,
        warmup_steps=o.sched.warmup_steps,
        constant_steps=o.sched.constant_steps,
        max_steps=loop.max_steps,
        weight_decay=o.weight_decay,
    )
    return optimizer, scheduler


def _check_reference_reproducible(cfg: Any, algorithm: str, ckpt_dir: Path | None) -> None:
    """Refuse a resume whose reference policy would differ from the interrupted run's
    (`ReferenceStrategy.check_resume` of the configured strategy)."""
    choose_reference(cfg, algorithm).check_resume(ckpt_dir)


@dataclass(frozen=True)
class _Run:
    """What every step of a run reads: the prepared config and what was set up from it."""

    cfg: Any
    algorithm: str
    arch: Any
    runtime: Any
    layout: ParallelLayout
    log_dir: Path


def run_alignment(cfg: Any, algorithm: str) -> TrainerState:
    """Train with KTO or DPO as configured; returns the final trainer state.

    Args:
        cfg: composed config (`AlignmentConfig` schema).
        algorithm: 'kto' or 'dpo'.
    """
    from megatron_kto.checkpointing.preemption import PreemptionHandler

    # megatron-core logs its DDP/optimizer configs at INFO on every rank; keep warnings and up.
    logging.getLogger("megatron.core").setLevel(logging.WARNING)
    clock = StartupClock()
    cfg, arch = _prepare(cfg, algorithm)
    clock.lap("config")
    max_time = _parse_max_time(cfg.trainer.max_time)
    log_dir = Path(cfg.exp_manager.explicit_log_dir)
    # Installed before anything slow (rendezvous, data, model, checkpoint load): a preemption
    # signal during start-up then stops the run cleanly before its first step (exit 0; the
    # checkpoint it resumed from is still the latest) instead of killing it.
    with PreemptionHandler() as preemption:
        runtime = _init_runtime(cfg.model, cfg.trainer.distributed_timeout_minutes)
        clock.lap("distributed set-up")
        peers_alive = True
        try:
            run = _Run(cfg, algorithm, arch, runtime, _layout(cfg), log_dir)
            reference = choose_reference(cfg, algorithm)
            train, val = _build_data(run, reference)
            clock.lap("data")
            _say_memory_plan(run)
            model = _build_policy(cfg, algorithm, arch, run.layout, runtime, reference)
            clock.lap("model")
            loop = _resolve_loop(run, train, val, max_time)
            splits = [s for s in (train, val) if s is not None]
            reference.before_training(model, TrainingInputs(splits, arch, runtime, log_dir, loop))
            clock.lap("reference")
            _note_warmup(run, loop)
            optimization = _build_optimization(
                cfg, algorithm, model.chunks, loop, run.layout.precision
            )
            manager, state = _restore(run, model, optimization, reference)
            clock.lap("optimizer and restore")
            _say(runtime.is_rank0, clock.line())
            trainer, logger = _build_trainer(
                run,
                model,
                optimization,
                (train, val),
                loop,
                (manager, state),
                lambda: preemption.requested,
            )
            try:
                final = trainer.fit()
            except NonFiniteStep as e:
                logger.close()
                raise NonFiniteError(stop_message(e, log_dir)) from None
            except OutputWriteFailed as e:
                logger.close()
                raise OutputError(_output_failure_line(e, log_dir)) from None
            logger.close()
            _say(
                runtime.is_rank0,
                f"done: step {final.step}, consumed {final.consumed_samples} samples; outputs in {log_dir}",
            )
            return final
        except Exception as e:
            if not is_peer_failure(e):
                raise
            peers_alive = False
            kept = kept_line(log_dir / "checkpoints")
            raise peer_lost(kept, e, cfg.trainer.distributed_timeout_minutes) from None
        finally:
            teardown(barrier=peers_alive)


def _output_failure_line(error: OutputWriteFailed, log_dir: Path) -> str:
    """Rank 0's line for metrics / TensorBoard that could not be written (elsewhere: a stand-in,
    never printed)."""
    if error.error is None:
        return "writing the metrics failed on rank 0"
    path = Path(str(error.path))
    cause = no_space_cause(error.error) or error_summary(error.error)
    return write_failure_line(
        path, "the metrics", cause, log_dir / "checkpoints", free=free_bytes(path)
    )


def _prepare(cfg: Any, algorithm: str) -> tuple[Any, Any]:
    """The prepared config and the model's architecture (`prepare.prepare_run_config`)."""
    try:
        adopt_launcher_env()  # srun without torchrun: SLURM's task variables
    except RuntimeError as e:
        raise ConfigError(str(e)) from e
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # Before any process group or model exists. The entry scripts have already done it (and
    # printed its notes); it is idempotent, and callers like tools/bench_kto.py rely on it.
    prepared = prepare_run_config(cfg, algorithm, world_size)
    return prepared.cfg, prepared.architecture


def _init_runtime(m: Any, timeout_minutes: float):
    """Process groups (collective timeout `trainer.distributed_timeout_minutes`), megatron's
    parallel state and seeds for the `model.*` layout."""
    return init_runtime(
        m.tensor_model_parallel_size,
        m.pipeline_model_parallel_size,
        m.virtual_pipeline_model_parallel_size,
        seed=m.seed,
        timeout_minutes=timeout_minutes,
        expert_parallel_size=m.expert_model_parallel_size,
        context_parallel_size=m.context_parallel_size,
        expert_tensor_parallel_size=m.expert_tensor_parallel_size,
    )


def _build_data(run: _Run, reference: ReferenceStrategy):
    """(train, validation) splits (validation None without files), each described on rank 0.

    Batches always carry their examples' index: the precomputed reference looks its log-probs up
    by it, and a non-finite step names its rows' files and lines from it."""
    m = run.cfg.model
    tokenizer = load_tokenizer(
        m.tokenizer.library, str(resolve_path(m.tokenizer.model)), m.tokenizer.chat_template
    )
    max_length = m.data.max_length or run.arch.encoder_seq_length

    def split(name: str, first_example: int):
        return build_split(
            run.cfg,
            name,
            run.algorithm,
            tokenizer,
            run.runtime,
            max_length,
            index_offset=_index_offset(reference, first_example),
        )

    train = split("train", 0)
    val = split("validation", len(train.dataset))  # its examples follow the training examples
    for s in (train, val):
        if s is not None:
            _say(run.runtime.is_rank0, s.describe())
    return train, val


def _index_offset(reference: ReferenceStrategy, first_example: int) -> int:
    """The strategy's example-index offset; a strategy that needs none gets the split's
    position, so that indices stay unique across splits all the same."""
    offset = reference.index_offset(first_example)
    return first_example if offset is None else offset


def _say_memory_plan(run: _Run) -> None:
    """Rank 0 prints the memory plan before anything is allocated: a run that cannot fit says
    so first."""
    if not run.runtime.is_rank0:
        return
    try:
        plan = startup_lines(
            run.cfg, run.arch, run.runtime.world_size, run.runtime.device, run.algorithm
        )
    except ValueError as err:  # a shape the planner does not plan must not stop a run
        plan = [f"note: no memory plan: {err}"]
    for line in plan:
        _say(True, line)


def _resolve_loop(run: _Run, train, val, max_time: float | None):
    """The run's `LoopSettings` (`trainer.<algorithm>.*` over the splits' global batches)."""
    cfg = run.cfg
    return resolve_loop(
        cfg.trainer.kto if run.algorithm == "kto" else cfg.trainer.dpo,
        train.num_global_batches,
        val.num_global_batches if val is not None else 0,
        cfg.model.global_batch_size,
        cfg.trainer.log_every_n_steps,
        max_time,
    )


def _note_warmup(run: _Run, loop) -> None:
    """Say so when the warmup is as long as the run (the peak learning rate is never reached)."""
    sched = run.cfg.model.optim.sched
    if sched.name != "Constant" and sched.warmup_steps >= loop.max_steps:
        _say(
            run.runtime.is_rank0,
            f"note: model.optim.sched.warmup_steps ({sched.warmup_steps}) >= the run's "
            f"{loop.max_steps} steps: the learning rate never reaches model.optim.lr",
        )


def _restore(run: _Run, model, optimization, reference: ReferenceStrategy):
    """(checkpoint manager or None, starting `TrainerState`): the latest checkpoint of the log
    directory is loaded when `exp_manager.resume_if_exists`, once the reference strategy
    accepts it."""
    from megatron_kto.checkpointing.manager import CheckpointManager

    e = run.cfg.exp_manager
    if not e.create_checkpoint_callback:
        return None, TrainerState()
    manager = CheckpointManager(
        run.log_dir / "checkpoints",
        keep_last=e.checkpoint_callback_params.save_top_k,
        lora_base=base_record_of_run(run.cfg, model.chunks),
    )
    restored = manager.load_latest(model.chunks, *optimization) if e.resume_if_exists else None
    if restored is None:
        return manager, TrainerState()
    reference.check_resume(manager.loaded_from)
    state = TrainerState(
        step=restored["step"],
        epoch=restored["epoch"],
        consumed_samples=restored["consumed_samples"],
        # Checkpoints written before the count existed have none: nothing was skipped then.
        skipped_steps=restored.get("skipped_steps", 0),
    )
    _say(run.runtime.is_rank0, f"resumed from step {state.step} ({state.consumed_samples} samples)")
    return manager, state


def _build_trainer(run: _Run, model, optimization, splits, loop, restored, stop_requested):
    """(trainer, metrics logger): the KTO or DPO trainer with its logging, throughput figures
    and the checkpoint / Hugging Face output hook.

    Args:
        optimization: (optimizer, scheduler).
        splits: (train, validation or None).
        restored: (checkpoint manager or None, starting `TrainerState`), from `_restore`.
        stop_requested: whether a preemption signal asks the run to stop.
    """
    cfg, runtime, rank0 = run.cfg, run.runtime, run.runtime.is_rank0
    (optimizer, scheduler), (train, val), (manager, state) = optimization, splits, restored
    e = cfg.exp_manager
    logger = MetricsLogger(
        run.log_dir,
        rank0=rank0,
        tensorboard=e.create_tensorboard_logger,
        wandb=dict(e.wandb_logger_kwargs) if e.create_wandb_logger else None,
    )
    if rank0:
        logger.truncate_after(state.step)
    # MFU only against a known peak: the configured one, or a GPU's datasheet figure for the
    # run's dtype. A CPU's is not known (a timed matmul is not an upper bound on a shared
    # machine, so MFU could read above 1), and then MFU is not reported.
    peak = cfg.trainer.peak_flops_per_device or peak_flops_per_device(
        runtime.device, PRECISION_DTYPES[run.layout.precision]
    )
    hook = _checkpoint_hook(run, model, optimization, manager, lambda: trainer)
    trainer = (KTOTrainer if run.algorithm == "kto" else DPOTrainer)(
        model,
        optimizer,
        scheduler,
        train_loader=train.loader,
        val_loader=val.loader if val is not None else None,
        loop=loop,
        device=runtime.device,
        logger=logger,
        progress=ProgressReporter(loop.max_steps, rank0=rank0, initial_step=state.step),
        model_flops=architecture_flops(
            run.arch, run.arch.padded_vocab(cfg.model.tensor_model_parallel_size)
        ),
        peak_flops=peak,
        world_size=runtime.world_size,
        checkpoint_hook=hook,
        stop_requested=stop_requested,
        state=state,
        non_finite=cfg.trainer.non_finite,
        # fp16's loss scaler finds overflowing gradients itself and skips those steps.
        check_gradients=run.layout.precision != "16",
        row_sources=lambda indices: row_sources(train.dataset, train.paths, train.kind, indices),
    )
    return trainer, logger


def _checkpoint_hook(run: _Run, model, optimization, manager, trainer: Callable[[], Any]):
    """The trainer's `checkpoint_hook`: a training checkpoint (with `manager`) and the Hugging
    Face output (`exp_manager.save_hf`: at the end, or at every save)."""
    e = run.cfg.exp_manager
    optimizer, scheduler = optimization
    config_yaml = OmegaConf.to_yaml(run.cfg)
    hf_output = hf_output_of_run(run.cfg, run.arch, run.log_dir) if e.save_hf else None

    def checkpoint_hook(s: TrainerState, final: bool) -> None:
        saved = None
        if manager is not None:
            saved = manager.save(
                s.step,
                model.chunks,
                optimizer,
                scheduler,
                trainer().state_dict(),
                config_yaml,
                run.arch,
            )
        if hf_output is not None and (final or e.save_hf_every_save):
            hf_output.write(s.step, model.chunks, saved)

    return checkpoint_hook


USER_ERRORS: tuple[type[Exception], ...] = (ConfigError, CheckpointError)


def main(cfg: Any, algorithm: str) -> None:
    """Entry-script body (inside `entry.run_entry_point`, which reports user errors)."""
    run_alignment(cfg, algorithm)
