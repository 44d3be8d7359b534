"""Reference strategies as objects: `model.<algorithm>.reference_policy`, chosen once.

Each strategy owns every step of a run that depends on where the reference weights live:

- which examples its batches must name (`index_offset`: the keys of a precomputed table),
- what it builds before the policy is wrapped in DDP (`before_ddp`: `separate`'s frozen copy),
- the `models.reference.ReferencePolicy` it gives the model once the policy is wrapped
  (`after_ddp`),
- the work it does before the first step (`before_training`: `precomputed`'s forward passes),
- whether a resumed run can rebuild it (`check_resume`).

A reference-free DPO objective (`cpo`, `simpo`, `orpo`) gets `NoReference` (`none`): it builds,
computes and attaches nothing, and its policy refuses to be asked for log-probs — the model's
`needs_reference` is False, so the trainer never asks.

`choose_reference` picks the strategy from the validated config through one table
(`STRATEGIES`, name -> factory); nothing else branches on the strategy's name. The
implementations of the reference forward itself stay where they were: `models.reference`
(`cpu_swap`, `separate`, `precomputed`) and `peft.reference` (`adapters_off`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from megatron_kto.checkpointing.errors import CheckpointError
from megatron_kto.losses.dpo_types import NO_REFERENCE
from megatron_kto.models.reference import (
    CPUSwapReference,
    PrecomputedReference,
    ReferencePolicy,
    SeparateReference,
    copy_weights,
)
from megatron_kto.peft.reference import AdaptersOffReference
from megatron_kto.peft.settings import reference_strategy

Chunks = list[torch.nn.Module]


@dataclass(frozen=True)
class TrainingInputs:
    """What a strategy may read before the first step: the run's data and loop, and where the
    run keeps its files."""

    splits: Sequence[Any]
    """The run's `data.pipeline.Split`s (train first, then validation if any)."""
    architecture: Any
    """The model's `GPTArchitecture`."""
    runtime: Any
    """The run's `runtime.Runtime` (device, rank 0)."""
    log_dir: Path
    """`exp_manager.explicit_log_dir`."""
    loop: Any
    """The resolved `algorithms.dpo.LoopSettings` (steps, epochs, validation batches)."""


class ReferenceStrategy(Protocol):
    """Where a run's frozen reference policy lives, and each step of the run that depends on it."""

    name: str
    """The `reference_policy` value it implements."""

    def index_offset(self, first_example: int) -> int | None:
        """The `index` of a split's first example in its batches (`data.pipeline.build_split`),
        or None when batches need no example index."""
        ...

    def before_ddp(self, policy_chunks: Chunks, build_chunks: Callable[[], Chunks]) -> None:
        """Called once the policy holds its starting weights (and adapters), before DDP wraps it;
        `build_chunks()` builds a fresh set of chunks of the same layout."""
        ...

    def after_ddp(self, policy_chunks: Chunks) -> ReferencePolicy | None:
        """The reference policy for the DDP-wrapped policy chunks; None when it is attached
        later (`before_training`)."""
        ...

    def before_training(self, model: Any, inputs: TrainingInputs) -> None:
        """Called before the optimizer is built and the first step runs."""
        ...

    def check_resume(self, ckpt_dir: Path | None) -> None:
        """Refuse a resume from `ckpt_dir` whose reference would differ from the interrupted
        run's.

        Raises:
            CheckpointError: naming the checkpoint and the keys to resume with.
        """
        ...


def check_initialisation_reproducible(cfg: Any, ckpt_dir: Path | None) -> None:
    """Refuse a resume whose rebuilt initial weights would differ from the interrupted run's.

    Training checkpoints do not store the reference policy: a resumed run rebuilds it as the
    initial weights — `pretrained_checkpoint.restore_from_path` (layout-independent) or, without
    it, the seeded random initialisation. The latter depends on the pipeline layout (pipeline
    stages initialise their layers in a different order), so resuming a randomly initialised run
    under another PP/VPP would silently train against a different reference model.

    Raises:
        CheckpointError: the checkpoint's PP/VPP differ from the config's, without a starting
            checkpoint.
    """
    m = cfg.model
    if cfg.pretrained_checkpoint.restore_from_path or ckpt_dir is None:
        return
    from megatron_kto.checkpointing import files

    saved = files.read_json(ckpt_dir / files.CHECKPOINT_META).get("layout", {})
    first, last = _saved_pipeline_split(ckpt_dir)
    now = (
        m.pipeline_model_parallel_size,
        m.virtual_pipeline_model_parallel_size,
        m.num_layers_in_first_pipeline_stage,
        m.num_layers_in_last_pipeline_stage,
    )
    then = (
        saved.get("pipeline_model_parallel_size"),
        saved.get("virtual_pipeline_model_parallel_size"),
        first,
        last,
    )
    if then != now:
        names = (
            "model.pipeline_model_parallel_size",
            "model.virtual_pipeline_model_parallel_size",
            "model.num_layers_in_first_pipeline_stage",
            "model.num_layers_in_last_pipeline_stage",
        )

        def describe(values: tuple) -> str:
            pp, vpp, head, tail = values
            split = (
                f" first/last stage layers {head}/{tail}" if (head, tail) != (None, None) else ""
            )
            return f"PP={pp}" + (f" VPP={vpp}" if vpp else "") + split

        hint = " ".join(
            f"{k}={'null' if v is None else v}"
            for k, v, n in zip(names, then, now, strict=True)
            if v is not None or n is not None
        )
        raise CheckpointError(
            f"{ckpt_dir}: saved with {describe(then)}, resuming with {describe(now)}; without "
            "pretrained_checkpoint.restore_from_path the reference policy is the random "
            f"initialisation, which depends on the pipeline layout: resume with {hint}"
        )


