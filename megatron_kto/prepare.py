"""Resolve a composed config into the run it describes — before anything heavy is imported.

`prepare_run_config` is what every entry point runs first (the trainers, `tools/bench_kto.py`,
and `run.run_alignment` again, idempotently). It reads JSON and tokenizer files only — no
process group, no megatron-core — so a bad config stops within a couple of seconds of launch:

1. `trainer.precision`: NeMo/Lightning spellings -> '32' / 'bf16' / '16'; unset follows the
   device (bf16 on CUDA, 32 on a CPU), with a note saying which.
2. The architecture. With `pretrained_checkpoint.restore_from_path` it is the checkpoint's
   (architecture.json, or a Hugging Face directory's config.json): a value the config states (a preset, an override) that differs is an
   error naming both; without a checkpoint the config must state the shape (a preset).
3. The tokenizer: `model.tokenizer.model` unset means the tokenizer stored with the checkpoint
   (a Hugging Face directory's or a converted model's tokenizer files, or a training run's
   config); the library is inferred.
4. The vocabulary: the tokenizer's ids must fit the model's embedding.
5. `model.optim.sched.min_lr` unset means lr / 10 (so `model.optim.lr=5e-6` alone is valid).
   Unset LoRA settings (`model.peft.lora_tuning.*`) are the starting adapter's, read from its
   adapter_config.json, else the built-in defaults; stated values that contradict the adapter
   are refused.
6. `validate.validate` with the resolved shape and `peft.settings.check_peft`, then the
   attention backend the run will use (`runtime.attention_backend`), with a note saying which
   and why.

The resolved values are written back into the config (what is saved with checkpoints).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_kto.checkpointing import files
from megatron_kto.checkpointing.errors import CheckpointError
from megatron_kto.checkpointing.locate import (
    architecture_file,
    read_architecture,
    resolve_pretrained_dir,
)
from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.config.keys import check_known_keys
from megatron_kto.config.machine import attention_choice, canonical_precision, device_precision
from megatron_kto.config.validate import ConfigError, validate
from megatron_kto.peft.adapter_config import read_adapter_config
from megatron_kto.peft.settings import (
    check_peft,
    reference_strategy,
    resolve_lora_tuning,
    unused_reference_note,
    uses_lora,
)

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"

#: What a config must state to build a model without a checkpoint (the rest has safe defaults).
REQUIRED_WITHOUT_CHECKPOINT = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "encoder_seq_length",
)
#: Training choices a config may set on top of a checkpoint's shape.
RUN_CHOICES = ("hidden_dropout", "attention_dropout", "moe_aux_loss_coeff")
#: Initialisation only: loaded weights make it moot, so it is neither compared nor used.
INIT_ONLY = ("init_method_std",)
#: min_lr when unset is lr / this (NeMo-Aligner's gpt_kto.yaml: 9e-7 for lr 9e-6). A division,
#: not a product with 0.1, so that lr 1e-3 gives exactly 1e-4.
DEFAULT_MIN_LR_DIVISOR = 10


@dataclass(frozen=True)
class ConfigSources:
    """Where a composed config's values came from, for messages that name the culprit.

    Attributes:
        overrides: the command-line overrides, as typed.
        preset: the `model=` choice (conf/model/), if any.
        example: the `example=` choice (conf/example/), if any.
        example_chose_preset: the preset came from the example, not from the user.
    """

    overrides: tuple[str, ...] = ()
    preset: str | None = None
    example: str | None = None
    example_chose_preset: bool = False

    def _override_keys(self) -> set[str]:
        keys = set()
        for text in self.overrides:
            key = text.split("=", 1)[0].lstrip("~+")
            keys.add(key)
        return keys

    def describe(self, key: str) -> str:
        """' (command line)', ' from model=<preset>', ... — how `key` got its value."""
        if key in self._override_keys():
            return " (command line)"
        if key.startswith("model.") and self.preset:
            if self.example_chose_preset:
                return f" from example={self.example} (model={self.preset})"
            return f" from model={self.preset}"
        if self.example:
            return f" from example={self.example}"
        return " from the config"


@dataclass
class PreparedRun:
    """A resolved config and what the user should be told about it once.

    Attributes:
        cfg: the config, with architecture, tokenizer, precision and min_lr resolved.
        architecture: the model shape (vocab_size set).
        architecture_file: the architecture.json it came from, or None (the config's own).
        checkpoint_dir: the resolved `restore_from_path` directory, or None.
        notes: lines for rank 0 to print at start-up.
    """

    cfg: Any
    architecture: GPTArchitecture
    architecture_file: str | None = None
    checkpoint_dir: Path | None = None
    notes: list[str] = field(default_factory=list)


def _presets() -> list[str]:
    directory = CONF_DIR / "model"
    return sorted(p.stem for p in directory.glob("*.yaml")) if directory.is_dir() else []


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    return a == b


def resolve_architecture(
    cfg: Any, sources: ConfigSources
) -> tuple[GPTArchitecture, str | None, Path | None]:
    """The model shape: the checkpoint's if `restore_from_path` is set, else the config's.

    Returns:
        (architecture, the architecture.json it was read from or None, the checkpoint dir).

    Raises:
        ConfigError: a stated value contradicts the checkpoint, or no shape is stated.
        CheckpointError: `restore_from_path` holds no usable checkpoint.
    """
    m = cfg.model
    stated = {
        name: getattr(m, name)
        for name in GPTArchitecture.field_names()
        if getattr(m, name, None) is not None
    }
    path = cfg.pretrained_checkpoint.restore_from_path
    if not path:
        missing = [name for name in REQUIRED_WITHOUT_CHECKPOINT if name not in stated]
        if missing:
            presets = ", ".join(_presets()) or "see conf/model/"
            raise ConfigError(
                f"model.{missing[0]}: no model architecture: set "
                "pretrained_checkpoint.restore_from_path (a Hugging Face model directory or a "
                "converted checkpoint; its architecture is "
                f"used) or choose a preset for a model trained from scratch: model=<{presets}>"
            )
        values = {k: v for k, v in stated.items()}
        return GPTArchitecture(**values), None, None
    ckpt_dir = resolve_pretrained_dir(path)
    arch = read_architecture(ckpt_dir)
    arch_file = str(architecture_file(ckpt_dir))  # architecture.json, or an HF config.json
    saved = arch.to_dict()
    conflicts = []
    for name, value in stated.items():
        if name in INIT_ONLY:
            continue
        if name in RUN_CHOICES:
            setattr(arch, name, value)
            continue
        if name == "make_vocab_size_divisible_by" and arch.padded_vocab_size is not None:
            continue  # the checkpoint fixes its embedding rows; the padding rule is moot
        if not _same(value, saved[name]):
            conflicts.append(name)
    if conflicts:
        first = conflicts[0]
        key = f"model.{first}"
        also = f" (also: {', '.join(conflicts[1:])})" if len(conflicts) > 1 else ""
        raise ConfigError(
            f"{key}: {stated[first]}{sources.describe(key)} contradicts {saved[first]} in "
            f"{arch_file}{also}; the checkpoint's architecture is the model — drop the preset "
            "or override"
        )
    return arch, arch_file, ckpt_dir


def _infer_library(model: str) -> str:
    return "sentencepiece" if str(model).endswith(".model") else "huggingface"


def resolve_tokenizer(cfg: Any, ckpt_dir: Path | None) -> tuple[str, str, str | None]:
    """(library, model path, chat template) of the run's tokenizer.

    Unset `model.tokenizer.model` means the checkpoint's tokenizer: the files the conversion
    tool copies next to the weights, or the tokenizer named by a training checkpoint's
    config.yaml.

    Raises:
        ConfigError: naming model.tokenizer.model when there is nothing to use.
    """
    t = cfg.model.tokenizer
    model, library, template = t.model, t.library, t.chat_template
    if model is None:
        if ckpt_dir is None:
            raise ConfigError(
                "model.tokenizer.model: not set (give the tokenizer, or a "
                "pretrained_checkpoint.restore_from_path that holds one)"
            )
        if (ckpt_dir / "tokenizer.json").is_file():
            model, library = str(ckpt_dir), library or "huggingface"
        elif (ckpt_dir / "tokenizer.model").is_file():
            model = str(ckpt_dir / "tokenizer.model")
        elif (ckpt_dir / files.CONFIG).is_file():
            from omegaconf import OmegaConf

            saved = OmegaConf.load(ckpt_dir / files.CONFIG)
            model = OmegaConf.select(saved, "model.tokenizer.model")
            library = library or OmegaConf.select(saved, "model.tokenizer.library")
            template = template or OmegaConf.select(saved, "model.tokenizer.chat_template")
        if model is None:
            raise ConfigError(
                f"model.tokenizer.model: not set, and {ckpt_dir} holds no tokenizer "
                "(tokenizer.json or tokenizer.model); set model.tokenizer.model"
            )
    return library or _infer_library(model), str(model), template


def _load_tokenizer_vocab(library: str, model: str, template: str | None) -> int:
    from megatron_kto.data.chat_template import ChatTemplateError
    from megatron_kto.data.pipeline import resolve_path
    from megatron_kto.data.tokenizers import load_tokenizer

    path = resolve_path(model)
    if not path.exists():
        raise ConfigError(f"model.tokenizer.model: {model} does not exist")
    try:
        return load_tokenizer(library, str(path), template).vocab_size
    except (OSError, ValueError, RuntimeError, ChatTemplateError) as e:
        detail = " ".join(str(e).split())
        raise ConfigError(
            f"model.tokenizer.model: cannot load {model} ({library}): {detail}"
        ) from e


def resolve_lora(model_cfg: Any, arch: GPTArchitecture) -> None:
    """The unset `model.peft.lora_tuning.*` keys: a LoRA run starting from an adapter
    (`model.peft.restore_from_path`) reads them from its adapter_config.json, else they take the
    built-in defaults (`peft.settings.resolve_lora_tuning`).

    Raises:
        ConfigError: no readable adapter directory, or stated values that contradict it.
    """
    from megatron_kto.data.pipeline import resolve_path

    adapter, where, path = None, "", model_cfg.peft.restore_from_path
    if uses_lora(model_cfg) and path:
        where = f"model.peft.restore_from_path={path}"
        try:
            adapter = read_adapter_config(resolve_path(path))
        except ValueError as e:
            raise ConfigError(f"model.peft.restore_from_path: {e}") from e
    resolve_lora_tuning(model_cfg, arch, adapter, where)


def _on_cuda() -> bool:
    # The machine as the attention decision sees it; does not initialise CUDA (the launch
    # environment is applied later, see runtime.gpu_settings).
    from megatron_kto.runtime.gpu_settings import Accelerator

    return Accelerator.detect().cuda


def prepare_run_config(
    cfg: Any,
    algorithm: str,
    world_size: int | None = None,
    sources: ConfigSources | None = None,
) -> PreparedRun:
    """Resolve and validate `cfg` for a run of `world_size` processes (see the module docstring).

    Args:
        cfg: the composed config (our schema); modified in place.
        algorithm: 'kto' or 'dpo'.
        world_size: launched processes; default $WORLD_SIZE or 1.
        sources: where values came from (for messages); default: unknown.

    Raises:
        ConfigError / CheckpointError: one line, naming the key or file.
    """
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    sources = sources or ConfigSources()
    check_known_keys(cfg)  # a `+key=...` typo first, before anything is read from disk
    m, t = cfg.model, cfg.trainer
    notes = []
    if t.precision is None:
        cuda = _on_cuda()
        t.precision = device_precision(cuda)
        why = "a CUDA device" if cuda else "no CUDA device; fp32 is the fast setting on a CPU"
        notes.append(f"trainer.precision unset: {t.precision} ({why})")
    else:
        t.precision = canonical_precision(t.precision)
    arch, arch_file, ckpt_dir = resolve_architecture(cfg, sources)
    library, model, template = resolve_tokenizer(cfg, ckpt_dir)
    m.tokenizer.library, m.tokenizer.model, m.tokenizer.chat_template = library, model, template
    vocab = _load_tokenizer_vocab(library, model, template)
    if arch.vocab_size is None:
        arch.vocab_size = vocab
    elif arch.vocab_size < vocab:
        where = arch_file or "model.vocab_size"
        raise ConfigError(
            f"model.tokenizer.model: {model} has {vocab} tokens, more than the model's "
            f"vocabulary of {arch.vocab_size} ({where})"
        )
    for name, value in arch.to_dict().items():
        setattr(m, name, value)
    if m.optim.sched.min_lr is None and m.optim.lr > 0:
        m.optim.sched.min_lr = m.optim.lr / DEFAULT_MIN_LR_DIVISOR
    resolve_lora(m, arch)
    validate(cfg, world_size, algorithm, architecture_file=arch_file)
    # model.peft.* and the reference policies it allows: peft's own checks (they read the
    # conversion tables for target names, which config/ sits below).
    check_peft(m, algorithm, m)
    loss = m.kto if algorithm == "kto" else m.dpo
    unused = unused_reference_note(m, algorithm)
    if unused:
        notes.append(unused)
    # Its default depends on LoRA; a reference-free loss type makes it 'none'.
    loss.reference_policy = reference_strategy(m, algorithm)

    notes.append(attention_choice(cfg).note(m.attention_backend))
    if t.precision != "32" and not _on_cuda():
        notes.append(
            f"trainer.precision={t.precision} on a CPU: half-precision matmuls run about 10x "
            "slower than fp32 there; trainer.precision=32 is the CPU setting"
        )
    return PreparedRun(cfg, arch, arch_file, ckpt_dir, notes)


__all__ = [
    "CheckpointError",
    "ConfigError",
    "ConfigSources",
    "PreparedRun",
    "prepare_run_config",
    "resolve_architecture",
    "resolve_tokenizer",
]
