"""A Hugging Face PEFT adapter's `adapter_config.json`, read as this run's `lora_tuning` keys.

File and JSON reads only (no torch, no megatron-core): the run's config is resolved from it
before any model exists. `peft`'s `LoraConfig` selects the adapted modules with

- `target_modules`: a list of names, each selecting every module whose full name equals it or
  ends with `.<name>`; or one string, a regular expression that must match a module's whole
  name (`re.fullmatch`);
- `layers_to_transform` (list targets only): 0-based layer indices, or one index; None or []
  means every layer.

Both are evaluated here against the Hugging Face names of this architecture's projections
(`model.layers.{i}.self_attn.q_proj`, ... from `targets.HF_MODULES`), as `peft` evaluates them
against the named modules of the `transformers` model, and expressed in our keys:
`target_modules` (projection names), `layer_selection` (NeMo's 1-based layer numbers, None for
every layer), `adapter_dim` (r), `alpha` (lora_alpha), `adapter_dropout` (lora_dropout).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from megatron_kto.checkpointing.adapter_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from megatron_kto.peft.targets import (
    HF_MODULES,
    linear_projections,
    resolve_targets,
    selected_layers,
)

#: `LoraConfig`'s defaults, for an adapter_config.json that omits a key.
PEFT_DEFAULTS = {"r": 8, "lora_alpha": 8, "lora_dropout": 0.0}
#: The keys an adapter fixes: a run starting from it must have the same values.
FIXED_KEYS = ("adapter_dim", "alpha", "target_modules", "layer_selection")


def read_adapter_config(path: str | Path) -> dict[str, Any]:
    """adapter_config.json of a PEFT adapter directory (whose weights file must exist too).

    Raises:
        ValueError: one line naming the file: missing, not a JSON object, or a PEFT method other
            than plain LoRA.
    """
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: not found (a PEFT adapter directory is expected)")
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (path / name).is_file():
            raise ValueError(f"{path}: not a PEFT adapter directory ({name} is missing)")
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path / ADAPTER_CONFIG}: not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path / ADAPTER_CONFIG}: expected a JSON object")
    checks = {
        "peft_type": (config.get("peft_type"), "LORA"),
        "bias": (config.get("bias", "none"), "none"),
        "use_dora": (bool(config.get("use_dora")), False),
        "use_rslora": (bool(config.get("use_rslora")), False),
        "fan_in_fan_out": (bool(config.get("fan_in_fan_out")), False),
        "modules_to_save": (config.get("modules_to_save") or None, None),
    }
    for key, (got, want) in checks.items():
        if got != want:
            raise ValueError(f"{path / ADAPTER_CONFIG}: {key}={got!r} is not supported")
    return config


def _selects(target_modules: str | list[str], name: str) -> bool:
    """peft's test of one full module name against `target_modules`."""
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, name) is not None
    return any(name == t or name.endswith(f".{t}") for t in target_modules)


