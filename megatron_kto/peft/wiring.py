"""Apply LoRA to built model chunks: adapters beside the targeted linears, base frozen, on/off.

The adapters of a chunk live in one container module, `GPTModel.lora`, keyed by *global* layer
index (`lora.layers.<i>.<linear>.adapters.<proj>.lora_{A,B}`), so their state-dict and
dist-checkpoint keys are the same under every TP/PP/VPP layout. The container writes its own
sharded state dict (TP axis per matrix, see `lora.LoRALinear.shard_axes`).

Call `apply_lora` after the base weights are restored and before megatron DDP wraps the chunks:
then only adapter parameters have gradient buffers and optimizer state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from megatron_kto.config.architecture import GATED_ACTIVATIONS
from megatron_kto.conversion.addressing import LAYER, ChunkLayout, head_layout
from megatron_kto.conversion.deltanet import shape_of
from megatron_kto.models.builder import unwrap
from megatron_kto.models.unique_params import counted_here, world_sum
from megatron_kto.peft.lora import FusedLayout, LoRALinear, Projection, attach
from megatron_kto.peft.settings import LoRASettings
from megatron_kto.peft.targets import (
    layer_entries,
    projection_shape,
    resolve_targets,
    selected_layers,
)


class LoRAAdapters(torch.nn.Module):
    """All adapters of one model chunk (`GPTModel.lora`)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleDict()
        self.removers: list[Any] = []

    def linears(self) -> Iterator[LoRALinear]:
        """Every `LoRALinear` of the chunk."""
        for layer in self.layers.values():
            yield from layer.values()

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        """Adapter tensors with global keys; B sharded like a column-parallel output, A like a
        row-parallel input, the other matrix replicated."""
        dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
        tp = parallel_state.get_tensor_model_parallel_group()
        out: dict[str, Any] = {}
        for index, layer in self.layers.items():
            for linear_key, adapter in layer.items():
                state = adapter.state_dict(prefix="", keep_vars=True)
                axes = adapter.shard_axes()
                out.update(
                    make_sharded_tensors_for_checkpoint(
                        state,
                        f"{prefix}layers.{index}.{linear_key}.",
                        {k: v for k, v in axes.items() if v is not None},
                        sharded_offsets,
                        tp_group=tp,
                        dp_cp_group=dp_cp,
                    )
                )
        return out


def _linear_key(path: str) -> str:
    # ModuleDict keys cannot hold dots: `self_attention.linear_qkv` -> `self_attention__linear_qkv`.
    return path.replace(".", "__")


