"""`model.peft.*` read and checked: the LoRA settings of a run, and the reference it implies.

Plain functions over the composed config, importable without torch or megatron-core (config
validation runs before any model exists).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_kto.config.errors import ConfigError
from megatron_kto.peft.adapter_config import (
    FIXED_KEYS,
    adapter_values,
    comparable,
    contradiction,
    peft_selection,
)
from megatron_kto.peft.targets import (
    DEFAULT_TARGET_MODULES,
    check_moe_targets,
    resolve_targets,
    selected_layers,
)

SCHEMES = ("none", "lora")
#: `model.peft.reference`: the starting policy (base + starting adapter) or the base model.
REFERENCES = ("start", "base")
#: LoRA init methods by NeMo's names (`lora._init_full` implements them).
INIT_METHODS = ("xavier", "normal", "kaiming", "zero")
#: `model.peft.lora_tuning.*` keys whose unset (None) value means "the starting adapter's
#: (`model.peft.restore_from_path`), else this built-in default" (NeMo-Aligner's stock block).
#: `alpha` unset means the adapter's, else adapter_dim; `layer_selection` the adapter's, else all.
LORA_DEFAULTS: dict[str, Any] = {
    "adapter_dim": 32,
    "adapter_dropout": 0.0,
    "target_modules": list(DEFAULT_TARGET_MODULES),
}
#: Reference strategies and whether they fit a LoRA run.
LORA_REFERENCES = ("adapters_off", "precomputed")
FULL_REFERENCES = ("cpu_swap", "separate", "precomputed")
_KEY = "model.peft.lora_tuning"


@dataclass
class LoRASettings:
    """What `wiring.apply_lora` builds (`model.peft.lora_tuning.*`, resolved)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGET_MODULES))
    layer_selection: list[int] | None = None
    init_a: str = "xavier"
    init_b: str = "zero"
    seed: int = 1234


def uses_lora(model_cfg: Any) -> bool:
    """Whether the run trains LoRA adapters (`model.peft.peft_scheme: lora`)."""
    return str(model_cfg.peft.peft_scheme) == "lora"


def reference_strategy(model_cfg: Any, algorithm: str) -> str:
    """`model.<algorithm>.reference_policy`, its default resolved: 'none' for a reference-free
    DPO loss type (cpo, simpo, orpo; whatever is set: `unused_reference_note`), else
    'adapters_off' with LoRA, else 'cpu_swap'."""
    # Here, not at the top: this module imports without torch (the loss table needs it).
    from megatron_kto.losses.dpo_types import NO_REFERENCE, needs_reference

    if algorithm == "dpo" and not needs_reference(model_cfg.dpo.loss_type):
        return NO_REFERENCE
    chosen = (model_cfg.kto if algorithm == "kto" else model_cfg.dpo).reference_policy
    if chosen is not None:
        return str(chosen)
    return "adapters_off" if uses_lora(model_cfg) else "cpu_swap"


def unused_reference_note(model_cfg: Any, algorithm: str) -> str | None:
    """A note when `model.dpo.reference_policy` names a reference a reference-free loss type
    will not use (TRL's CPO/ORPO trainers take no reference model either), else None."""
    from megatron_kto.losses.dpo_types import NO_REFERENCE, needs_reference

    if algorithm != "dpo" or needs_reference(model_cfg.dpo.loss_type):
        return None
    stated = model_cfg.dpo.reference_policy
    if stated is None or stated == NO_REFERENCE:
        return None
    return (
        f"model.dpo.reference_policy={stated} is not used: loss_type "
        f"{model_cfg.dpo.loss_type} is reference-free (no reference model, no reference pass)"
    )


def tuning_value(model_cfg: Any, key: str) -> Any:
    """`model.peft.lora_tuning.<key>`, or its built-in default (`LORA_DEFAULTS`) where unset."""
    value = getattr(model_cfg.peft.lora_tuning, key)
    return LORA_DEFAULTS.get(key) if value is None else value


