"""Whole-model conversion: a Hugging Face directory -> a megatron_kto checkpoint, and back.

Both directions build the TP=1, PP=1 model in this one process (CPU or GPU, from the runtime),
stream tensors through the family's table (`mappings`) one at a time, and write the result to
`<out>.tmp` before renaming it, so an interrupted conversion never leaves a directory that looks
complete. The imported checkpoint is an ordinary model checkpoint (`checkpointing.model_io`): it
restores under any TP/PP/DP/EP layout through `pretrained_checkpoint.restore_from_path`.

Memory: the model (fp32, or bf16 for a bf16 import/export) plus one source tensor (import) or
one output shard (export); Hugging Face files are read one tensor at a time through `safe_open`.
While an import saves, megatron-core's torch_dist writer also clones every tensor that its
sharded state dict views (the SwiGLU fc1 gate/up halves): measured on a 237M-parameter Llama
(fp32 model 0.95 GB), peak RSS 2.1 GB of which 0.4 GB is the process baseline.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from megatron_kto.checkpointing.errors import CheckpointError
from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.conversion.addressing import (
    IGNORED_HF_PREFIXES,
    IGNORED_HF_SUFFIXES,
    OUTPUT,
    norm_names,
)
from megatron_kto.conversion.hf_config import ConversionError, hf_config_from_architecture
from megatron_kto.conversion.hf_dir import (
    CONFIG,
    hf_weights,
    looks_like_hf_dir,
    mtp_layers,
    read_hf_architecture,
    skipped_hf_tensors,
)
from megatron_kto.conversion.hf_dir import read_json as _read_json
from megatron_kto.conversion.mappings import to_hf, to_megatron
from megatron_kto.conversion.registry import default_model_type, get_family
from megatron_kto.conversion.safetensors_io import write_sharded
from megatron_kto.runtime.precision import EXPORT_DTYPES

logger = logging.getLogger(__name__)

#: Written next to imported weights: the source config.json, reused as the base on export.
HF_CONFIG = "hf_config.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.jinja",
)
DTYPES = EXPORT_DTYPES  # the name callers and tests know


def _prepare_out(out_dir: Path) -> Path:
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ConversionError(f"{out_dir}: exists and is not empty; choose a new output directory")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _finish(tmp: Path, out_dir: Path) -> None:
    if out_dir.exists():
        out_dir.rmdir()  # empty, checked by _prepare_out
    tmp.rename(out_dir)


@contextlib.contextmanager
def staged_output(out_dir: Path) -> Iterator[Path]:
    """A directory to write `out_dir` into (`<out_dir>.tmp`): renamed to `out_dir` when the
    block ends cleanly, removed when it raises; the single-process runtime the block may have
    started is torn down either way.

    Raises:
        ConversionError: `out_dir` exists and is not empty (before the block runs).
    """
    tmp = _prepare_out(out_dir)
    try:
        yield tmp
        _finish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        from megatron_kto.runtime.distributed import teardown  # megatron-core only if run

        teardown()


def copy_tokenizer(src: Path | None, dst: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES if src is not None else ():
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


def _single_process_model(arch: GPTArchitecture, dtype: str = "float32") -> torch.nn.Module:
    """The whole model (TP=1, PP=1) in this process, unwrapped; parameters in `dtype`."""
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks, unwrap
    from megatron_kto.runtime import init_runtime

    runtime = init_runtime(1, 1, seed=0)
    layout = ParallelLayout(precision="bf16" if dtype == "bfloat16" else "32")
    (chunk,) = build_gpt_chunks(arch, layout, runtime.device)
    return unwrap(chunk)


def import_hf(hf_dir: str | Path, out_dir: str | Path, dtype: str = "float32") -> GPTArchitecture:
    """Convert a Hugging Face directory of a registered family (`conversion.registry`) into a
    megatron_kto checkpoint.

    Args:
        hf_dir: directory with config.json and safetensors weights (single file or index).
        out_dir: new checkpoint directory (absent or empty).
        dtype: stored weights, "float32" (default; exact for fp32/bf16/fp16 sources) or
            "bfloat16" (half the host memory and disk). Either restores into an fp32 or a bf16
            model: dist_checkpointing casts on load.

    Returns:
        The architecture written with the weights.

    Raises:
        ConversionError: unsupported or damaged input, in one line naming the file.
    """
    if dtype not in ("float32", "bfloat16"):
        raise ConversionError(f"import dtype {dtype!r} is not one of ['bfloat16', 'float32']")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Every rank would build the whole model and race on the output directory.
        raise ConversionError("the converter runs as one process: start it without torchrun")
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    config, arch = read_hf_architecture(hf_dir)  # the vocabulary padded as hf_dir pads it
    weights = hf_weights(hf_dir, config)
    # Input is validated above; megatron-core is imported only now, so bad input fails fast.
    from megatron_kto.checkpointing.model_io import save_model
    from megatron_kto.models.builder import named_weights

    with staged_output(out_dir) as tmp:
        model = _single_process_model(arch, dtype)
        params = named_weights(model)
        used: set[str] = set()

        def get(name: str) -> torch.Tensor:
            if name not in weights:
                raise ConversionError(f"{hf_dir}: tensor {name} is missing from the weights")
            used.update(weights.stored(name))
            return weights.get(name)

        filled = set()
        with torch.no_grad():
            for name, tensor in to_megatron(
                get, arch, arch.padded_vocab_size, norm_names(params), config["model_type"]
            ):
                param = params[name]
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ConversionError(
                        f"{hf_dir}: {name}: converted shape {tuple(tensor.shape)} does not match "
                        f"the model's {tuple(param.shape)} (config.json and weights disagree)"
                    )
                param.copy_(tensor)
                filled.add(name)
        missing = sorted(set(params) - filled)
        if missing:
            raise ConversionError(f"{hf_dir}: no source for megatron parameters {missing[:4]}")
        unused = sorted(
            n
            for n in weights.names() - used - skipped_hf_tensors(config, weights.names())
            if not n.endswith(IGNORED_HF_SUFFIXES)
            and not n.startswith(IGNORED_HF_PREFIXES)
            and not (n == OUTPUT.hf[0] and arch.share_embeddings_and_output_weights)
        )
        if unused:
            raise ConversionError(f"{hf_dir}: tensors this converter does not map: {unused[:4]}")
        save_model(tmp, [model], arch)
        (tmp / HF_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        copy_tokenizer(hf_dir, tmp)
    return arch


def source_config(source: Path) -> Path:
    """The source config.json of `source_dir`'s answer: an imported checkpoint's copy, or a
    Hugging Face directory's own."""
    return source / HF_CONFIG if (source / HF_CONFIG).is_file() else source / CONFIG


