"""A training run's Hugging Face output (`exp_manager.save_hf`): the trained model as a directory
`transformers` (or `peft`) loads, written by the run itself at its final save (and at every save
with `exp_manager.save_hf_every_save`). Training checkpoints stay megatron's; this is an export.

Layout under `exp_manager.explicit_log_dir`:

- `hf/`: config.json (as `tools/convert_checkpoint.py export` writes it), safetensors weights
  (`model.safetensors`, or `model-0000k-of-0000n.safetensors` + `model.safetensors.index.json`),
  the run's tokenizer files with its chat template, generation_config.json, and
  `hf_export.json` (the step and checkpoint it was written from). For a LoRA run `hf/` is the
  PEFT adapter directory instead (adapter_config.json + adapter_model.safetensors + tokenizer).
- `hf_merged/`: a LoRA run with `exp_manager.save_hf_merged`: base + adapters merged, laid out
  as `hf/` of a full run.

Gathering: each pipeline stage converts its own layers with the conversion table
(`mappings.to_hf` on `gather.StageTensors`: tensor/expert-parallel shards gathered one tensor at
a time) and its writer (TP rank 0, DP and CP rank 0) writes the stage's shard files; rank 0 then names
the shards and writes the index and the small files. A rank holds at most one shard file's
tensors (`exp_manager.save_hf_max_shard_mb`) plus one gathered tensor — never the whole model.

Failing: a write that fails on a writer (a full disk, a lost mount) does not stop it taking part
in the stage's gathers — it writes nothing more but takes every tensor still due, so no rank is
left waiting in a collective. All ranks then agree through fixed-size collectives (`_agree`)
and raise the same one-line `CheckpointError`, naming the directory, the failing rank and the
cause; rank 0 removes `<name>.tmp/`. The previous directory and the training checkpoints are
not touched.

Replacing: a directory is written as `<name>.tmp/`; then the previous one is moved to
`<name>.old/`, the new one renamed in, and the old one removed. An interrupted export leaves
either the previous directory or (between the renames) `<name>.old/`, which the next export
puts back before it starts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_kto.checkpointing.errors import CheckpointError
from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.console import error_summary
from megatron_kto.conversion.mappings import to_hf
from megatron_kto.conversion.safetensors_io import ShardSet, finish_shards, write_shard_files
from megatron_kto.hf_writer.convert import (
    DTYPES,
    HF_CONFIG,
    copy_tokenizer,
    export_config,
    export_notes,
    source_config,
    source_dir,
)
from megatron_kto.hf_writer.gather import StageTensors
from megatron_kto.runtime.disk import free_bytes, no_space_cause, size

logger = logging.getLogger(__name__)

HF_DIR, MERGED_DIR = "hf", "hf_merged"
RECORD = "hf_export.json"
GENERATION_CONFIG = "generation_config.json"
CHAT_TEMPLATE = "chat_template.jinja"
#: Bytes of a failure line sent from the failing rank to the others (longer ones are cut).
_MESSAGE_BYTES = 1024


def _base_source(restore_from_path: str | None) -> tuple[Path | None, dict[str, Any] | None]:
    """(directory, config.json) of the Hugging Face model a run descends from, if known: a
    Hugging Face directory given directly, or the imported checkpoint (its hf_config.json) that
    `restore_from_path` resolves to."""
    from megatron_kto.checkpointing.locate import resolve_pretrained_dir

    if not restore_from_path:
        return None, None
    path = Path(restore_from_path)
    if (path / "config.json").is_file() and not (path / HF_CONFIG).is_file():
        return path, json.loads((path / "config.json").read_text())
    try:
        source = source_dir(resolve_pretrained_dir(path, warn=lambda _: None))
    except CheckpointError:
        return None, None
    if source is None:
        return None, None
    return source, json.loads(source_config(source).read_text())


class HFOutput:
    """Writes a run's Hugging Face output; `write` is collective (every rank calls it).

    Args:
        arch: the model's architecture.
        run_dir: `exp_manager.explicit_log_dir`.
        restore_from_path: the run's `pretrained_checkpoint.restore_from_path` (its config.json
            is the base of ours, as on export; a LoRA adapter names it as its base model).
        tokenizer_model: the run's resolved `model.tokenizer.model` (file or directory).
        chat_template: the run's `model.tokenizer.chat_template` override (text or file), if any.
        lora: a LoRA run's `peft.wiring.LoRASettings` (then `hf/` is the adapter directory).
        merged: a LoRA run also writes base + adapters merged to `hf_merged/`.
        max_shard_bytes: largest safetensors file.
        dtype: weights on disk; None means the source model's (else float32), as on export.

    Raises:
        ConversionError: the architecture has no Hugging Face model type, or a bad dtype.
    """

    def __init__(
        self,
        arch: GPTArchitecture,
        run_dir: str | Path,
        *,
        restore_from_path: str | None,
        tokenizer_model: str | None,
        chat_template: str | None = None,
        lora: Any = None,
        merged: bool = False,
        max_shard_bytes: int = 5 * 1024**3,
        dtype: str | None = None,
    ) -> None:
        self.arch = arch
        self.run_dir = Path(run_dir)
        self.restore_from_path = restore_from_path
        self.tokenizer_model = Path(tokenizer_model) if tokenizer_model else None
        self.chat_template = chat_template
        self.lora = lora
        self.merged = bool(merged and lora is not None)
        self.max_shard_bytes = int(max_shard_bytes)
        self.source, base = _base_source(restore_from_path)
        self.config, self.model_type, self.dtype = export_config(arch, base, None, dtype)
        self.notes = export_notes(base, self.dtype)
        """What the full-model output writes differently from the source (`export_notes`)."""
        self.last_step: int | None = None
        """The step of the last export this process wrote."""
        self._rank = dist.get_rank()
        self._group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")

    # ----------------------------------------------------------------------------------- helpers
    def _agree(self, failure: str | None) -> str | None:
        """Every rank's answer to "did any rank fail?": the failure line of the lowest failing
        rank (the same text on every rank), or None. Collective; fixed-size messages only (a
        flag reduction, then one broadcast of `_MESSAGE_BYTES` from that rank), so ranks that
        disagree about failing still meet in the same two collectives."""
        world = dist.get_world_size()
        first = torch.tensor([self._rank if failure is not None else world], dtype=torch.int64)
        dist.all_reduce(first, op=dist.ReduceOp.MIN, group=self._group)
        src = int(first.item())
        if src == world:
            return None
        buffer = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
        if src == self._rank:
            text = failure.encode()[:_MESSAGE_BYTES]  # type: ignore[union-attr]
            buffer[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        dist.broadcast(buffer, src=src, group=self._group)
        return bytes(buffer.tolist()).rstrip(b"\0").decode(errors="ignore")

    def _dirs(self) -> list[Path]:
        names = [HF_DIR] + ([MERGED_DIR] if self.merged else [])
        return [self.run_dir / name for name in names]

    # -------------------------------------------------------------------------------------- write
    def write(self, step: int, chunks: list[torch.nn.Module], checkpoint: Path | None) -> None:
        """Export the model after `step` optimizer steps (skipped if that step was exported).

        Args:
            step: optimizer steps taken.
            chunks: this rank's model chunks (DDP-wrapped or not).
            checkpoint: the training checkpoint of the same step (recorded), if one was saved.

        Raises:
            CheckpointError: one line naming the directory, on every rank.
        """
        from megatron_kto.models.training_setup import finish_param_sync

        if self.last_step == step:
            return  # e.g. the final save right after an interval save at the same step
        tmps = [d.with_name(d.name + ".tmp") for d in self._dirs()]
        problem = None
        if self._rank == 0:
            try:
                for final, tmp in zip(self._dirs(), tmps, strict=True):
                    _recover(final)
                    shutil.rmtree(tmp, ignore_errors=True)
                    tmp.mkdir(parents=True)
            except OSError as e:
                problem = f"{tmps[0]}: cannot create the Hugging Face output directory: {e}"
        problem = self._agree(problem)
        if problem is not None:
            raise CheckpointError(problem)
        # With overlap_param_gather the last step's all-gather may still be pending.
        finish_param_sync(chunks)
        try:
            error = self._write_stage(chunks, tmps)
        except Exception as e:  # noqa: BLE001 — every rank must reach the agreement below
            error = e
        failure = self._agree(self._failure_line(error, tmps[0], checkpoint))
        if failure is None:
            if self._rank == 0:
                try:
                    self._finish(step, checkpoint, tmps)
                except Exception as e:  # noqa: BLE001
                    error = e
            failure = self._agree(self._failure_line(error, tmps[0], checkpoint))
        if failure is not None:
            if self._rank == 0:  # every rank has left its writes: nothing is being written
                for tmp in tmps:
                    shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(failure)
        self.last_step = step
        if self._rank == 0:
            logger.info("wrote the Hugging Face output of step %d to %s", step, self._dirs()[0])
            for note in self.notes if self.lora is None or self.merged else ():
                logger.info("%s: %s", self._dirs()[-1], note)

    def _failure_line(
        self, error: BaseException | None, where: Path, checkpoint: Path | None = None
    ) -> str | None:
        """The one line every rank reports for this rank's `error` (None: no error); for a full
        disk, the space free and the checkpoint a rerun exports from."""
        if error is None:
            return None
        cause = no_space_cause(error)
        if cause is None:
            return (
                f"{where}: writing the Hugging Face output failed on rank {self._rank}: "
                f"{error_summary(error)}"
            )
        kept = (
            f"the checkpoint {checkpoint} is complete and a rerun of the same command writes "
            "the output from it"
            if checkpoint is not None
            else "the checkpoints are as they were"
        )
        return (
            f"{where}: {cause} writing the Hugging Face output on rank {self._rank} "
            f"({size(free_bytes(where))} free); {kept}; free space and rerun the same command"
        )

    def _write_stage(self, chunks: list[torch.nn.Module], tmps: list[Path]) -> Exception | None:
        """This pipeline stage's part, on every rank of the stage (the writer keeps it).

        Returns:
            The writer's first failed write (None: all written; always None elsewhere). After a
            failed write the writer writes nothing more but still takes part in every gather of
            the stage, so the other ranks are never left waiting in one: all of them reach the
            agreement in `write` together.
        """
        from safetensors.torch import save_file

        stage = StageTensors(chunks, self.arch, self.model_type)
        writer = (  # one writer per stage: context-parallel ranks hold the same weights too
            ps.get_tensor_model_parallel_rank() == 0
            and ps.get_data_parallel_rank(with_context_parallel=True) == 0
        )
        part = ps.get_pipeline_model_parallel_rank()
        if self.lora is None:
            return self._write_weights(stage.get, stage, tmps[0], writer, part)
        from megatron_kto.peft.hf_peft import full_tensors

        adapters = full_tensors(chunks)  # collective over TP
        error: Exception | None = None
        if writer:
            try:
                save_file(adapters, str(tmps[0] / _adapter_part(part)), metadata={"format": "pt"})
            except Exception as e:  # noqa: BLE001 — the merged weights' gathers still follow
                error = e
        if self.merged:
            getter = _merged_getter(stage, chunks)
            late = self._write_weights(getter, stage, tmps[1], writer and error is None, part)
            error = error or late
        return error

    def _write_weights(
        self, get: Any, stage: StageTensors, out: Path, writer: bool, part: int
    ) -> Exception | None:
        """Convert (and gather) the stage's tensors in table order; the writer writes them.

        Returns:
            The writer's failed write (None: written, or not the writer). The tensors are
            taken to the end either way: each may be a collective the stage's ranks share.
        """
        tensors = to_hf(
            get,
            self.arch,
            stage.norms,
            self.model_type,
            layers=stage.layers,
            embedding=stage.first,
            head=stage.last,
        )
        error: Exception | None = None
        if writer:
            try:
                shards = write_shard_files(
                    tensors, out, DTYPES[self.dtype], self.max_shard_bytes, stem=f"stage{part:03d}"
                )
                (out / f"stage{part:03d}.json").write_text(json.dumps(dataclasses.asdict(shards)))
            except Exception as e:  # noqa: BLE001 — e.g. a full disk; see the drain below
                error = e
        for _ in tensors:  # non-writers: the gathers; a failed writer: the gathers still due
            pass
        return error

    # ------------------------------------------------------------------------------ rank 0 only
    def _finish(self, step: int, checkpoint: Path | None, tmps: list[Path]) -> None:
        stages = ps.get_pipeline_model_parallel_world_size()
        record = {"step": int(step), "checkpoint": str(checkpoint) if checkpoint else None}
        if self.lora is None:
            self._finish_model(tmps[0], stages, {**record, "format": "full"})
        else:
            self._finish_adapter(tmps[0], stages, {**record, "format": "peft_lora"})
            if self.merged:
                self._finish_model(tmps[1], stages, {**record, "format": "lora_merged"})
        for final, tmp in zip(self._dirs(), tmps, strict=True):
            _replace(tmp, final)

    def _finish_model(self, out: Path, stages: int, record: dict[str, Any]) -> None:
        parts = []
        for p in range(stages):
            index = out / f"stage{p:03d}.json"
            parts.append(ShardSet(**json.loads(index.read_text())))
            index.unlink()
        finish_shards(out, parts)
        (out / "config.json").write_text(json.dumps(self.config, indent=2) + "\n")
        self._tokenizer_files(out)
        if not (out / GENERATION_CONFIG).is_file():
            self._generation_config(out)
        if self.notes:
            record = {**record, "notes": self.notes}
        (out / RECORD).write_text(json.dumps(record, indent=2) + "\n")

    def _finish_adapter(self, out: Path, stages: int, record: dict[str, Any]) -> None:
        from safetensors.torch import load_file, save_file

        from megatron_kto.peft.hf_peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, peft_config

        tensors: dict[str, torch.Tensor] = {}
        for p in range(stages):  # adapters are small: one file, as peft reads it
            tensors.update(load_file(str(out / _adapter_part(p))))
            (out / _adapter_part(p)).unlink()
        save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        config = peft_config(self.lora, self.arch, self.restore_from_path)
        (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        self._tokenizer_files(out)
        (out / RECORD).write_text(json.dumps(record, indent=2) + "\n")

    def _tokenizer_files(self, out: Path) -> None:
        """The run's tokenizer (its directory's Hugging Face files, or its file under the
        name `transformers` looks for) and, when the run overrides it, its chat template."""
        from megatron_kto.data.tokenizers import resolve_chat_template

        path = self.tokenizer_model
        if path is None:
            return
        copied = copy_tokenizer(path if path.is_dir() else path.parent, out)
        if path.is_file() and path.name not in copied:
            shutil.copy2(
                path, out / ("tokenizer.model" if path.suffix == ".model" else "tokenizer.json")
            )
        template = resolve_chat_template(self.chat_template)
        if template is None:
            return
        # transformers reads chat_template.jinja; a template inside tokenizer_config.json would
        # compete with it, so the override replaces it there.
        (out / CHAT_TEMPLATE).write_text(template, encoding="utf-8")
        config_file = out / "tokenizer_config.json"
        if config_file.is_file():
            config = json.loads(config_file.read_text(encoding="utf-8"))
            if config.pop("chat_template", None) is not None:
                config_file.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")

    def _generation_config(self, out: Path) -> None:
        """The source model's generation_config.json, else one naming the BOS/EOS ids."""
        if self.source is not None and (self.source / GENERATION_CONFIG).is_file():
            shutil.copy2(self.source / GENERATION_CONFIG, out / GENERATION_CONFIG)
            return
        ids = {k: self.config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        if ids["eos_token_id"] is None and self.tokenizer_model is not None:
            from megatron_kto.data.tokenizers import load_tokenizer

            library = "sentencepiece" if self.tokenizer_model.suffix == ".model" else "huggingface"
            tokenizer = load_tokenizer(library, str(self.tokenizer_model))
            ids.update(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
        generation = {"_from_model_config": True, **{k: v for k, v in ids.items() if v is not None}}
        (out / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")


def hf_output_of_run(cfg: Any, arch: GPTArchitecture, run_dir: Path) -> HFOutput:
    """The writer of a run's Hugging Face output, from its prepared config (`exp_manager.*`).

    Raises:
        ConfigError: naming exp_manager.save_hf when the model cannot be exported.
    """
    from megatron_kto.config.errors import ConfigError
    from megatron_kto.conversion.hf_config import ConversionError
    from megatron_kto.data.pipeline import resolve_path
    from megatron_kto.peft.settings import lora_settings, uses_lora

    e, m = cfg.exp_manager, cfg.model
    try:
        return HFOutput(
            arch,
            run_dir,
            restore_from_path=cfg.pretrained_checkpoint.restore_from_path,
            tokenizer_model=str(resolve_path(m.tokenizer.model)) if m.tokenizer.model else None,
            chat_template=m.tokenizer.chat_template,
            lora=lora_settings(m) if uses_lora(m) else None,
            merged=e.save_hf_merged,
            max_shard_bytes=int(e.save_hf_max_shard_mb * 2**20),
        )
    except ConversionError as err:
        raise ConfigError(f"exp_manager.save_hf: {err}") from err


def _adapter_part(stage: int) -> str:
    return f"adapter-stage{stage:03d}.tmp"


def _merged_getter(stage: StageTensors, chunks: list[torch.nn.Module]):
    """`stage.get` with every adapted linear's weight merged (`peft.merge.merge_lora`: W +
    (alpha/r)·B·A) on the gathered (full) weight and adapters — the merge of
    `hf_peft.merge_and_strip` at TP=1. Gathers the adapters over TP (collective)."""
    from megatron_kto.peft.hf_peft import full_pair
    from megatron_kto.peft.merge import merge_lora
    from megatron_kto.peft.wiring import adapters_of

    adapters = {f"{a.key}.weight": a for a in adapters_of(chunks)}

    def get(name: str) -> torch.Tensor:
        base = stage.get(name)
        adapter = adapters.get(name)
        if adapter is None:
            return base
        # Gathered in the adapter's own order (every TP rank asks for the same pairs in turn).
        full = {n: full_pair(adapter, n) for n in adapter.names}
        pairs = [full.get(n) for n in adapter.all_names]
        return merge_lora(base, pairs, adapter.scaling, adapter.layout)

    return get


def _recover(final: Path) -> None:
    """Put back `<final>.old` left by an export interrupted between its two renames."""
    old = final.with_name(final.name + ".old")
    if old.exists():
        if final.exists():
            shutil.rmtree(old)
        else:
            old.rename(final)


def _replace(tmp: Path, final: Path) -> None:
    old = final.with_name(final.name + ".old")
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