def targets_and_layers(model_cfg: Any, arch: Any) -> tuple[list[str], list[int] | None]:
    """(`target_modules`, `layer_selection`) of the config, the built-in targets where unset.

    `target_modules` may also be peft's string form: a regular expression that must match a whole
    Hugging Face module name (`model.layers.0.self_attn.q_proj`) and so picks the layers too; it
    stands for the projections and (1-based) layers it selects.

    Raises:
        ConfigError: naming the key: neither a list nor a string, a regular expression that
            selects nothing (or not the same projections in each layer), or one given with
            layer_selection.
    """
    lt = model_cfg.peft.lora_tuning
    targets = tuning_value(model_cfg, "target_modules")
    if not isinstance(targets, str):
        if not isinstance(targets, Sequence):
            raise ConfigError(
                f"{_KEY}.target_modules: must be a list of names or one regular expression "
                f"(a string), got {targets!r}"
            )
        layers = lt.layer_selection
        return [str(t) for t in targets], None if layers is None else [int(n) for n in layers]
    if lt.layer_selection is not None:
        raise ConfigError(
            f"{_KEY}.layer_selection: not with a regular-expression {_KEY}.target_modules "
            f"({targets!r}), which selects the layers itself (as in peft); leave it unset"
        )
    try:
        projections, layers = peft_selection(targets, None, arch)
    except ValueError as e:
        raise ConfigError(f"{_KEY}.target_modules: {e}") from e
    return projections, None if len(layers) == arch.num_layers else [i + 1 for i in layers]


def resolve_lora_tuning(
    model_cfg: Any, arch: Any, adapter: dict[str, Any] | None = None, where: str = ""
) -> None:
    """Fill the unset `model.peft.lora_tuning.*` keys in place: from the starting adapter's
    adapter_config.json (`adapter`) when there is one, else the built-in defaults.

    With an adapter, rank, alpha, targets and layers are the adapter's; a value the config states
    that differs is refused. Dropout is a training choice, not part of what the adapter computes:
    a stated value wins.

    Args:
        model_cfg: `model` of the config.
        arch: the model's architecture (target names and layers are resolved against it).
        adapter: the adapter's adapter_config.json, or None.
        where: how the adapter is named in messages (`model.peft.restore_from_path=<path>`).

    Raises:
        ConfigError: the adapter's targets do not fit this model, or stated values contradict
            the adapter (one line naming every such key).
    """
    lt = model_cfg.peft.lora_tuning
    if uses_lora(model_cfg) and isinstance(lt.target_modules, str):
        # peft's regular-expression form, written back as the projections and layers it means.
        lt.target_modules, lt.layer_selection = targets_and_layers(model_cfg, arch)
    if adapter is not None:
        try:
            theirs = adapter_values(adapter, arch)
        except ValueError as e:
            raise ConfigError(f"{where}: adapter_config.json: {e}") from e
        stated = {k: getattr(lt, k) for k in FIXED_KEYS if getattr(lt, k) is not None}
        differing = {}
        for key, value in stated.items():
            try:
                if comparable(key, value, arch) != theirs[key]:
                    differing[key] = value
            except ValueError:
                continue  # an invalid value: check_peft reports it, naming the key
        if differing:
            shown = {
                k: list(v) if k in ("target_modules", "layer_selection") else v
                for k, v in differing.items()
            }
            raise ConfigError(contradiction(shown, theirs, where))
        for key, value in theirs.items():
            if getattr(lt, key) is None:
                setattr(lt, key, value)
    for key in LORA_DEFAULTS:
        setattr(lt, key, tuning_value(model_cfg, key))


