"""Training checkpoints: collective save/resume of model, optimizer, scheduler, RNG and trainer state.

One `dist_checkpointing.save` writes the model and optimizer tensors (torch_dist format, keyed by
layout-independent names, so a checkpoint resumes under another TP/PP/DP layout); small files
beside it hold the rest (see `files.py` for the layout on disk). A checkpoint is written to
`step_<N>.tmp/`, renamed to `step_<N>/` only once every rank has finished, and only then does
`latest` move to it — so a crash at any point leaves `latest` naming a complete checkpoint.

A save that cannot fit on the disk stops before it writes, and one that fails part-way (a disk
filled by another writer) stops every rank with the same one-line `CheckpointError` and removes
its `.tmp` (README.md, "A full disk").

Resuming tries the checkpoint `latest` names, then older ones: a damaged or partial directory is
skipped with a warning naming it; if none is usable, `CheckpointError` says so in one line.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import package_info, parallel_state
from torch.distributed.checkpoint.api import CheckpointException

from megatron_kto.checkpointing import files, optimizer_state, rng
from megatron_kto.checkpointing.adapter_files import (
    BASE_FILE,
    adapter_sharded_state_dict,
    check_same_base,
)
from megatron_kto.checkpointing.errors import CheckpointError
from megatron_kto.checkpointing.model_io import (
    load_adapter_state,
    model_sharded_state_dict,
    save_sharded,
    write_architecture,
)
from megatron_kto.checkpointing.pretrained import resolve_pretrained_dir, restore_pretrained
from megatron_kto.checkpointing.save_space import check_space, save_failure
from megatron_kto.checkpointing.spec_compat import load_module_state, load_sharded
from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.console import error_summary
from megatron_kto.models.builder import unwrap
from megatron_kto.models.training_setup import finish_param_sync

__all__ = ["CheckpointManager", "current_layout", "resolve_pretrained_dir", "restore_pretrained"]

logger = logging.getLogger(__name__)

#: trainer_state keys a resume cannot do without (the sampler restarts from them).
REQUIRED_TRAINER_KEYS = ("epoch", "consumed_samples")


class _Incompatible(CheckpointError):
    """The checkpoint is intact but cannot be loaded into this run; older ones would not be either."""


def current_layout() -> dict[str, int | None]:
    """This run's parallel layout, as recorded in checkpoint.json."""
    return {
        "world_size": dist.get_world_size(),
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_model_parallel_size": (
            parallel_state.get_virtual_pipeline_model_parallel_world_size()
        ),
        "data_parallel_size": parallel_state.get_data_parallel_world_size(),
        "expert_model_parallel_size": parallel_state.get_expert_model_parallel_world_size(),
        "expert_tensor_parallel_size": parallel_state.get_expert_tensor_parallel_world_size(),
    }


def _saved(layout: dict[str, Any], key: str) -> Any:
    """A saved layout's `key`, with the value it had before the key was recorded: EP 1, and
    expert TP = the attention's TP (megatron-core's default)."""
    if key == "expert_model_parallel_size":
        return layout.get(key, 1)
    if key == "expert_tensor_parallel_size":
        return layout.get(key, layout.get("tensor_model_parallel_size"))
    return layout.get(key)


def _describe(layout: dict[str, Any], kind: str | None) -> str:
    vpp = layout.get("virtual_pipeline_model_parallel_size")
    tp = layout.get("tensor_model_parallel_size")
    text = (
        f"TP={layout.get('tensor_model_parallel_size')} PP={layout.get('pipeline_model_parallel_size')}"
        + (f" VPP={vpp}" if vpp else "")
        + f" DP={layout.get('data_parallel_size')}"
        + (
            f" EP={layout['expert_model_parallel_size']}"
            if layout.get("expert_model_parallel_size", 1) > 1
            else ""
        )
        + (f" ETP={etp}" if (etp := _saved(layout, "expert_tensor_parallel_size")) != tp else "")
    )
    return f"{text}, {kind or 'no'} optimizer"


