"""Which projections get a LoRA adapter: NeMo's and Hugging Face's target names, resolved.

Pure functions over the architecture, so config validation can call them before any model
exists. The megatron linears and the Hugging Face modules they fuse — and each linear's fusion kind
and TP axis — are read off the conversion table (`conversion.addressing.LINEAR_MAPPINGS`), not
listed a second time. A target is one Hugging Face projection; NeMo's names stand for sets of
them:

==================  ==========================================
NeMo name           Hugging Face projections
==================  ==========================================
attention_qkv       q_proj, k_proj, v_proj
attention_dense     o_proj
mlp_fc1             gate_proj, up_proj (up_proj without SwiGLU)
mlp_fc2             down_proj
attention           attention_qkv + attention_dense
mlp                 mlp_fc1 + mlp_fc2
all                 everything above
==================  ==========================================

NeMo adapts the fused `linear_qkv` / `linear_fc1` with one (A, B) pair; we keep one pair per
projection (peft's representation), so an adapter maps one-to-one to a `peft` `LoraConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_kto.config.architecture import GATED_ACTIVATIONS
from megatron_kto.conversion.addressing import LINEAR_MAPPINGS, Mapping


def _linears_from_table() -> dict[str, tuple[str, ...]]:
    """megatron linear (under `decoder.layers.{i}.`) -> the Hugging Face modules (under
    `model.layers.{i}.`) it fuses, in fused order: read off the conversion table."""
    out = {}
    for entry in LINEAR_MAPPINGS:
        out[entry.megatron.removesuffix(".weight")] = tuple(
            h.removesuffix(".weight") for h in entry.hf
        )
    return out


#: megatron linear -> its Hugging Face projections (`q_proj`, ...), fused order.
LINEARS: dict[str, tuple[str, ...]] = {
    linear: tuple(m.rsplit(".", 1)[-1] for m in modules)
    for linear, modules in _linears_from_table().items()
}
#: The conversion table's entry of each megatron linear's weight (fusion kind, TP axis).
ENTRIES: dict[str, Mapping] = {
    entry.megatron.removesuffix(".weight"): entry for entry in LINEAR_MAPPINGS
}
#: Hugging Face module path of each projection under `model.layers.{i}.`.
HF_MODULES: dict[str, str] = {
    m.rsplit(".", 1)[-1]: m for modules in _linears_from_table().values() for m in modules
}
NEMO_NAMES: dict[str, tuple[str, ...]] = {
    "attention_qkv": ("q_proj", "k_proj", "v_proj"),
    "attention_dense": ("o_proj",),
    "mlp_fc1": ("gate_proj", "up_proj"),
    "mlp_fc2": ("down_proj",),
}
NEMO_NAMES["attention"] = NEMO_NAMES["attention_qkv"] + NEMO_NAMES["attention_dense"]
NEMO_NAMES["mlp"] = NEMO_NAMES["mlp_fc1"] + NEMO_NAMES["mlp_fc2"]
NEMO_NAMES["all"] = NEMO_NAMES["attention"] + NEMO_NAMES["mlp"]
#: The targets of a LoRA run that names none (and starts from no adapter): NeMo-Aligner's stock
#: `model.peft.lora_tuning` block. The one definition: the config and `wiring.LoRASettings` use it.
DEFAULT_TARGET_MODULES: tuple[str, ...] = ("attention_qkv",)


@dataclass(frozen=True)
class LinearTargets:
    """The adapted projections of one megatron linear.

    Attributes:
        linear: megatron path under `decoder.layers.{i}.` (e.g. `mlp.linear_fc1`).
        projections: adapted Hugging Face projections, in fused order.
        all_projections: every projection the linear fuses, in fused order.
    """

    linear: str
    projections: tuple[str, ...]
    all_projections: tuple[str, ...]


def linear_projections(arch: Any) -> dict[str, tuple[str, ...]]:
    """`LINEARS` for this architecture: without a gated MLP (SwiGLU, GeGLU), `linear_fc1` is
    `up_proj` alone."""
    out = dict(LINEARS)
    if arch.activation not in GATED_ACTIVATIONS:
        out["mlp.linear_fc1"] = ("up_proj",)
    return out


def resolve_targets(names: list[str], arch: Any) -> list[LinearTargets]:
    """The megatron linears to adapt and their projections.

    Args:
        names: `model.peft.lora_tuning.target_modules` (NeMo or Hugging Face names, mixed).
        arch: anything with GPTArchitecture's `activation`.

    Raises:
        ValueError: an unknown name, a projection the architecture lacks, or no target.
    """
    if not names:
        raise ValueError("no target modules given")
    linears = linear_projections(arch)
    available = {p for projs in linears.values() for p in projs}
    wanted: set[str] = set()
    for name in names:
        if name in NEMO_NAMES:
            wanted.update(p for p in NEMO_NAMES[name] if p in available)
        elif name in HF_MODULES:
            if name not in available:
                raise ValueError(
                    f"{name!r}: this architecture has no such projection "
                    f"(activation {arch.activation!r}); available: {sorted(available)}"
                )
            wanted.add(name)
        else:
            known = sorted(NEMO_NAMES) + list(HF_MODULES)
            raise ValueError(f"unknown target module {name!r}; one of {known}")
    return [
        LinearTargets(linear, tuple(p for p in projs if p in wanted), projs)
        for linear, projs in linears.items()
        if any(p in wanted for p in projs)
    ]


def check_moe_targets(names: list[str], arch: Any) -> None:
    """Refuse MLP targets on a mixture-of-experts model: its experts take no adapters
    (`wiring.apply_lora` adapts the attention only there).

    Raises:
        ValueError: `names` adapt an MLP projection of a model with routed experts.
    """
    if not getattr(arch, "num_moe_experts", None):
        return
    mlp = [
        p
        for t in resolve_targets(names, arch)
        if t.linear.startswith("mlp.")
        for p in t.projections
    ]
    if mlp:
        raise ValueError(
            f"{list(names)} adapts the MLP ({', '.join(mlp)}), whose experts take no adapters in "
            "a mixture-of-experts model; target the attention only (attention_qkv, "
            "attention_dense, attention or q_proj/k_proj/v_proj/o_proj)"
        )


def projection_shape(name: str, arch: Any) -> tuple[int, int]:
    """(in_features, out_features) of a Hugging Face projection, unsharded."""
    heads = arch.num_attention_heads
    groups = arch.num_query_groups or heads
    head_dim = arch.kv_channels or arch.hidden_size // heads
    h, f = arch.hidden_size, arch.ffn_hidden_size
    return {
        "q_proj": (h, heads * head_dim),
        "k_proj": (h, groups * head_dim),
        "v_proj": (h, groups * head_dim),
        "o_proj": (heads * head_dim, h),
        "gate_proj": (h, f),
        "up_proj": (h, f),
        "down_proj": (f, h),
    }[name]


def selected_layers(selection: list[int] | None, num_layers: int) -> list[int]:
    """0-based indices of the adapted layers; `selection` is NeMo's 1-based list (None: all).

    Raises:
        ValueError: a layer number outside 1..num_layers, or an empty selection.
    """
    if selection is None:
        return list(range(num_layers))
    bad = [n for n in selection if not 1 <= int(n) <= num_layers]
    if bad or not selection:
        raise ValueError(
            f"layer numbers are 1-based and must lie in 1..{num_layers}, got {list(selection)}"
        )
    return sorted({int(n) - 1 for n in selection})