def _layout(linear: str, arch: Any, layer: int) -> FusedLayout:
    """The fused layout of a linear's output in layer `layer`, from its conversion entry's kind."""
    kind = layer_entries(arch, layer)[linear].kind
    if kind in ("qkv", "gated_qkv"):
        heads, groups, head_dim = head_layout(arch)
        return FusedLayout(kind, groups, heads // groups, head_dim)
    if kind == "deltanet_in_proj":
        return FusedLayout(kind, deltanet=shape_of(arch))
    if kind == "gated_mlp" and arch.activation in GATED_ACTIVATIONS:
        return FusedLayout("fc1")
    return FusedLayout("single")


def _submodule(root: torch.nn.Module, path: str) -> torch.nn.Module | None:
    module = root
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def apply_lora(chunks: list[torch.nn.Module], arch: Any, settings: LoRASettings) -> None:
    """Add adapters to this rank's chunks and freeze every other parameter.

    Args:
        chunks: this rank's model chunks (possibly `Float16Module`-wrapped), not yet DDP-wrapped.
        arch: the model's GPTArchitecture.
        settings: rank, scaling, targets, layers, init.

    Raises:
        ValueError: bad targets / layers, or a targeted linear that this model does not have
            (e.g. the MLP of a mixture-of-experts layer).
    """
    names = list(settings.target_modules)
    resolve_targets(names, arch)  # every name, before any layer is touched
    layers = set(selected_layers(settings.layer_selection, arch.num_layers))
    for chunk in chunks:
        model = unwrap(chunk)
        for p in model.parameters():
            p.requires_grad_(False)
        container = LoRAAdapters()
        layout = ChunkLayout.of(model)
        for index, layer in zip(layout.layers, model.decoder.layers, strict=True):
            if index not in layers:
                continue
            adapted = torch.nn.ModuleDict()
            for t in resolve_targets(names, arch, index):
                base = _submodule(layer, t.linear)
                if base is None or not hasattr(base, "weight"):
                    raise ValueError(
                        f"layer {index + 1} has no plain `{t.linear}` linear to adapt "
                        f"(targets {list(settings.target_modules)})"
                    )
                adapter = LoRALinear(
                    base,
                    [Projection(p, *projection_shape(p, arch)) for p in t.projections],
                    _layout(t.linear, arch, index),
                    [Projection(p, *projection_shape(p, arch)) for p in t.all_projections],
                    rank=settings.rank,
                    alpha=settings.alpha,
                    dropout=settings.dropout,
                    init_a=settings.init_a,
                    init_b=settings.init_b,
                    seed=settings.seed,
                    key=LAYER.format(layer=index, name=t.linear),
                )
                adapted[_linear_key(t.linear)] = adapter
                container.removers.append(attach(base, adapter))
            container.layers[str(index)] = adapted
        model.lora = container
        if model.config.recompute_granularity is not None and model.pre_process:
            # Reentrant activation checkpointing drops the gradients of blocks whose inputs
            # need none; with a frozen embedding the adapters' inputs would need none.
            model.embedding.register_forward_hook(_require_grad)


def _require_grad(module, args, output):
    return output.requires_grad_(True) if torch.is_grad_enabled() else output


def adapters_of(chunks: list[torch.nn.Module]) -> list[LoRALinear]:
    """Every `LoRALinear` of the chunks (none without LoRA)."""
    out: list[LoRALinear] = []
    for chunk in chunks:
        container = getattr(unwrap(chunk), "lora", None)
        if container is not None:
            out.extend(container.linears())
    return out


def has_lora(chunks: list[torch.nn.Module]) -> bool:
    """Whether `apply_lora` was applied to the chunks."""
    return any(getattr(unwrap(c), "lora", None) is not None for c in chunks)


@contextlib.contextmanager
def adapters_disabled(chunks: list[torch.nn.Module]) -> Iterator[list[torch.nn.Module]]:
    """The base model: every adapter of `chunks` contributes nothing inside the scope."""
    adapters = adapters_of(chunks)
    previous = [a.enabled for a in adapters]
    for a in adapters:
        a.enabled = False
    try:
        yield chunks
    finally:
        for a, was in zip(adapters, previous, strict=True):
            a.enabled = was


def freeze_starting_adapter_copy(chunks: list[torch.nn.Module]) -> None:
    """Keep a frozen copy of every adapter's current values (call once the starting adapter is
    loaded): `reference_adapters` then makes the model base + that copy."""
    for adapter in adapters_of(chunks):
        adapter.hold_reference()


def has_starting_adapter_copy(chunks: list[torch.nn.Module]) -> bool:
    """Whether the chunks' adapters hold a frozen copy of the starting adapter."""
    adapters = adapters_of(chunks)
    return bool(adapters) and all(a.holds_reference() for a in adapters)


@contextlib.contextmanager
def reference_adapters(chunks: list[torch.nn.Module]) -> Iterator[list[torch.nn.Module]]:
    """The reference policy inside the scope: base + the frozen starting adapter where the
    adapters hold one (`freeze_starting_adapter_copy`), else the base (adapters off)."""
    adapters = adapters_of(chunks)
    previous = [(a.enabled, a.use_reference) for a in adapters]
    for a in adapters:
        held = a.holds_reference()
        a.enabled, a.use_reference = held, held
    try:
        yield chunks
    finally:
        for a, (enabled, use_reference) in zip(adapters, previous, strict=True):
            a.enabled, a.use_reference = enabled, use_reference


def parameter_counts(chunks: list[torch.nn.Module]) -> tuple[int, int]:
    """(trainable, total) parameters of the whole model, each tensor counted once whatever the
    layout — the experts of every EP rank included (a collective over the world)."""
    trainable = total = 0
    for p in counted_here(chunks):
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    device = next(unwrap(chunks[0]).parameters()).device
    counts = world_sum(torch.tensor([trainable, total], dtype=torch.float64, device=device))
    return int(counts[0].item()), int(counts[1].item())
