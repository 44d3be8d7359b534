"""Hugging Face PEFT adapter directories in and out, and folding adapters into a model's base
weights (`merge_and_strip`, a loop over `merge.merge_lora`).

A `peft` LoRA directory holds `adapter_config.json` and `adapter_model.safetensors` with keys
`base_model.model.model.layers.{i}.<module>.lora_{A,B}.weight` (A [r, in], B [out, r]). Our
adapters are one (A, B) pair per Hugging Face projection, so the tensors are the same numbers;
the module paths come from the conversion table (`targets.HF_MODULES`, derived from
`conversion.addressing.LINEAR_MAPPINGS`), layer numbers from the adapter's global name
(`addressing.parse_name`), and TP shards are cut from / gathered into the full tensors along the
adapter's axes (`addressing.lora_axes`, through `LoRALinear.shard` / `shard_axes`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from megatron_kto.conversion.addressing import HF_LAYER, ChunkLayout, parse_name
from megatron_kto.models.builder import unwrap
from megatron_kto.peft.adapter_config import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    FIXED_KEYS,
    adapter_values,
    comparable,
    contradiction,
    read_adapter_config,
)
from megatron_kto.peft.lora import LoRALinear
from megatron_kto.peft.merge import merge_lora
from megatron_kto.peft.targets import HF_MODULES, resolve_targets, selected_layers
from megatron_kto.peft.wiring import LoRASettings, adapters_of

#: PEFT's prefix of the wrapped model's Hugging Face names.
_PREFIX = "base_model.model."


class AdapterError(ValueError):
    """A PEFT adapter directory that does not fit this model or run (one line)."""


def _layer(adapter: LoRALinear) -> int:
    return parse_name(adapter.key).layer  # type: ignore[return-value]  # decoder.layers.<i>...


def hf_key(layer: int, projection: str, which: str) -> str:
    """PEFT's safetensors key of `lora_A` / `lora_B` of one projection of one layer."""
    return _PREFIX + HF_LAYER.format(layer=layer, name=f"{HF_MODULES[projection]}.{which}.weight")


def expected_keys(settings: LoRASettings, arch: Any) -> set[str]:
    """Every key an adapter of these settings has, over the whole model."""
    layers = selected_layers(settings.layer_selection, arch.num_layers)
    return {
        hf_key(i, p, which)
        for i in layers
        for t in resolve_targets(settings.target_modules, arch, i)
        for p in t.projections
        for which in ("lora_A", "lora_B")
    }