def check_peft(model_cfg: Any, algorithm: str, arch: Any) -> None:
    """Cross-field checks of `model.peft.*` (and the reference policy it allows).

    Raises:
        ConfigError: one line naming the key.
    """
    scheme = model_cfg.peft.peft_scheme
    if scheme not in SCHEMES:
        raise ConfigError(f"model.peft.peft_scheme: must be one of {list(SCHEMES)}, got {scheme!r}")
    ref_key = f"model.{algorithm}.reference_policy"
    ref = reference_strategy(model_cfg, algorithm)
    if ref == "none" and algorithm == "dpo":  # losses.dpo_types.NO_REFERENCE
        # A reference-free loss: a stated strategy is unused (noted), but must still be a name.
        stated = model_cfg.dpo.reference_policy
        known = (*FULL_REFERENCES, *LORA_REFERENCES, "none")
        if stated is not None and stated not in known:
            raise ConfigError(f"{ref_key}: must be one of {list(known)}, got {stated!r}")
        ref = "adapters_off" if scheme == "lora" else "cpu_swap"  # any allowed one: none is
    if scheme != "lora":
        if ref not in FULL_REFERENCES:
            raise ConfigError(
                f"{ref_key}: must be one of {list(FULL_REFERENCES)} without LoRA, got {ref!r}"
            )
        if model_cfg.peft.restore_from_path:
            raise ConfigError(
                "model.peft.restore_from_path: an adapter needs model.peft.peft_scheme=lora"
            )
        return
    if ref not in LORA_REFERENCES:
        raise ConfigError(
            f"{ref_key}: with model.peft.peft_scheme=lora the reference is the base model with "
            f"the adapters off: use one of {list(LORA_REFERENCES)}, got {ref!r}"
        )
    if model_cfg.peft.reference not in REFERENCES:
        raise ConfigError(
            f"model.peft.reference: must be one of {list(REFERENCES)}, "
            f"got {model_cfg.peft.reference!r}"
        )
    lt = model_cfg.peft.lora_tuning
    rank, dropout = (
        tuning_value(model_cfg, "adapter_dim"),
        tuning_value(model_cfg, "adapter_dropout"),
    )
    targets, layers = targets_and_layers(model_cfg, arch)
    if lt.weight_tying:
        raise ConfigError(f"{_KEY}.weight_tying: not implemented (adapters are per layer)")
    if lt.position_embedding_strategy is not None:
        raise ConfigError(f"{_KEY}.position_embedding_strategy: not implemented (must be null)")
    if not (isinstance(rank, int) and rank > 0):
        raise ConfigError(f"{_KEY}.adapter_dim: must be a positive integer, got {rank!r}")
    if lt.alpha is not None and not lt.alpha > 0:
        raise ConfigError(f"{_KEY}.alpha: must be > 0 (or null for adapter_dim), got {lt.alpha!r}")
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"{_KEY}.adapter_dropout: must be in [0, 1), got {dropout!r}")
    for key in ("column_init_method", "row_init_method"):
        if getattr(lt, key) not in INIT_METHODS:
            raise ConfigError(
                f"{_KEY}.{key}: must be one of {list(INIT_METHODS)}, got {getattr(lt, key)!r}"
            )
    try:
        resolve_targets(targets, arch)
    except ValueError as e:
        raise ConfigError(f"{_KEY}.target_modules: {e}") from e
    try:
        selected_layers(layers, arch.num_layers)
    except ValueError as e:
        raise ConfigError(f"{_KEY}.layer_selection: {e}") from e
    try:
        check_moe_targets(targets, arch)
    except ValueError as e:
        raise ConfigError(f"{_KEY}.target_modules: {e}") from e


def reference_includes_starting_adapter(model_cfg: Any) -> bool:
    """Whether a LoRA run keeps a frozen copy of its starting adapter as the reference:
    `model.peft.reference=start` and a starting adapter that is not zero — an imported one
    (`model.peft.restore_from_path`) or an init with neither A nor B zero. A zero starting
    adapter is the base model, which the adapters-off reference already is."""
    if not uses_lora(model_cfg) or model_cfg.peft.reference != "start":
        return False
    lt = model_cfg.peft.lora_tuning
    nonzero_init = "zero" not in (lt.column_init_method, lt.row_init_method)
    return bool(model_cfg.peft.restore_from_path) or nonzero_init


def lora_settings(model_cfg: Any) -> Any:
    """The `LoRASettings` of a LoRA run (config already checked by `check_peft`)."""
    lt = model_cfg.peft.lora_tuning
    rank = int(tuning_value(model_cfg, "adapter_dim"))
    targets, layers = targets_and_layers(model_cfg, model_cfg)  # the model config holds the shape
    return LoRASettings(
        rank=rank,
        alpha=float(lt.alpha if lt.alpha is not None else rank),
        dropout=float(tuning_value(model_cfg, "adapter_dropout")),
        target_modules=targets,
        layer_selection=layers,
        init_a=str(lt.column_init_method),
        init_b=str(lt.row_init_method),
        seed=int(model_cfg.seed),
    )