def peft_selection(
    target_modules: str | list[str] | None, layers_to_transform: Any, arch: Any
) -> tuple[list[str], list[int]]:
    """(projections, 0-based layers) that a LoraConfig's targets adapt in this architecture.

    Raises:
        ValueError: starting with the quoted `target_modules`: a bad regular expression, nothing
            selected, or a selection that is not the same projections in every selected layer
            (one run's LoRA keys cannot express it).
    """
    if not target_modules:
        raise ValueError(f"{target_modules!r} names no module")
    if isinstance(target_modules, str):
        try:
            re.compile(target_modules)
        except re.error as e:
            raise ValueError(f"{target_modules!r} is not a valid regular expression ({e})") from e
        layer_ok = range(arch.num_layers)
    else:
        target_modules = [str(t) for t in target_modules]
        wanted = layers_to_transform
        if isinstance(wanted, int):
            wanted = [wanted]
        layer_ok = range(arch.num_layers) if not wanted else {int(i) for i in wanted}
    available = [p for projs in linear_projections(arch).values() for p in projs]
    chosen: dict[int, tuple[str, ...]] = {}
    for layer in range(arch.num_layers):
        if layer not in layer_ok:
            continue
        names = tuple(
            p
            for projs in linear_projections(arch, layer).values()
            for p in projs
            if _selects(target_modules, f"model.layers.{layer}.{HF_MODULES[p]}")
        )
        if names:
            chosen[layer] = names
    if not chosen:
        regex = (
            "; a string is a regular expression that must match a whole module name, as in peft "
            "(names go in a list)"
            if isinstance(target_modules, str)
            else ""
        )
        raise ValueError(
            f"{target_modules!r} selects none of this model's projections "
            f"({', '.join(HF_MODULES[p] for p in available)} in model.layers.<i>){regex}"
        )
    union = {p for names in chosen.values() for p in names}
    # A run adapts the same projections in every selected layer — those of them the layer has
    # (a hybrid model's DeltaNet and full-attention layers have different ones).
    uneven = [
        i
        for i, names in chosen.items()
        if set(names) != union & {p for ps in linear_projections(arch, i).values() for p in ps}
    ]
    if uneven:
        per_layer = "; ".join(f"layer {i + 1}: {','.join(p)}" for i, p in sorted(chosen.items()))
        raise ValueError(
            f"{target_modules!r} adapts different projections in different layers "
            f"({per_layer}); a run adapts the same projections in each selected layer"
        )
    return sorted(union), sorted(chosen)


def adapter_values(config: dict[str, Any], arch: Any) -> dict[str, Any]:
    """`model.peft.lora_tuning.*` values equivalent to an adapter_config.json.

    Returns:
        adapter_dim, alpha (float), adapter_dropout (float), target_modules (sorted projection
        names), layer_selection (sorted 1-based layer numbers, None for every layer).

    Raises:
        ValueError: targets this architecture cannot take (see `peft_selection`).
    """
    get = {k: config.get(k, v) for k, v in PEFT_DEFAULTS.items()}
    try:
        projections, layers = peft_selection(
            config.get("target_modules"), config.get("layers_to_transform"), arch
        )
    except ValueError as e:
        raise ValueError(f"target_modules {e}") from e
    return {
        "adapter_dim": int(get["r"]),
        "alpha": float(get["lora_alpha"]),
        "adapter_dropout": float(get["lora_dropout"]),
        "target_modules": projections,
        "layer_selection": None if len(layers) == arch.num_layers else [i + 1 for i in layers],
    }


def comparable(key: str, value: Any, arch: Any) -> Any:
    """A run's value of a `FIXED_KEYS` key in `adapter_values`' form (projection names, 1-based
    layers or None for all), so that equivalent spellings compare equal.

    Raises:
        ValueError: a value the run's checks refuse (unknown target, layer out of range).
    """
    if key == "target_modules":
        return sorted({p for t in resolve_targets(list(value), arch) for p in t.projections})
    if key == "layer_selection":
        layers = selected_layers(None if value is None else list(value), arch.num_layers)
        return None if len(layers) == arch.num_layers else [i + 1 for i in layers]
    return float(value) if key == "alpha" else int(value)


def contradiction(
    run: dict[str, Any], adapter: dict[str, Any], where: str, prefix: str = "model.peft.lora_tuning"
) -> str:
    """One line naming every key whose run value (`run`, as the run states it) differs from the
    adapter's (`adapter`, in `adapter_values`' form): the run's keys first, then the adapter's
    values under the same names (layer_selection 1-based, as the key is)."""
    keys = ", ".join(f"{prefix}.{k}={run[k]!r}" for k in run)
    theirs = ", ".join(f"{k}={adapter[k]!r}" for k in run)
    return (
        f"{keys}: the starting adapter {where} has {theirs}; leave these keys unset (they are "
        "read from the adapter) or give the adapter's values"
    )
