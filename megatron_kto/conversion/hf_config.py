"""Hugging Face `config.json` <-> `GPTArchitecture`, for every registered family.

`architecture_from_hf` and `hf_config_from_architecture` dispatch on `model_type` through the
registry (`conversion/registry.py`); the fields the families share are in `conversion/families/`
(`dense_architecture` / `dense_hf_config`), each family's own in its module.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.conversion.errors import ConversionError
from megatron_kto.conversion.families import dense_hf_config, hf_window_config, hf_windows
from megatron_kto.conversion.registry import expressing_types, family_of_config, get_family


def architecture_from_hf(config: dict[str, Any], where: str = "config.json") -> GPTArchitecture:
    """The megatron architecture of a Hugging Face config of any registered family.

    Raises:
        ConversionError: unsupported model type or option, naming `where` and the field.
    """
    family = family_of_config(config, where)
    arch = family.architecture_from_hf(config, where)
    return dataclasses.replace(arch, **hf_windows(config, where, family.windows))


def hf_config_from_architecture(
    arch: GPTArchitecture,
    model_type: str,
    base: dict[str, Any] | None = None,
    dtype: str = "float32",
) -> dict[str, Any]:
    """A config.json for `arch` as `model_type`, keeping the non-shape fields of `base` (token
    ids, windows...).

    Raises:
        ConversionError: `model_type` unsupported or `arch` not expressible in it.
    """
    family = get_family(model_type, what="model type")
    reason = family.refuses(arch)
    if reason:
        options = " or ".join(expressing_types(arch)) or "no supported type"
        raise ConversionError(f"{reason}: it exports as {options}, not {model_type}")
    config = dense_hf_config(arch, model_type, family.hf_architecture, base, dtype)
    return hf_window_config(arch, family.hf_config(arch, config), family.windows)


__all__ = ["ConversionError", "architecture_from_hf", "hf_config_from_architecture"]