def source_dir(ckpt_dir: Path) -> Path | None:
    """The imported checkpoint or Hugging Face directory a model descends from (it holds the
    source config and the tokenizer): the checkpoint itself, or the `restore_from_path` of the
    training run that wrote it."""
    from omegaconf import OmegaConf

    from megatron_kto.checkpointing.pretrained import resolve_pretrained_dir

    if (ckpt_dir / HF_CONFIG).is_file():
        return ckpt_dir
    if (ckpt_dir / "config.yaml").is_file():
        restore = OmegaConf.load(ckpt_dir / "config.yaml").get("pretrained_checkpoint", {})
        path = restore.get("restore_from_path") if restore else None
        if path:
            try:
                source = resolve_pretrained_dir(path)
            except CheckpointError:
                return None
            return source if (source / HF_CONFIG).is_file() or looks_like_hf_dir(source) else None
    return None


def export_config(
    arch: GPTArchitecture,
    base: dict[str, Any] | None,
    model_type: str | None = None,
    dtype: str | None = None,
) -> tuple[dict[str, Any], str, str]:
    """(config.json, model type, dtype) of an export of `arch`.

    Args:
        base: the source model's config.json (None: the model has no recorded source).
        model_type, dtype: as `export_hf` takes them; None picks the source's, else the first
            family that expresses the architecture and float32.

    Raises:
        ConversionError: an unsupported model type or dtype, or an inexpressible architecture.
    """
    model_type = model_type or (base or {}).get("model_type") or default_model_type(arch)
    get_family(model_type, what="--model-type")
    dtype = dtype or str((base or {}).get("torch_dtype") or (base or {}).get("dtype") or "float32")
    if dtype not in DTYPES:
        raise ConversionError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    return hf_config_from_architecture(arch, model_type, base, dtype), model_type, dtype


