"""A Hugging Face model directory as the Hub publishes it: recognise it, check it, read its shape.

File-system and JSON reads only (the family registry is imported when a config is read), so the
entry points can check a directory given as `pretrained_checkpoint.restore_from_path` before any
process group exists. The same reading serves the converter (`convert.import_hf`) and the direct
load (`checkpointing/hf_source.py`), so both see one architecture for one directory — including
the vocabulary padding the converter writes.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.conversion.families import MTP_KEYS
from megatron_kto.conversion.fp8 import fp8_block
from megatron_kto.conversion.hf_config import ConversionError, architecture_from_hf

logger = logging.getLogger(__name__)

CONFIG = "config.json"
#: The weight files read (as `safetensors_io` names them): one file, or shards and their index.
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
#: Padded vocabulary rows: a multiple of 128 x 8, so the model loads under TP = 1, 2, 4, 8.
VOCAB_MULTIPLE = 128 * 8
#: Files of a megatron checkpoint: a directory holding one is never taken for a Hugging Face one.
_MEGATRON_FILES = ("metadata.json", "architecture.json")


def read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object file; ConversionError naming `path` (and `what` it is for) otherwise."""
    if not path.is_file():
        raise ConversionError(f"{path}: not found ({what})")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ConversionError(f"{path}: expected a JSON object")
    return data


def looks_like_hf_dir(path: str | Path) -> bool:
    """Whether `path` is meant as a Hugging Face model directory: a config.json or
    `model*.safetensors` weights, and no megatron checkpoint files."""
    path = Path(path)
    if not path.is_dir() or any((path / name).exists() for name in _MEGATRON_FILES):
        return False
    return (
        (path / CONFIG).is_file()
        or (path / INDEX).is_file()
        or any(path.glob("model*.safetensors"))
    )


def check_hf_dir(path: str | Path) -> None:
    """A Hugging Face directory must hold config.json and safetensors weights.

    Raises:
        ConversionError: one line naming the directory and what is missing.
    """
    path = Path(path)
    if not (path / CONFIG).is_file():
        raise ConversionError(
            f"{path}: {CONFIG} not found — a Hugging Face model directory needs config.json "
            "next to its safetensors weights"
        )
    if not (path / SINGLE).is_file() and not (path / INDEX).is_file():
        raise ConversionError(f"{path}: no {SINGLE} or {INDEX} (only safetensors weights are read)")


def padded_vocab(vocab_size: int) -> int:
    """Embedding rows of a model made from a Hugging Face one."""
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def model_architecture(config: dict[str, Any], where: str) -> GPTArchitecture:
    """The megatron architecture a run builds from a Hugging Face config.json: its shape, and
    the vocabulary padding the converter and the direct load give its embedding (`padded_vocab`,
    whatever the TP size).

    Raises:
        ConversionError: an unsupported model type or option, naming `where`.
    """
    arch = architecture_from_hf(config, where)
    arch.padded_vocab_size = padded_vocab(arch.vocab_size)
    return arch


#: Vision-language model types whose language model is read — their `text_config`, under the
#: text model's type; the vision tower is ignored (`safetensors_io.HFWeights` hides its tensors
#: and gives the language model's tensors the text model's names). Output is the text model.
VL_WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def language_config(
    config: dict[str, Any], where: str, warn: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """`config` itself, or for a vision-language wrapper (`VL_WRAPPERS`) its language model's.

    Raises:
        ConversionError: a wrapper without a `text_config` object, naming `where`.
    """
    kind = config.get("model_type")
    if kind not in VL_WRAPPERS:
        return config
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ConversionError(f"{where}: text_config: missing (a {kind} model's language model)")
    (warn or logger.warning)(
        f"{where}: {kind}: its language model is read as {VL_WRAPPERS[kind]}; the vision tower "
        "is ignored"
    )
    out = {"tie_word_embeddings": config.get("tie_word_embeddings", False), **text}
    if "quantization_config" in config:  # the wrapper's quantization covers its language model
        out.setdefault("quantization_config", config["quantization_config"])
    out["model_type"] = VL_WRAPPERS[kind]
    return out


def read_hf_architecture(
    hf_dir: str | Path, warn: Callable[[str], None] | None = None
) -> tuple[dict[str, Any], GPTArchitecture]:
    """(config.json, the megatron architecture with its padded vocabulary) of a directory.

    Args:
        hf_dir: the Hugging Face model directory.

    Raises:
        ConversionError: no or unreadable config.json, an unsupported model type (naming the
            supported ones) or option, in one line naming the file.
    """
    hf_dir = Path(hf_dir)
    where = hf_dir / CONFIG
    config = read_json(where, "a Hugging Face model directory needs config.json")
    config = language_config(config, str(where), warn)
    arch = model_architecture(config, str(where))
    block = fp8_block(config, str(where))  # an unread quantization fails here, before any weight
    if block is not None:
        (warn or logger.warning)(
            f"{hf_dir}: fp8 weights ({block[0]}x{block[1]} block scales) are dequantised on "
            "load into the run's dtype; hf/ output is written unquantised, without "
            "quantization_config"
        )
    mtp = mtp_layers(config)
    if mtp:
        (warn or logger.warning)(
            f"{hf_dir}: num_nextn_predict_layers={mtp}: multi-token-prediction layers "
            f"(model.layers.{arch.num_layers} on, where the weights have them) are skipped: "
            "not loaded, trained or written to hf/ (whose config.json says 0 of them)"
        )
    return config, arch


def hf_weights(hf_dir: str | Path, config: dict[str, Any]):
    """The weights of a Hugging Face directory (`safetensors_io.HFWeights`) as its family names
    them, fp8 block-scaled weights read dequantised where its `quantization_config` says so.

    Raises:
        ConversionError: unreadable weights, or a quantization that is not read (`fp8.fp8_block`).
    """
    from megatron_kto.conversion.registry import get_family
    from megatron_kto.conversion.safetensors_io import HFWeights

    block = fp8_block(config, str(Path(hf_dir) / CONFIG))
    return HFWeights(hf_dir, get_family(config["model_type"]).weight_prefixes, block)


def mtp_layers(config: dict[str, Any]) -> int:
    """Multi-token-prediction layers a checkpoint may hold after its decoder layers (GLM-4.5,
    DeepSeek-V3: `num_nextn_predict_layers`, stored as `model.layers.{num_hidden_layers + i}`)."""
    value = next((config[k] for k in MTP_KEYS if k in config), None) or 0
    return value if isinstance(value, int) and value > 0 else 0


def skipped_hf_tensors(config: dict[str, Any], names: set[str] | list[str]) -> set[str]:
    """The tensors of `names` that loading skips: those of the multi-token-prediction layers
    (`mtp_layers`; any layer index >= `num_hidden_layers`)."""
    if not mtp_layers(config):
        return set()
    layers = config["num_hidden_layers"]
    pattern = re.compile(r"model\.layers\.(\d+)\.")
    return {n for n in names if (m := pattern.match(n)) and int(m.group(1)) >= layers}
