"""The model families conversion supports, keyed by Hugging Face `model_type`.

A family (`families.Family`) is data plus three pure functions: how its config.json becomes a
`GPTArchitecture`, how an architecture becomes its config.json fields, and its per-layer `Mapping`
table (which drives both directions of the tensor conversion). Adding a family means one new module under
`conversion/families/` and its name in `_MODULES` — no branches elsewhere.
"""

from __future__ import annotations

from typing import Any

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.conversion.errors import ConversionError
from megatron_kto.conversion.families import (
    Family,
    deepseek_v3,
    gemma3,
    glm4_moe,
    gpt_oss,
    llama,
    mixtral,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_5,
    qwen3_moe,
    qwen3_next,
)

#: Family modules, each defining `FAMILIES: tuple[Family, ...]`, in registration order.
_MODULES = (
    llama,
    qwen2,
    qwen3,
    qwen3_moe,
    mixtral,
    qwen2_moe,
    gemma3,
    qwen3_next,
    qwen3_5,
    gpt_oss,
    glm4_moe,
    deepseek_v3,
)
_FAMILIES: dict[str, Family] = {
    family.model_type: family for module in _MODULES for family in module.FAMILIES
}


def families() -> dict[str, Family]:
    """Every registered family by model type."""
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
    return [t for t, family in families().items() if family.refuses(arch) is None]


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


__all__ = [
    "Family",
    "default_model_type",
    "expressing_types",
    "families",
    "family_of_config",
    "get_family",
    "supported",
]