def _saved_pipeline_split(ckpt_dir: Path) -> tuple[int | None, int | None]:
    """The first / last pipeline stage layer counts of the run that saved `ckpt_dir`, from its
    config.yaml (None where it had an even split or predates the keys)."""
    from omegaconf import OmegaConf

    from megatron_kto.checkpointing import files

    path = ckpt_dir / files.CONFIG
    model = OmegaConf.load(path).get("model", {}) if path.is_file() else {}
    return (
        model.get("num_layers_in_first_pipeline_stage"),
        model.get("num_layers_in_last_pipeline_stage"),
    )


class _InitialWeightsReference:
    """Shared steps of the strategies whose reference is the run's initial weights, rebuilt on a
    resume (cpu_swap, separate, adapters_off): batches need no example index, nothing runs
    before DDP or before training unless a strategy says so, and a resume must rebuild the same
    initial weights. Each strategy states only the steps where it differs."""

    def __init__(self, cfg: Any, algorithm: str):
        self._cfg = cfg

    def index_offset(self, first_example: int) -> int | None:
        return None

    def before_ddp(self, policy_chunks: Chunks, build_chunks: Callable[[], Chunks]) -> None:
        pass

    def before_training(self, model: Any, inputs: TrainingInputs) -> None:
        pass

    def check_resume(self, ckpt_dir: Path | None) -> None:
        check_initialisation_reproducible(self._cfg, ckpt_dir)


class CPUSwap(_InitialWeightsReference):
    """`cpu_swap`: a host copy of the initial weights, swapped into the policy chunks for each
    reference pass (`models.reference.CPUSwapReference`)."""

    name = "cpu_swap"

    def after_ddp(self, policy_chunks: Chunks) -> ReferencePolicy | None:
        # After DDP: the host copy is taken from the wrapped chunks' (final) parameter storage.
        return CPUSwapReference(policy_chunks)


class Separate(_InitialWeightsReference):
    """`separate`: a frozen second set of chunks on the device, a copy of the initial policy
    (`models.reference.SeparateReference`)."""

    name = "separate"

    def __init__(self, cfg: Any, algorithm: str):
        super().__init__(cfg, algorithm)
        self._reference: SeparateReference | None = None

    def before_ddp(self, policy_chunks: Chunks, build_chunks: Callable[[], Chunks]) -> None:
        # Before DDP: the copy is a plain model that never gets gradient buffers.
        ref_chunks = build_chunks()
        copy_weights(policy_chunks, ref_chunks)
        self._reference = SeparateReference(ref_chunks)

    def after_ddp(self, policy_chunks: Chunks) -> ReferencePolicy | None:
        return self._reference


class AdaptersOff(_InitialWeightsReference):
    """`adapters_off` (LoRA): the policy chunks themselves with the adapters off, or switched to
    the frozen starting adapter (`peft.reference.AdaptersOffReference`); the base weights are the
    reference, rebuilt on a resume like any initial weights."""

    name = "adapters_off"

    def after_ddp(self, policy_chunks: Chunks) -> ReferencePolicy | None:
        return AdaptersOffReference(policy_chunks)


