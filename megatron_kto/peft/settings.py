"""`model.peft.*` read and checked: the LoRA settings of a run, and the reference it implies.

Plain functions over the composed config, importable without torch or megatron-core (config
validation runs before any model exists).
"""

from __future__ import annotations

from typing import Any

from megatron_kto.config.errors import ConfigError
from megatron_kto.peft.targets import resolve_targets, selected_layers

SCHEMES = ("none", "lora")
#: `model.peft.reference`: the starting policy (base + starting adapter) or the base model.
REFERENCES = ("start", "base")
INIT_METHODS = ("xavier", "normal", "kaiming", "zero")
#: Reference strategies and whether they fit a LoRA run.
LORA_REFERENCES = ("adapters_off", "precomputed")
FULL_REFERENCES = ("cpu_swap", "separate", "precomputed")
_KEY = "model.peft.lora_tuning"


def uses_lora(model_cfg: Any) -> bool:
    """Whether the run trains LoRA adapters (`model.peft.peft_scheme: lora`)."""
    return str(model_cfg.peft.peft_scheme) == "lora"


def reference_strategy(model_cfg: Any, algorithm: str) -> str:
    """`model.<algorithm>.reference_policy`, its default resolved: 'adapters_off' with LoRA,
    else 'cpu_swap'."""
    chosen = (model_cfg.kto if algorithm == "kto" else model_cfg.dpo).reference_policy
    if chosen is not None:
        return str(chosen)
    return "adapters_off" if uses_lora(model_cfg) else "cpu_swap"


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
    if lt.weight_tying:
        raise ConfigError(f"{_KEY}.weight_tying: not implemented (adapters are per layer)")
    if lt.position_embedding_strategy is not None:
        raise ConfigError(f"{_KEY}.position_embedding_strategy: not implemented (must be null)")
    if not (isinstance(lt.adapter_dim, int) and lt.adapter_dim > 0):
        raise ConfigError(f"{_KEY}.adapter_dim: must be a positive integer, got {lt.adapter_dim!r}")
    if lt.alpha is not None and not lt.alpha > 0:
        raise ConfigError(f"{_KEY}.alpha: must be > 0 (or null for adapter_dim), got {lt.alpha!r}")
    if not 0.0 <= lt.adapter_dropout < 1.0:
        raise ConfigError(f"{_KEY}.adapter_dropout: must be in [0, 1), got {lt.adapter_dropout!r}")
    for key in ("column_init_method", "row_init_method"):
        if getattr(lt, key) not in INIT_METHODS:
            raise ConfigError(
                f"{_KEY}.{key}: must be one of {list(INIT_METHODS)}, got {getattr(lt, key)!r}"
            )
    try:
        resolve_targets(list(lt.target_modules or []), arch)
    except ValueError as e:
        raise ConfigError(f"{_KEY}.target_modules: {e}") from e
    try:
        selected_layers(
            None if lt.layer_selection is None else list(lt.layer_selection), arch.num_layers
        )
    except ValueError as e:
        raise ConfigError(f"{_KEY}.layer_selection: {e}") from e
    if getattr(arch, "num_moe_experts", None):
        mlp = [
            p
            for t in resolve_targets(list(lt.target_modules), arch)
            if t.linear.startswith("mlp.")
            for p in t.projections
        ]
        if mlp:
            raise ConfigError(
                f"{_KEY}.target_modules: {list(lt.target_modules)} adapts the MLP ({', '.join(mlp)}), "
                "whose experts take no adapters in a mixture-of-experts model; target the attention "
                "only (attention_qkv, attention_dense, attention or q_proj/k_proj/v_proj/o_proj)"
            )


def holds_starting_adapter(model_cfg: Any) -> bool:
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
    """`wiring.LoRASettings` of a LoRA run (config already checked by `check_peft`)."""
    from megatron_kto.peft.wiring import LoRASettings

    lt = model_cfg.peft.lora_tuning
    return LoRASettings(
        rank=int(lt.adapter_dim),
        alpha=float(lt.alpha if lt.alpha is not None else lt.adapter_dim),
        dropout=float(lt.adapter_dropout),
        target_modules=[str(t) for t in lt.target_modules],
        layer_selection=None
        if lt.layer_selection is None
        else [int(n) for n in lt.layer_selection],
        init_a=str(lt.column_init_method),
        init_b=str(lt.row_init_method),
        seed=int(model_cfg.seed),
    )