def export_notes(base: dict[str, Any] | None, dtype: str) -> list[str]:
    """What an export of a model from the source config.json `base` writes differently from the
    source: the dequantised weights of a quantised source (the config without its
    `quantization_config`), and multi-token-prediction layers that were never read.

    Args:
        dtype: the export's dtype (`export_config`).
    """
    base = base or {}
    notes = []
    method = (base.get("quantization_config") or {}).get("quant_method")
    if method in ("fp8", "mxfp4"):
        what = "fp8 block-scaled weights" if method == "fp8" else "MXFP4 experts"
        notes.append(
            f"the source's {what} were dequantised on load and are written as {dtype}, "
            "without quantization_config"
        )
    layers = mtp_layers(base)
    if layers:
        notes.append(
            f"the source's {layers} multi-token-prediction layer(s) were not read and are not "
            "written; config.json counts 0 of them"
        )
    return notes


def export_hf(
    ckpt: str | Path,
    out_dir: str | Path,
    model_type: str | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 1024**3,
    load: Callable[[Path, list[torch.nn.Module], GPTArchitecture], None] | None = None,
    half_model: bool = True,
) -> Path:
    """Write a megatron_kto checkpoint (imported or trained; a run directory means its latest
    checkpoint) as a Hugging Face model directory that `transformers` loads.

    Args:
        ckpt: checkpoint directory, a run or checkpoints directory, or its `latest` marker.
        out_dir: new output directory.
        model_type: a registered Hugging Face model type (default: the source model's; else the
            first family that expresses the architecture: llama, qwen2 for qkv biases, ...).
        dtype: float32, bfloat16 or float16 (default: the source model's, else float32).
        max_shard_bytes: largest safetensors shard.
        load: fills the built TP=1 model from the checkpoint (default: `load_model`); LoRA
            exports pass one that rebuilds base + adapters and merges them
            (`hf_writer.lora_export.merged_loader`).
        half_model: a bfloat16 export builds the model in bfloat16 (half the host memory);
            False builds it in float32 whatever the output dtype (a LoRA merge of a float32
            run: its base fingerprint is of the float32 weights).

    Returns:
        The checkpoint directory that was exported.
    """
    from megatron_kto.checkpointing import files
    from megatron_kto.checkpointing.model_io import load_model, read_architecture
    from megatron_kto.checkpointing.pretrained import resolve_pretrained_dir

    ckpt = Path(ckpt)
    if ckpt.is_file() and ckpt.name == files.LATEST:  # the marker names the checkpoint to take
        ckpt = ckpt.parent
    ckpt_dir = resolve_pretrained_dir(ckpt)
    arch = read_architecture(ckpt_dir)
    source = source_dir(ckpt_dir)
    base = _read_json(source_config(source), "source config") if source else None
    config, model_type, dtype = export_config(arch, base, model_type, dtype)
    out_dir = Path(out_dir)
    with staged_output(out_dir) as tmp:
        # A bf16 export loads straight into a bf16 model (half the host memory); the cast on
        # load rounds exactly as `Tensor.to(torch.bfloat16)` would.
        half = half_model and dtype == "bfloat16"
        model = _single_process_model(arch, "bfloat16" if half else "float32")
        if load is None:
            load_model(ckpt_dir, [model])
        else:
            load(ckpt_dir, [model], arch)
        state = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
        if arch.share_embeddings_and_output_weights:
            state.pop(OUTPUT.megatron, None)
        write_sharded(
            to_hf(state.__getitem__, arch, norm_names(state), model_type),
            tmp,
            DTYPES[dtype],
            max_shard_bytes,
        )
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for note in export_notes(base, dtype):
            logger.warning("%s: %s", out_dir, note)
        copy_tokenizer(ckpt_dir if (ckpt_dir / "tokenizer_config.json").exists() else source, tmp)
    return ckpt_dir
