"""The model families conversion supports, keyed by Hugging Face `model_type`.

A family is data plus three pure functions: how its config.json becomes a `GPTArchitecture`, how
an architecture becomes its config.json fields, and its per-layer `Mapping` table (which drives
both directions of the tensor conversion). Adding a family means one new module under
`conversion/families/` and one line in `_MODULES` — no branches elsewhere.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_kto.conversion.hf_config import ConversionError
from megatron_kto.conversion.mappings import Mapping
from megatron_kto.models.architecture import GPTArchitecture

#: Family modules, each defining `FAMILIES: tuple[Family, ...]`.
_MODULES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe")


@dataclass(frozen=True)
class Family:
    """How one Hugging Face model type converts."""

    model_type: str
    """config.json `model_type`."""
    hf_architecture: str
    """config.json `architectures[0]` written on export."""
    architecture_from_hf: Callable[[dict[str, Any], str], GPTArchitecture]
    """config.json (and where it was read, for errors) -> architecture; raises ConversionError."""
    hf_config: Callable[[GPTArchitecture, dict[str, Any]], dict[str, Any]]
    """Adds the family's own fields to the shared config.json fields of an architecture."""
    layer_mappings: Callable[[GPTArchitecture, dict[str, str]], tuple[Mapping, ...]]
    """The per-layer tensor table of an architecture, given the built model's norm names."""
    cannot_express: Callable[[GPTArchitecture], str | None]
    """Why an architecture does not export as this type (one phrase), or None when it does."""


def _load() -> dict[str, Family]:
    families: dict[str, Family] = {}
    for name in _MODULES:
        module = importlib.import_module(f"megatron_kto.conversion.families.{name}")
        for family in module.FAMILIES:
            families[family.model_type] = family
    return families


_FAMILIES: dict[str, Family] | None = None


def families() -> dict[str, Family]:
    """Every registered family by model type (loaded on first use)."""
    global _FAMILIES
    if _FAMILIES is None:
        _FAMILIES = _load()
    return _FAMILIES


def supported() -> tuple[str, ...]:
    """The supported model types, in registration order."""
    return tuple(families())


def get_family(model_type: str | None, what: str = "model_type") -> Family:
    """The family of `model_type`.

    Raises:
        ConversionError: unknown type, in one line naming the supported ones.
    """
    found = families().get(model_type or "")
    if found is None:
        raise ConversionError(f"{what} {model_type!r} is not supported ({', '.join(supported())})")
    return found


def family_of_config(config: dict[str, Any], where: str) -> Family:
    """The family of a config.json; ConversionError naming `where` when unsupported."""
    try:
        return get_family(config.get("model_type"))
    except ConversionError as e:
        raise ConversionError(f"{where}: {e}") from None


def expressing_types(arch: GPTArchitecture) -> list[str]:
    """The model types an architecture exports as, in registration order."""
    return [t for t, family in families().items() if family.cannot_express(arch) is None]


def default_model_type(arch: GPTArchitecture) -> str:
    """The export type of an architecture with no recorded source: the first family (in
    registration order) that expresses it."""
    types = expressing_types(arch)
    if not types:
        raise ConversionError(
            f"no supported Hugging Face model type expresses this architecture "
            f"({', '.join(supported())})"
        )
    return types[0]