def peft_config(settings: LoRASettings, arch: Any, base_model: str | None) -> dict[str, Any]:
    """`adapter_config.json` contents equivalent to `settings` (a `peft` LoraConfig)."""
    projections = sorted(
        {p for t in resolve_targets(settings.target_modules, arch) for p in t.projections}
    )
    layers = settings.layer_selection
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": projections,
        "layers_to_transform": None if layers is None else sorted(int(n) - 1 for n in layers),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def full_pair(adapter: LoRALinear, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(lora_A, lora_B) of projection `name`, whole: tensor-parallel shards are all-gathered
    over the TP group (collective; every TP rank must ask for the same pairs in order)."""
    from megatron.core import parallel_state

    from megatron_kto.models.tp_gather import gather_tp

    axes = adapter.shard_axes()
    group = parallel_state.get_tensor_model_parallel_group() if adapter.tp > 1 else None
    pair = adapter.adapters[name]
    return tuple(  # type: ignore[return-value]
        gather_tp(getattr(pair, w).detach(), axes[f"adapters.{name}.{w}"], "direct", group)
        for w in ("lora_A", "lora_B")
    )


def full_tensors(chunks: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """This process's adapters as PEFT keys -> full fp32 host tensors (collective over the TP
    group when TP > 1)."""
    out: dict[str, torch.Tensor] = {}
    for adapter in adapters_of(chunks):
        for name in adapter.names:
            for which, tensor in zip(("lora_A", "lora_B"), full_pair(adapter, name), strict=True):
                out[hf_key(_layer(adapter), name, which)] = tensor.float().cpu().contiguous()
    return out


def write_adapter(
    out_dir: str | Path,
    chunks: list[torch.nn.Module],
    settings: LoRASettings,
    arch: Any,
    base_model: str | None = None,
) -> None:
    """Write `adapter_config.json` + `adapter_model.safetensors` (fp32) into `out_dir`."""
    write_adapter_files(out_dir, full_tensors(chunks), settings, arch, base_model)


def write_adapter_files(
    out_dir: str | Path,
    tensors: dict[str, torch.Tensor],
    settings: LoRASettings,
    arch: Any,
    base_model: str | None = None,
) -> None:
    """Write PEFT-keyed full `tensors` (as given; fp32 by convention) and the `adapter_config.json`
    of `settings` into `out_dir` (created if absent)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = peft_config(settings, arch, base_model)
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def read_adapter(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter_config.json, tensors) of a PEFT LoRA directory.

    Raises:
        AdapterError: missing files, or a PEFT method other than plain LoRA.
    """
    from safetensors.torch import load_file

    path = Path(path)
    try:
        config = read_adapter_config(path)
    except ValueError as e:
        raise AdapterError(str(e)) from e
    tensors = {
        k.replace(".default.", "."): v for k, v in load_file(str(path / ADAPTER_WEIGHTS)).items()
    }
    return config, tensors


def check_matches(config: dict[str, Any], settings: LoRASettings, arch: Any, where: str) -> None:
    """The adapter's rank, alpha, targets and layers are the run's (equivalent spellings agree:
    NeMo or peft target names, a regular expression, `layers_to_transform` as an index or a list).

    Raises:
        AdapterError: one line naming every run key that differs, with the adapter's values.
    """
    try:
        theirs = adapter_values(config, arch)
    except ValueError as e:
        raise AdapterError(f"{where}: {ADAPTER_CONFIG}: {e}") from e
    run = {
        "adapter_dim": settings.rank,
        "alpha": settings.alpha,
        "target_modules": list(settings.target_modules),
        "layer_selection": settings.layer_selection,
    }
    differing = {k: run[k] for k in FIXED_KEYS if comparable(k, run[k], arch) != theirs[k]}
    if differing:
        raise AdapterError(contradiction(differing, theirs, where))


def load_adapter(
    chunks: list[torch.nn.Module], tensors: dict[str, torch.Tensor], expected: set[str], where: str
) -> None:
    """Copy PEFT tensors into this rank's adapters (each rank takes its TP shard).

    Args:
        expected: every key the run's adapter has (`expected_keys`); the file must hold exactly
            these.

    Raises:
        AdapterError: missing / unexpected keys or shapes that do not fit.
    """
    missing, extra = sorted(expected - tensors.keys()), sorted(tensors.keys() - expected)
    if missing or extra:
        what = f"lacks {missing[:2]}" if missing else f"has keys the run lacks: {extra[:2]}"
        raise AdapterError(f"{where}: the adapter {what}")
    with torch.no_grad():
        for adapter in adapters_of(chunks):
            for name in adapter.names:
                pair = adapter.adapters[name]
                for which in ("lora_A", "lora_B"):
                    key = hf_key(_layer(adapter), name, which)
                    param = getattr(pair, which)
                    part = adapter.shard(name, which, tensors[key])
                    if part.shape != param.shape:
                        raise AdapterError(
                            f"{where}: {key} has shape {tuple(tensors[key].shape)}, which does "
                            "not fit this model"
                        )
                    param.copy_(part)


def _pair(adapter: LoRALinear, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(lora_A, lora_B) of projection `name` as this rank holds them (None: no adapter)."""
    if name not in adapter.names:
        return None
    pair = adapter.adapters[name]
    return pair.lora_A, pair.lora_B


def merge_and_strip(chunks: list[torch.nn.Module], arch: Any) -> None:
    """Fold every adapter into its base weight (`merge.merge_lora`: W + scaling·B·A, fused as
    the base is) and remove the adapters: the chunks become a plain model (TP=1 only).
    `arch` is no longer read (each adapter carries its fused layout); callers still pass it."""
    for chunk in chunks:
        model = unwrap(chunk)
        container = getattr(model, "lora", None)
        if container is None:
            continue
        with torch.no_grad():
            for adapter in container.linears():
                if adapter.tp != 1:
                    raise AdapterError("merging adapters runs at tensor-parallel size 1")
                name = parse_name(adapter.key)
                local = ChunkLayout.of(model).local_layer(name.layer)
                base = model.decoder.layers[local].get_submodule(name.rest)
                pairs = [_pair(adapter, n) for n in adapter.all_names]
                base.weight.copy_(merge_lora(base.weight, pairs, adapter.scaling, adapter.layout))
        for remove in container.removers:
            remove()
        del model.lora