class CheckpointManager:
    """Saves training checkpoints under one root directory and resumes from them.

    Every method is collective: all ranks call it with their own model chunks and optimizer.

    Args:
        root: checkpoint root, e.g. `<explicit_log_dir>/checkpoints` (created if missing).
        keep_last: how many complete checkpoints to keep; ≤ 0 keeps all.
        lora_base: for a LoRA run, the record of its frozen base (`adapter_files.base_record`):
            checkpoints then hold the adapters and their optimizer state only, plus this record,
            and resuming refuses a checkpoint trained on another base.
    """

    def __init__(
        self, root: str | Path, keep_last: int = -1, lora_base: dict[str, Any] | None = None
    ) -> None:
        self.root = Path(root)
        self.keep_last = int(keep_last)
        self.lora_base = lora_base
        self.loaded_from: Path | None = None
        """The directory the last successful load read."""
        self._last_saved_step: int | None = None
        self._rank = dist.get_rank()
        # Our control messages are a few integers; a gloo group keeps them off the GPU and works
        # whatever the default backend is.
        self._group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        ok = True
        if self._rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                for path in files.remove_stale(self.root):
                    logger.warning(
                        "removed incomplete checkpoint %s (left by an interrupted save)", path
                    )
            except OSError as e:
                ok = False
                logger.error("cannot prepare checkpoint directory %s: %s", self.root, e)
        if not self._all_ok(ok):
            raise CheckpointError(f"{self.root}: cannot create or clean the checkpoint directory")

    # ----------------------------------------------------------------------------------- helpers
    def _all_ok(self, ok: bool) -> bool:
        """True when `ok` holds on every rank (doubles as a barrier)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
        return bool(flag.item())

    def _from_rank0(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(t, src=0, group=self._group)
        return int(t.item())

    def _model_state(self, model_chunks: list[torch.nn.Module]) -> dict[str, Any]:
        """The model tensors a checkpoint holds: all of them, or a LoRA run's adapters."""
        model_sd = model_sharded_state_dict(model_chunks)
        if self.lora_base is None:
            return model_sd
        return adapter_sharded_state_dict(model_sd)

    # -------------------------------------------------------------------------------------- save
    def save(
        self,
        step: int,
        model_chunks: list[torch.nn.Module],
        optimizer: Any,
        scheduler: Any,
        trainer_state: dict[str, Any],
        config_yaml: str,
        arch: GPTArchitecture,
    ) -> Path:
        """Write the checkpoint after `step` optimizer steps; returns `<root>/step_<step>`.

        Args:
            step: optimizer steps taken so far.
            model_chunks: this rank's (DDP-wrapped) model chunks.
            optimizer: the megatron optimizer (or None to save weights only).
            scheduler: the `OptimizerParamScheduler` (or None).
            trainer_state: JSON-serialisable progress; must hold `epoch` and `consumed_samples`
                (plus anything else the trainer needs back, e.g. sampler state). `step` is added.
            config_yaml: the resolved run config, stored as config.yaml.
            arch: the model architecture, stored as architecture.json.
        """
        state = self._trainer_record(step, trainer_state)
        final = self.root / files.step_dir_name(step)
        if self._last_saved_step == step:
            return final  # e.g. the final save right after an interval save at the same step
        tmp = final.with_name(final.name + files.TMP_SUFFIX)

        # With overlap_param_gather the last step's all-gather is still pending: save the
        # updated weights, not the stale shards of other DP ranks.
        finish_param_sync(model_chunks)
        model_sd = self._model_state(model_chunks)
        sharded = dict(model_sd)
        kind = optimizer_state.optimizer_kind(optimizer)
        if optimizer is not None:
            sharded["optimizer"] = optimizer_state.sharded_state_dict(optimizer, model_sd, False)
        # Before anything is written: a save that cannot fit stops here, whole, instead of
        # failing part-way through megatron-core's writers.
        space = check_space(self.root, self._group, self._rank, step, tmp, sharded)

        error: BaseException | None = None
        if self._rank == 0:
            try:
                files.remove_stale(self.root)
                tmp.mkdir(parents=True)
            except OSError as e:
                error = e
        if not self._all_ok(error is None):
            raise save_failure(self.root, self._rank, tmp, step, error, space)

        try:
            save_sharded(sharded, tmp)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 — agreed on below
            # megatron-core has already agreed: every rank raises (details on rank 0).
            error = e
        if error is None:
            try:
                self._write_records(
                    tmp, step, state, kind, model_chunks, scheduler, config_yaml, arch
                )
            except OSError as e:
                error = e
        if not self._all_ok(error is None):
            raise save_failure(self.root, self._rank, tmp, step, error, space)

        if self._rank == 0:
            try:
                files.write_manifest(tmp)
                files.commit(tmp, final)
                for path in files.prune(self.root, self.keep_last, step):
                    logger.info("removed old checkpoint %s (keep_last=%d)", path, self.keep_last)
            except OSError as e:
                error = e
        if not self._all_ok(error is None):
            raise save_failure(
                self.root, self._rank, tmp if tmp.exists() else final, step, error, space
            )
        self._last_saved_step = step
        return final

    def _write_records(
        self,
        tmp: Path,
        step: int,
        state: dict[str, Any],
        kind: str | None,
        model_chunks: list[torch.nn.Module],
        scheduler: Any,
        config_yaml: str,
        arch: GPTArchitecture,
    ) -> None:
        """The files beside the tensors: this rank's RNG, and (rank 0) the JSON records."""
        rng.save(tmp, self._rank)
        if self._rank != 0:
            return
        meta = {
            "format": files.FORMAT,
            "step": int(step),
            "layout": current_layout(),
            "optimizer": kind,
            "optimizer_sharding": (
                optimizer_state.SHARDING_METADATA["distrib_optim_sharding_type"]
                if kind == "distributed"
                else None
            ),
            "model_chunks": len(model_chunks),
            # Routed experts in their own optimizer at every EP size (training_setup.
            # mark_experts_expert_parallel): the state has one structure for all EPs.
            "experts_own_optimizer": True,
            "megatron_core_version": package_info.__version__,
        }
        files.write_json(tmp / files.CHECKPOINT_META, meta)
        files.write_json(tmp / files.TRAINER_STATE, state)
        if scheduler is not None:
            files.write_json(tmp / files.SCHEDULER, scheduler.state_dict())
        files.atomic_write_text(tmp / files.CONFIG, config_yaml)
        write_architecture(tmp, arch)
        if self.lora_base is not None:
            files.write_json(tmp / BASE_FILE, self.lora_base)

    @staticmethod
    def _trainer_record(step: int, trainer_state: dict[str, Any]) -> dict[str, Any]:
        if "step" in trainer_state and int(trainer_state["step"]) != int(step):
            raise ValueError(f"trainer_state['step']={trainer_state['step']} but step={step}")
        missing = [k for k in REQUIRED_TRAINER_KEYS if k not in trainer_state]
        if missing:
            raise ValueError(
                f"trainer_state lacks {missing}: a resumed run could not restart its data"
            )
        state = {**trainer_state, "step": int(step)}
        try:
            json.dumps(state)
        except (TypeError, ValueError) as e:
            raise ValueError(f"trainer_state is not JSON-serialisable: {e}") from e
        return state

    # -------------------------------------------------------------------------------------- load
    def load_latest(
        self, model_chunks: list[torch.nn.Module], optimizer: Any = None, scheduler: Any = None
    ) -> dict[str, Any] | None:
        """Resume from the newest usable checkpoint under the root.

        Returns:
            The saved trainer state (`step`, `epoch`, `consumed_samples`, ...), or None when the
            root holds no checkpoint at all (a fresh run).

        Raises:
            CheckpointError: checkpoints exist but none is usable, or the newest usable one
                cannot be loaded into this run (e.g. another optimizer type).
        """
        candidates, notes = files.candidates(self.root)
        if self._rank == 0:
            for note in notes:
                logger.warning("%s", note)
        marker_exists = (self.root / files.LATEST).exists()
        if not candidates and not marker_exists:
            return None
        return self._load_first_usable(
            candidates, model_chunks, optimizer, scheduler, str(self.root)
        )

    def load(
        self,
        path: str | Path,
        model_chunks: list[torch.nn.Module],
        optimizer: Any = None,
        scheduler: Any = None,
    ) -> dict[str, Any]:
        """Resume from `path`: a `step_<N>` directory (exactly that one) or a root (newest usable).

        Returns:
            The saved trainer state.

        Raises:
            CheckpointError: nothing usable at `path`.
        """
        path = Path(path)
        if files.parse_step(path.name) is not None or (path / files.CHECKPOINT_META).exists():
            return self._load_first_usable([path], model_chunks, optimizer, scheduler, str(path))
        candidates, notes = files.candidates(path)
        if self._rank == 0:
            for note in notes:
                logger.warning("%s", note)
        return self._load_first_usable(candidates, model_chunks, optimizer, scheduler, str(path))

    def _load_first_usable(
        self,
        candidates: list[Path],
        model_chunks: list[torch.nn.Module],
        optimizer: Any,
        scheduler: Any,
        where: str,
    ) -> dict[str, Any]:
        problems: list[str] = []
        for i, path in enumerate(candidates):
            older = i + 1 < len(candidates)
            # Rank 0 inspects the files (the file system is shared) and tells the others.
            problem = files.check_complete(path) if self._rank == 0 else None
            if not self._from_rank0(0 if problem else 1):
                self._skip(path, problem or "incomplete (see rank 0)", problems, older)
                continue
            # Phase 1 reads the small files and checks compatibility; phase 2 is the collective
            # tensor load. Agreeing in between keeps a rank that failed early from leaving the
            # others waiting inside dist_checkpointing.
            error: Exception | None = None
            try:
                plan = self._read_records(path, optimizer, scheduler)
            except Exception as e:  # noqa: BLE001 — any failure means "try the previous one"
                error = e
            if self._all_ok(error is None):
                try:
                    state = self._load_tensors(path, plan, model_chunks, optimizer, scheduler)
                except Exception as e:  # noqa: BLE001
                    error = e
                if self._all_ok(error is None):
                    self.loaded_from = path
                    if path.parent == self.root:
                        # The trainer may save again at the step it resumed from (e.g. when
                        # preempted at once): that checkpoint is this directory already.
                        self._last_saved_step = int(state["step"])
                    if self._rank == 0:
                        logger.info("resumed from %s (step %s)", path, state.get("step"))
                    return state
            if isinstance(error, _Incompatible):
                raise CheckpointError(str(error)) from error
            if error is not None and self._rank != 0:
                # Rank 0 only learns that some rank failed: say why from here.
                logger.warning("rank %d cannot load %s: %s", self._rank, path, error_summary(error))
            self._skip(
                path, error_summary(error) if error else "failed on another rank", problems, older
            )
        detail = "; ".join(problems) if problems else "no step_<N> directories"
        raise CheckpointError(f"{where}: no usable checkpoint ({detail})")

    def _skip(self, path: Path, problem: str, problems: list[str], older: bool) -> None:
        problems.append(f"{path.name}: {problem}")
        if self._rank == 0:
            then = "trying the previous one" if older else "no older checkpoint left"
            logger.warning("skipping checkpoint %s: %s — %s", path, problem, then)

    def _read_records(self, path: Path, optimizer: Any, scheduler: Any) -> dict[str, Any]:
        """Read the JSON records and this rank's RNG file; refuse incompatible checkpoints."""
        meta = files.read_json(path / files.CHECKPOINT_META)
        layout = current_layout()
        saved_layout = meta.get("layout", {})
        saved_kind, kind = meta.get("optimizer"), optimizer_state.optimizer_kind(optimizer)
        if optimizer is not None and saved_kind is None:
            raise _Incompatible(
                f"{path}: holds weights only (saved without optimizer state), so training "
                "cannot resume from it; start a new run from these weights with "
                f"pretrained_checkpoint.restore_from_path={path}"
            )
        if optimizer is not None and saved_kind != kind:
            raise _Incompatible(
                f"{path}: saved with {_describe(saved_layout, saved_kind)}; this run has "
                f"{_describe(layout, kind)}. megatron-core 0.16.1 cannot convert optimizer state "
                "between the distributed and the standard optimizer: resume with the same "
                "model.optim.name, or start a new run from these weights with "
                f"pretrained_checkpoint.restore_from_path={path}"
            )
        lora_saved = (path / BASE_FILE).is_file()
        if self.lora_base is not None:
            try:
                check_same_base(path, self.lora_base["fingerprint"])
            except CheckpointError as e:
                raise _Incompatible(str(e)) from e
        elif lora_saved:
            raise _Incompatible(
                f"{path}: holds LoRA adapters only; resume it with model.peft.peft_scheme=lora"
            )
        saved_ep = saved_layout.get("expert_model_parallel_size", 1)  # absent before EP existed
        # Before experts got their own optimizer at EP = 1 too, an EP = 1 checkpoint of an MoE
        # model holds them in the dense optimizer's state (EP > 1 ones already had it split).
        split_saved = meta.get("experts_own_optimizer", saved_ep > 1)
        split_now = len(optimizer_state.inner_optimizers(optimizer)) > 1
        if optimizer is not None and split_now and not split_saved:
            raise _Incompatible(
                f"{path}: saved with {_describe(saved_layout, saved_kind)} by an older "
                "megatron_kto that kept the experts in the dense optimizer; its optimizer state "
                "does not load into this one: start a new run from these weights with "
                f"pretrained_checkpoint.restore_from_path={path}"
            )
        same_layout = all(_saved(saved_layout, k) == v for k, v in layout.items())
        return {
            "meta": meta,
            "layout": layout,
            "kind": kind,
            "trainer_state": files.read_json(path / files.TRAINER_STATE),
            "scheduler": files.read_json(path / files.SCHEDULER) if scheduler is not None else None,
            "rng": rng.load(path, self._rank) if same_layout else None,
        }

    def _load_tensors(
        self,
        path: Path,
        plan: dict[str, Any],
        model_chunks: list[torch.nn.Module],
        optimizer: Any,
        scheduler: Any,
    ) -> dict[str, Any]:
        """Collective tensor load, then scheduler and RNG; returns the trainer state."""
        model_sd = self._model_state(model_chunks)
        sharded = dict(model_sd)
        if optimizer is not None:
            sharded["optimizer"] = optimizer_state.sharded_state_dict(optimizer, model_sd, True)
        # Tolerates Transformer Engine's extra state on either side (spec_compat).
        loaded = load_sharded(sharded, path)
        for i, chunk in enumerate(model_chunks):
            key = "model" if len(model_chunks) == 1 else f"model{i}"
            if self.lora_base is not None:
                load_adapter_state(chunk, loaded[key], str(path))
            else:
                load_module_state(unwrap(chunk), loaded[key], str(path))
        if optimizer is not None:
            optimizer_state.load_state_dict(optimizer, loaded["optimizer"])

        if scheduler is not None:
            optimizer_state.load_scheduler_state(scheduler, plan["scheduler"])
        if plan["rng"] is not None:
            rng.restore(plan["rng"])
        elif self._rank == 0:
            logger.warning(
                "%s: saved under %s, resuming under %s; RNG states are per rank and were not "
                "restored (dropout masks will differ from an uninterrupted run)",
                path,
                _describe(plan["meta"].get("layout", {}), plan["meta"].get("optimizer")),
                _describe(plan["layout"], plan["kind"]),
            )
        return plan["trainer_state"]