class Precomputed:
    """`precomputed`: the run's reference log-probs computed over the data before training
    (`algorithms.precompute`), then looked up by example (`models.reference.PrecomputedReference`).

    The table is kept in the run directory, so a resumed run reads it back instead of rebuilding
    the reference weights.
    """

    name = "precomputed"

    def __init__(self, cfg: Any, algorithm: str):
        self._cfg = cfg
        self._algorithm = algorithm

    def index_offset(self, first_example: int) -> int | None:
        # Train examples first, then validation examples: one table row per example.
        return first_example

    def before_ddp(self, policy_chunks: Chunks, build_chunks: Callable[[], Chunks]) -> None:
        pass

    def after_ddp(self, policy_chunks: Chunks) -> ReferencePolicy | None:
        return None  # the table needs the model to compute it: `before_training`

    def before_training(self, model: Any, inputs: TrainingInputs) -> None:
        """Load the table from the run directory, or compute it with the policy's starting
        weights (LoRA: the base, plus the frozen starting adapter), and attach it to `model`."""
        from megatron_kto.algorithms.precompute import Coverage, load_or_compute
        from megatron_kto.peft.wiring import reference_adapters

        cfg, loop, log_dir = self._cfg, inputs.loop, inputs.log_dir
        fingerprint = self._fingerprint(model, inputs)
        resuming = (
            cfg.exp_manager.resume_if_exists and (log_dir / "checkpoints" / "latest").exists()
        )
        if inputs.runtime.is_rank0:
            print(
                "precomputing reference log-probs over the data (reference_policy=precomputed)",
                flush=True,
            )
        with reference_adapters(model.chunks):  # LoRA: base (+ the frozen starting adapter)
            table = load_or_compute(
                model,
                inputs.splits,
                inputs.runtime,
                Coverage(loop.max_steps, loop.steps_per_epoch, loop.limit_val_batches),
                log_dir / "reference_logps",
                fingerprint,
                resuming,
            )
        model.reference = PrecomputedReference(table)

    def _fingerprint(self, model: Any, inputs: TrainingInputs) -> dict[str, Any]:
        """Everything the looked-up rows depend on: data, weights, and (KTO) the batch order that
        picks the KL partners; how many steps are covered is checked separately."""
        from megatron_kto.data.cache import content_hash
        from megatron_kto.data.pipeline import resolve_path
        from megatron_kto.peft.settings import reference_includes_starting_adapter

        cfg, splits = self._cfg, inputs.splits
        fingerprint = {
            "algorithm": self._algorithm,
            "files": [[str(p) for p in s.stats.files] for s in splits],
            "content": [[content_hash(p) for p in s.stats.files] for s in splits],
            "examples": [len(s.dataset) for s in splits],
            "restore_from_path": cfg.pretrained_checkpoint.restore_from_path,
            "seed": cfg.model.seed,
            "shuffle": cfg.model.data.shuffle,
            "global_batch_size": cfg.model.global_batch_size,
            "architecture": inputs.architecture.to_dict(),
            "settings": repr(model.settings),
        }
        if reference_includes_starting_adapter(cfg.model):
            path = cfg.model.peft.restore_from_path
            fingerprint["reference_adapter"] = (
                content_hash(resolve_path(path)) if path else repr(cfg.model.peft.lora_tuning)
            )
        return fingerprint

    def check_resume(self, ckpt_dir: Path | None) -> None:
        pass  # the table computed by the interrupted run is read back, not recomputed


class NoReference:
    """`none`: the objective reads no reference (`losses.dpo_types.DPOLossKind.needs_reference`
    is False): no reference weights, no reference pass, no precomputed table."""

    name = NO_REFERENCE

    def __init__(self, cfg: Any, algorithm: str):
        self._loss_type = cfg.model.dpo.loss_type

    def index_offset(self, first_example: int) -> int | None:
        return None

    def before_ddp(self, policy_chunks: Chunks, build_chunks: Callable[[], Chunks]) -> None:
        pass

    def after_ddp(self, policy_chunks: Chunks) -> ReferencePolicy | None:
        return NoReferencePolicy(self._loss_type)

    def before_training(self, model: Any, inputs: TrainingInputs) -> None:
        if model.needs_reference:  # the strategy follows the loss type: they cannot disagree
            raise RuntimeError(
                f"reference_policy=none, but loss_type {model.settings.loss_type} reads a reference"
            )
        if inputs.runtime.is_rank0:
            print(
                f"reference: none — loss_type {self._loss_type} is reference-free: no reference "
                "model is used (no reference weights, no reference pass)",
                flush=True,
            )

    def check_resume(self, ckpt_dir: Path | None) -> None:
        pass  # nothing to rebuild


class NoReferencePolicy:
    """The `ReferencePolicy` of a reference-free run: asking it for log-probs is a bug."""

    def __init__(self, loss_type: Any):
        self._loss_type = loss_type

    def log_probs(self, batch: dict[str, torch.Tensor], forward: Any) -> torch.Tensor:
        raise RuntimeError(
            f"loss_type {self._loss_type} is reference-free: no reference pass may run"
        )


#: `reference_policy` -> the strategy's factory, called with (validated config, algorithm).
STRATEGIES: dict[str, Callable[[Any, str], ReferenceStrategy]] = {
    "cpu_swap": CPUSwap,
    "separate": Separate,
    "adapters_off": AdaptersOff,
    "precomputed": Precomputed,
    NO_REFERENCE: NoReference,
}


def choose_reference(cfg: Any, algorithm: str) -> ReferenceStrategy:
    """The run's reference strategy: `model.<algorithm>.reference_policy` (its default resolved,
    `peft.settings.reference_strategy`), from a config that `config.validate` accepted.

    Args:
        cfg: the composed `AlignmentConfig`.
        algorithm: 'kto' or 'dpo'.
    """
    return STRATEGIES[reference_strategy(cfg.model, algorithm)](cfg, algorithm)
