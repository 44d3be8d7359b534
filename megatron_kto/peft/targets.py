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

Hybrid models (Qwen3-Next, Qwen3.5) have two kinds of layer, read from the conversion table of
each kind: gated DeltaNet layers adapt `linear_attn.in_proj_*` (megatron's fused `in_proj`:
`in_proj_qkvz` + `in_proj_ba`, or `in_proj_qkv` / `in_proj_z` / `in_proj_b` / `in_proj_a` as
`GPTArchitecture.linear_in_proj` says) and `linear_attn.out_proj`; full-attention layers adapt
the gated `q_proj` (query and output gate per head), `k_proj`, `v_proj`, `o_proj`. In these models
`attention_qkv` also stands for the DeltaNet input projections and `attention_dense` for
`out_proj`; a name only one kind of layer has adapts the layers of that kind.

Multi-latent attention (DeepSeek-V3, `models/mla.py`) adapts its projections by their Hugging
Face names, read off the `deepseek_v3` table: `q_a_proj` / `q_b_proj` (with `q_lora_rank`) or
`q_proj` (without), `kv_a_proj_with_mqa`, `kv_b_proj` — all of them `attention_qkv` — and `o_proj`
(`attention_dense`). Each is one megatron linear of its own (`linear_q_down_proj`,
`linear_q_up_proj` / `linear_q_proj`, `linear_kv_down_proj`, `linear_kv_up_proj`, `linear_proj`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_kto.config.architecture import GATED_ACTIVATIONS, IN_PROJ_NAMES
from megatron_kto.conversion.addressing import COLUMN, LINEAR_MAPPINGS, REPLICATED, Mapping
from megatron_kto.conversion.families.deepseek_v3 import mla_attention_mappings
from megatron_kto.conversion.families.qwen3_next import deltanet_mappings, gated_attention_mappings

#: The linears of a hybrid layer's attention that take adapters (conv1d, norms and gates do not).
_HYBRID_LINEARS = ("self_attention.in_proj", "self_attention.out_proj")
#: Every DeltaNet input projection name (both families' spellings).
_DELTANET_IN = tuple(n for names in IN_PROJ_NAMES.values() for n in names)


def _deltanet_entries(in_proj: str) -> tuple[Mapping, ...]:
    """The adaptable entries of a DeltaNet layer's conversion table (`in_proj`, `out_proj`)."""
    return tuple(
        e
        for e in deltanet_mappings(IN_PROJ_NAMES[in_proj])
        if e.megatron.removesuffix(".weight") in _HYBRID_LINEARS
    )


def _linears_from_table(entries: tuple[Mapping, ...]) -> dict[str, tuple[str, ...]]:
    """megatron linear (under `decoder.layers.{i}.`) -> the Hugging Face modules (under
    `model.layers.{i}.`) it fuses, in fused order: read off the conversion table."""
    out = {}
    for entry in entries:
        out[entry.megatron.removesuffix(".weight")] = tuple(
            h.removesuffix(".weight") for h in entry.hf
        )
    return out


def _short(modules: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    return {linear: tuple(m.rsplit(".", 1)[-1] for m in ms) for linear, ms in modules.items()}


_HYBRID_ENTRIES = tuple(e for kind in IN_PROJ_NAMES for e in _deltanet_entries(kind))


def _mla_entries(q_lora: bool) -> tuple[Mapping, ...]:
    """The linears of an MLA layer's attention (the tensor-parallel entries of its table: the
    latent norms are replicated)."""
    return tuple(e for e in mla_attention_mappings(q_lora) if e.tp_axis is not REPLICATED)


_MLA_ENTRIES = _mla_entries(True) + _mla_entries(False)
#: The MLA projections `attention_qkv` stands for (all but the output projection).
_MLA_QKV = tuple(
    dict.fromkeys(
        h.removesuffix(".weight").rsplit(".", 1)[-1]
        for e in _MLA_ENTRIES
        if e.tp_axis == COLUMN
        for h in e.hf
    )
)


#: megatron linear -> its Hugging Face projections (`q_proj`, ...), fused order.
LINEARS: dict[str, tuple[str, ...]] = _short(_linears_from_table(LINEAR_MAPPINGS))
#: The conversion table's entry of each megatron linear's weight (fusion kind, TP axis).
ENTRIES: dict[str, Mapping] = {
    entry.megatron.removesuffix(".weight"): entry for entry in LINEAR_MAPPINGS
}
#: Hugging Face module path of each projection under `model.layers.{i}.`.
HF_MODULES: dict[str, str] = {
    h.removesuffix(".weight").rsplit(".", 1)[-1]: h.removesuffix(".weight")
    for entry in LINEAR_MAPPINGS + _HYBRID_ENTRIES + _MLA_ENTRIES
    for h in entry.hf
}
NEMO_NAMES: dict[str, tuple[str, ...]] = {
    "attention_qkv": tuple(dict.fromkeys(("q_proj", "k_proj", "v_proj", *_DELTANET_IN, *_MLA_QKV))),
    "attention_dense": ("o_proj", "out_proj"),
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
        column: whether the linear is column-parallel (else row-parallel), as its table says.
    """

    linear: str
    projections: tuple[str, ...]
    all_projections: tuple[str, ...]
    column: bool = True


def _is_hybrid(arch: Any) -> bool:
    return bool(getattr(arch, "attention_output_gate", False)) or any(
        getattr(arch, "linear_attention_freq", None) or []
    )


def layer_entries(arch: Any, layer: int | None = None) -> dict[str, Mapping]:
    """megatron linear -> its conversion entry (fusion kind, TP axis) in layer `layer` (0-based);
    None: every linear of any layer (both kinds of a hybrid model)."""
    out = {e.megatron.removesuffix(".weight"): e for e in LINEAR_MAPPINGS}
    if getattr(arch, "multi_latent_attention", False):
        mla = _mla_entries(getattr(arch, "q_lora_rank", None) is not None)
        mlp = {k: v for k, v in out.items() if k.startswith("mlp.")}
        return {**{e.megatron.removesuffix(".weight"): e for e in mla}, **mlp}
    if not _is_hybrid(arch):
        return out
    freq = list(getattr(arch, "linear_attention_freq", None) or [])
    kinds = set(freq or [0]) if layer is None else {freq[layer] if freq else 0}
    gated = {e.megatron.removesuffix(".weight"): e for e in gated_attention_mappings()}
    attention: dict[str, Mapping] = {}
    if 0 in kinds:
        attention.update({k: gated[k] for k in ("self_attention.linear_qkv",)})
        attention["self_attention.linear_proj"] = out["self_attention.linear_proj"]
    if 1 in kinds:
        for e in _deltanet_entries(str(getattr(arch, "linear_in_proj", "qkvz_ba"))):
            attention[e.megatron.removesuffix(".weight")] = e
    mlp = {k: v for k, v in out.items() if k.startswith("mlp.")}
    return {**attention, **mlp}


def linear_projections(arch: Any, layer: int | None = None) -> dict[str, tuple[str, ...]]:
    """megatron linear -> its projections in layer `layer` (None: in any layer; see
    `layer_entries`); without a gated MLP (SwiGLU, GeGLU), `linear_fc1` is `up_proj` alone."""
    out = _short(_linears_from_table(tuple(layer_entries(arch, layer).values())))
    if arch.activation not in GATED_ACTIVATIONS:
        out["mlp.linear_fc1"] = ("up_proj",)
    return out


def resolve_targets(names: list[str], arch: Any, layer: int | None = None) -> list[LinearTargets]:
    """The megatron linears to adapt and their projections.

    Args:
        names: `model.peft.lora_tuning.target_modules` (NeMo or Hugging Face names, mixed).
        arch: anything with GPTArchitecture's `activation`.
        layer: 0-based layer whose linears are meant (hybrid models' layers differ); None: the
            linears of any layer.

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
                    f"({_shape_facts(arch)}); available: {sorted(available)}"
                )
            wanted.add(name)
        else:
            known = sorted(NEMO_NAMES) + list(HF_MODULES)
            raise ValueError(f"unknown target module {name!r}; one of {known}")
    if layer is not None:
        linears = linear_projections(arch, layer)
    entries = layer_entries(arch, layer)
    return [
        LinearTargets(
            linear,
            tuple(p for p in projs if p in wanted),
            projs,
            column=entries[linear].tp_axis == COLUMN,
        )
        for linear, projs in linears.items()
        if any(p in wanted for p in projs)
    ]


def _shape_facts(arch: Any) -> str:
    """The architecture facts that decide which projections exist (for an error line)."""
    facts = f"activation {arch.activation!r}"
    if getattr(arch, "multi_latent_attention", False):
        facts += f", multi-latent attention with q_lora_rank {arch.q_lora_rank}"
    return facts


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
        attention = "/".join(
            p
            for linear, ps in linear_projections(arch).items()
            if "attention" in linear
            for p in ps
        )
        raise ValueError(
            f"{list(names)} adapts the MLP ({', '.join(mlp)}), whose experts take no adapters in "
            "a mixture-of-experts model; target the attention only (attention_qkv, "
            f"attention_dense, attention or {attention})"
        )


def projection_shape(name: str, arch: Any) -> tuple[int, int]:
    """(in_features, out_features) of a Hugging Face projection, unsharded."""
    heads = arch.num_attention_heads
    groups = arch.num_query_groups or heads
    head_dim = arch.kv_channels or arch.hidden_size // heads
    h, f = arch.hidden_size, arch.ffn_hidden_size
    if getattr(arch, "multi_latent_attention", False) and name in (*_MLA_QKV, "o_proj"):
        return _mla_projection_shape(name, arch)
    if name in _DELTANET_IN or name == "out_proj":
        qk = arch.linear_num_key_heads * arch.linear_key_head_dim
        v, hv = (
            arch.linear_num_value_heads * arch.linear_value_head_dim,
            arch.linear_num_value_heads,
        )
        return {
            "in_proj_qkvz": (h, 2 * qk + 2 * v),
            "in_proj_ba": (h, 2 * hv),
            "in_proj_qkv": (h, 2 * qk + v),
            "in_proj_z": (h, v),
            "in_proj_b": (h, hv),
            "in_proj_a": (h, hv),
            "out_proj": (v, h),
        }[name]
    gate = 2 if getattr(arch, "attention_output_gate", False) else 1  # query + gate per head
    return {
        "q_proj": (h, gate * heads * head_dim),
        "k_proj": (h, groups * head_dim),
        "v_proj": (h, groups * head_dim),
        "o_proj": (heads * head_dim, h),
        "gate_proj": (h, f),
        "up_proj": (h, f),
        "down_proj": (f, h),
    }[name]


def _mla_projection_shape(name: str, arch: Any) -> tuple[int, int]:
    """(in, out) of a multi-latent attention projection (`models/mla.py`)."""
    h, heads, q_rank = arch.hidden_size, arch.num_attention_heads, arch.q_lora_rank
    nope, rope, v = arch.qk_nope_head_dim, arch.qk_rope_head_dim, arch.v_head_dim
    return {
        "q_proj": (h, heads * (nope + rope)),
        "q_a_proj": (h, q_rank),
        "q_b_proj": (q_rank, heads * (nope + rope)),
        "kv_a_proj_with_mqa": (h, arch.kv_lora_rank + rope),
        "kv_b_proj": (arch.kv_lora_rank, heads * (nope + v)),
        "o_proj": (heads * v, h),
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
