"""One address per tensor: how each megatron parameter is named, made of Hugging Face tensors,
sharded, and put back together — written once, as data plus pure functions.

A family's table (`conversion/families/`) is a list of `Mapping` entries. Each entry owns:
- its megatron name (relative to `decoder.layers.{i}.`; `at(i, norms)` gives the global one) and
  the Hugging Face names it is made of (relative to `model.layers.{i}.`);
- its `kind`, which decides how the Hugging Face tensors fuse and how a rank's shard is sliced
  and reassembled: `direct` (one tensor), `qkv` (q, k, v interleaved per query group), `gated_mlp`
  (SwiGLU gate rows then up rows, sharded per half), `vocab` (embedding / output rows, the
  vocabulary zero-padded to a TP-divisible size);
- its tensor-parallel axis (`COLUMN` output rows, `ROW` input columns, `REPLICATED`), over the
  tensor-parallel group — or, for an `expert` entry, over the expert tensor-parallel group; an
  expert is also spread whole over expert parallelism.

The functions here take entries and plain numbers (ranks, sizes, layer offsets, expert indices),
never a process group, so every rule is testable on its own:
- names: `parse_name` reads megatron's layer and expert spellings (local `SequentialMLP`
  experts and Transformer Engine's grouped ones); `ChunkLayout` turns a model chunk's local layer
  / expert numbering into the global one (and back); `expert_owner` says which EP rank holds an
  expert;
- reading: `megatron_sources` is every whole tensor of a model by global name; `shard_reads` the
  Hugging Face slices one rank's shard is made of, `fill` where each goes, `expected_hf_shapes`
  what the files must hold;
- reassembling: `merge_shards` makes the whole tensor of every rank's shard (the collective that
  fetches the shards is `hf_writer/gather.py`'s); `shard_of` cuts a rank's shard of a whole one;
- LoRA: `lora_axes` is the TP axis of an adapter's A and B given its base linear's entry.

Layouts (h = hidden, d = head dim, n = query heads, g = KV groups, f = FFN size):
- `linear_qkv.weight` [(n + 2g)·d, h]: for each group, its n/g query heads, then its key head,
  then its value head (bias [(n + 2g)·d] the same way); TP rank r holds groups [r·g/t, (r+1)·g/t).
- `linear_fc1.weight` [2f, h]: gate rows then up rows; TP rank r holds rows [r·f/t, (r+1)·f/t) of
  gate, then the same rows of up.
- embedding / output rows: padded rows are zero on import and dropped on export.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

import torch

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.conversion.deltanet import hybrid_expected_shapes, hybrid_fill, hybrid_reads
from megatron_kto.conversion.stacked import INTERLEAVED_KINDS, WHOLE_READ_KINDS, from_stacked

Kind = Literal[
    "direct",
    "qkv",
    "gated_mlp",
    "vocab",
    "gated_qkv",
    "deltanet_in_proj",
    "deltanet_conv",
    "interleaved_gated",
    "interleaved_gated_t",
    "transposed",
]
#: Hybrid-model kinds (gated attention, gated DeltaNet): layouts and slices in `conversion/deltanet.py`.
HYBRID = ("gated_qkv", "deltanet_in_proj", "deltanet_conv")
#: Kinds with `gated_mlp`'s megatron layout (gate rows then up rows); stacked kinds: `stacked.py`.
GATED_KINDS = ("gated_mlp", *INTERLEAVED_KINDS)
Shape = tuple[int, ...]

#: megatron tensor-parallel axis of a weight: 0 column-parallel (output rows), 1 row-parallel
#: (input columns), None replicated on every TP rank.
COLUMN, ROW, REPLICATED = 0, 1, None

LAYER = "decoder.layers.{layer}.{name}"
HF_LAYER = "model.layers.{layer}.{name}"
#: The two megatron spellings of expert `e`'s parameter `param` (`linear_fc1.weight`) in a layer:
#: local experts (`SequentialMLP`, no Transformer Engine) and TE's grouped experts (`TEGroupedMLP`).
LOCAL_EXPERT = "mlp.experts.local_experts.{e}.{param}"
GROUPED_EXPERT = "mlp.experts.{param}{e}"


def _pattern(template: str, **fields: str) -> re.Pattern[str]:
    """The regular expression of a spelling: each `{field}` a named group of pattern `fields`."""
    pattern = re.escape(template)
    for field, value in fields.items():
        pattern = pattern.replace(re.escape(f"{{{field}}}"), f"(?P<{field}>{value})")
    return re.compile(pattern)


_LAYER = _pattern(LAYER, layer=r"\d+", name=".+")
_LOCAL_EXPERT = _pattern(LOCAL_EXPERT, e=r"\d+", param=".+")
_GROUPED_EXPERT = _pattern(GROUPED_EXPERT, param=r"linear_fc[12]\.weight", e=r"\d+")


# ---------------------------------------------------------------------------------- entries
@dataclass(frozen=True)
class Mapping:
    """One megatron tensor and the Hugging Face tensors it is made of.

    In a family's layer table `megatron` is relative to `decoder.layers.{i}.` and may name
    `{attn_norm}` / `{mlp_norm}` (filled from `norm_names`), and `hf` names are relative to
    `model.layers.{i}.`; `at` gives the global entry, whose names are whole.
    """

    megatron: str
    hf: tuple[str, ...]
    kind: Kind = "direct"
    tp_axis: int | None = REPLICATED
    """Tensor-parallel axis (`COLUMN` / `ROW`), or `REPLICATED`."""
    expert: bool = False
    """A routed expert's tensor: spread over expert parallelism, sharded over expert TP."""

    def at(self, layer: int, norms: dict[str, str]) -> Mapping:
        """This layer entry as the global one of layer `layer` (whole names)."""
        return replace(
            self,
            megatron=LAYER.format(layer=layer, name=self.megatron.format(**norms)),
            hf=tuple(HF_LAYER.format(layer=layer, name=h) for h in self.hf),
        )


LOCAL_NORMS = {"attn_norm": "input_layernorm.weight", "mlp_norm": "pre_mlp_layernorm.weight"}
TE_NORMS = {
    "attn_norm": "self_attention.linear_qkv.layer_norm_weight",
    "mlp_norm": "mlp.linear_fc1.layer_norm_weight",
}
EMBEDDING = Mapping(
    "embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", COLUMN
)
FINAL_NORM = Mapping("decoder.final_layernorm.weight", ("model.norm.weight",))
OUTPUT = Mapping("output_layer.weight", ("lm_head.weight",), "vocab", COLUMN)
#: Hugging Face tensors that carry no weights of ours (conversion and direct loading skip them).
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)
#: Hugging Face tensors by prefix that carry no weights of ours: Qwen3-Next / Qwen3.5
#: multi-token-prediction layers (`families/qwen3_next.py`).
IGNORED_HF_PREFIXES = ("mtp.",)


def norm_names(megatron_names: set[str] | list[str]) -> dict[str, str]:
    """The norm names of a built model: Transformer Engine's fused ones or the local spec's."""
    return (
        TE_NORMS if any(n.endswith(TE_NORMS["attn_norm"]) for n in megatron_names) else LOCAL_NORMS
    )


_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
#: The weights of a layer's four linear layers (every family's attention and dense MLP); the PEFT
#: room reads its per-projection adapters off these entries.
QKV_WEIGHT = Mapping(
    "self_attention.linear_qkv.weight", tuple(f"{p}.weight" for p in _QKV), "qkv", COLUMN
)
PROJ_WEIGHT = Mapping(
    "self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), tp_axis=ROW
)
FC1_WEIGHT = Mapping(
    "mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gated_mlp", COLUMN
)
FC2_WEIGHT = Mapping("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), tp_axis=ROW)
LINEAR_MAPPINGS = (QKV_WEIGHT, PROJ_WEIGHT, FC1_WEIGHT, FC2_WEIGHT)


def attention_mappings(arch: GPTArchitecture) -> tuple[Mapping, ...]:
    """Pre-attention norm, fused QKV (+ bias), per-head Q/K norms and output projection."""
    entries = [Mapping("{attn_norm}", ("input_layernorm.weight",)), QKV_WEIGHT]
    if arch.add_qkv_bias:
        entries.append(
            Mapping(
                "self_attention.linear_qkv.bias", tuple(f"{p}.bias" for p in _QKV), "qkv", COLUMN
            )
        )
    if arch.qk_layernorm:  # one [d] weight shared by every head, so replicated over TP
        entries.append(Mapping("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",)))
        entries.append(Mapping("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",)))
    entries.append(PROJ_WEIGHT)
    return tuple(entries)


def dense_mlp_mappings() -> tuple[Mapping, ...]:
    """Pre-MLP norm and the SwiGLU MLP (`mlp.gate_proj` / `up_proj` / `down_proj`)."""
    return (Mapping("{mlp_norm}", ("post_attention_layernorm.weight",)), FC1_WEIGHT, FC2_WEIGHT)


def expert_name(expert: int, param: str, grouped: bool) -> str:
    """Layer-relative megatron name of expert `expert`'s `param` (`linear_fc1.weight`), in TE's
    grouped spelling or the local one."""
    return (GROUPED_EXPERT if grouped else LOCAL_EXPERT).format(e=expert, param=param)


# ------------------------------------------------------------------------------------ names
@dataclass(frozen=True)
class ParamName:
    """A megatron parameter name, taken apart.

    Attributes:
        rest: the name below its layer (`self_attention.linear_qkv.weight`) — below its expert
            for an expert (`linear_fc1.weight`) — or the whole name outside the layers.
        layer: the layer index (None outside `decoder.layers`).
        expert: the expert index (None: not an expert's).
        grouped: the expert is spelled as Transformer Engine's grouped experts.
    """

    rest: str
    layer: int | None = None
    expert: int | None = None
    grouped: bool = False

    @property
    def in_layer(self) -> str:
        """The name below `decoder.layers.{i}.` (what a family's layer table is keyed by)."""
        if self.expert is None:
            return self.rest
        return expert_name(self.expert, self.rest, self.grouped)

    def __str__(self) -> str:
        if self.layer is None:
            return self.rest
        return LAYER.format(layer=self.layer, name=self.in_layer)

    def renumbered(self, layer: int | None = None, expert: int | None = None) -> ParamName:
        """The same parameter of another layer and / or expert."""
        return replace(
            self,
            layer=self.layer if layer is None else layer,
            expert=self.expert if expert is None else expert,
        )


def parse_name(name: str) -> ParamName:
    """`name` taken apart; `str()` of the result gives `name` back."""
    match = _LAYER.fullmatch(name)
    if match is None:
        return ParamName(name)
    layer, rest = int(match["layer"]), match["name"]
    for pattern, grouped in ((_LOCAL_EXPERT, False), (_GROUPED_EXPERT, True)):
        expert = pattern.fullmatch(rest)
        if expert is not None:
            return ParamName(expert["param"], layer, int(expert["e"]), grouped)
    return ParamName(rest, layer)


@dataclass(frozen=True)
class ChunkLayout:
    """Where a model chunk's local numbering sits in the whole model.

    Attributes:
        layers: the global (0-based) index of each of the chunk's layers, in local order.
        experts: the global index of each of its local experts (empty without experts).
    """

    layers: tuple[int, ...]
    experts: tuple[int, ...] = ()

    @classmethod
    def of(cls, model: Any) -> ChunkLayout:
        """The layout of an unwrapped megatron `GPTModel` chunk, read off its layers
        (`layer_number` is global and 1-based; an MoE layer's `mlp.local_expert_indices`)."""
        layers = model.decoder.layers
        experts: tuple[int, ...] = ()
        for layer in layers:
            indices = getattr(layer.mlp, "local_expert_indices", None)
            if indices is not None:
                experts = tuple(int(i) for i in indices)
                break
        return cls(tuple(layer.layer_number - 1 for layer in layers), experts)

    def to_global(self, name: str) -> ParamName:
        """The global name of a local parameter name of the chunk."""
        local = parse_name(name)
        if local.layer is None:
            return local
        expert = None if local.expert is None else self.experts[local.expert]
        return local.renumbered(self.layers[local.layer], expert)

    def local_layer(self, layer: int) -> int:
        """The chunk's local index of global layer `layer`."""
        return self.layers.index(layer)


def expert_owner(expert: int, num_experts: int, ep_size: int) -> tuple[int, int]:
    """(expert-parallel rank, local index) of global expert `expert`: megatron gives EP rank r
    the contiguous experts [r·E/ep, (r+1)·E/ep)."""
    return divmod(expert, num_experts // ep_size)


# ------------------------------------------------------------------------- the whole model
class LayerTable(Protocol):
    """What addressing needs of a family (`families.Family`): its per-layer table."""

    layer_mappings: Callable[[GPTArchitecture, dict[str, str]], tuple[Mapping, ...]]


def layer_entries(
    family: LayerTable, arch: GPTArchitecture, norms: dict[str, str], layer: int
) -> tuple[Mapping, ...]:
    """The layer table of global layer `layer`: a dense layer of an MoE model
    (`moe_layer_freq`) has the dense MLP's entries, an MoE layer the router and experts."""
    return family.layer_mappings(arch.layer_architecture(layer), norms)


def megatron_sources(
    arch: GPTArchitecture, norms: dict[str, str], family: LayerTable
) -> dict[str, Mapping]:
    """Every whole megatron tensor of the model, by its global (TP=1, EP=1, PP=1) name, as a
    global entry (whole names).

    Covers the output layer even for tied embeddings: with PP > 1 the last stage holds its own
    copy of the embedding as `output_layer.weight`.
    """
    out = {EMBEDDING.megatron: EMBEDDING}
    for i in range(arch.num_layers):
        for entry in layer_entries(family, arch, norms, i):
            placed = entry.at(i, norms)
            out[placed.megatron] = placed
    out[FINAL_NORM.megatron] = FINAL_NORM
    tied = arch.share_embeddings_and_output_weights
    out[OUTPUT.megatron] = replace(OUTPUT, hf=EMBEDDING.hf) if tied else OUTPUT
    return out


# --------------------------------------------------------------------------- rank slices
@dataclass(frozen=True)
class Read:
    """One slice of one Hugging Face tensor: all of it (`axis` None), or [start, stop) along
    `axis` (possibly empty: a rank whose vocabulary rows are all padding)."""

    name: str
    axis: int | None = None
    start: int = 0
    stop: int = 0


def head_layout(arch: GPTArchitecture) -> tuple[int, int, int]:
    """(query heads, query groups, head dim) of an architecture."""
    heads = arch.num_attention_heads
    return heads, arch.num_query_groups or heads, arch.kv_channels or arch.hidden_size // heads


def _sharded(entry: Mapping, size: int) -> bool:
    return entry.tp_axis is not None and size > 1


def expected_hf_shapes(
    entry: Mapping, arch: GPTArchitecture, local_shape: Shape, size: int
) -> tuple[Shape, ...]:
    """The whole Hugging Face tensors' shapes a shard of `local_shape` (one of `size` TP ranks)
    implies — what the weights must hold for the slices to mean what the model needs."""
    if entry.kind in HYBRID:
        return hybrid_expected_shapes(entry.kind, len(entry.hf), arch, tuple(local_shape[1:]))
    full = list(local_shape)
    if _sharded(entry, size):
        full[entry.tp_axis] *= size
    rest = tuple(full[1:])
    if entry.kind in ("interleaved_gated_t", "transposed"):
        return ((full[1], full[0]),)
    if entry.kind == "vocab":
        return ((arch.vocab_size, *rest),)
    if entry.kind == "qkv":
        heads, groups, d = head_layout(arch)
        return ((heads * d, *rest), (groups * d, *rest), (groups * d, *rest))
    if entry.kind == "gated_mlp":
        return tuple((full[0] // 2, *rest) for _ in entry.hf)
    return (tuple(full),)


def shard_reads(
    entry: Mapping, arch: GPTArchitecture, local_shape: Shape, rank: int, size: int
) -> tuple[Read, ...]:
    """The slices TP rank `rank` of `size` reads to make its shard of `local_shape`.

    Args:
        entry: the tensor's global entry (`megatron_sources`).
        arch: the model's architecture.
        local_shape: the rank's parameter shape.
        rank, size: the rank's index in, and the size of, the group that shards the tensor (the
            tensor-parallel group; the expert tensor-parallel group for experts).
    """
    if entry.kind in HYBRID:
        split = size if _sharded(entry, size) else 1
        reads = hybrid_reads(entry.kind, entry.hf, arch, rank if split > 1 else 0, split)
        return tuple(Read(*r) for r in reads)
    if entry.kind == "vocab":  # rows [r·P/t, (r+1)·P/t) of the padded vocabulary, clipped to V
        rows = local_shape[0]
        start = rank * rows if _sharded(entry, size) else 0
        stop = max(start, min(start + rows, arch.vocab_size))
        return (Read(entry.hf[0], 0, start, stop),)
    if not _sharded(entry, size):
        return tuple(Read(name) for name in entry.hf)
    if entry.kind in WHOLE_READ_KINDS:  # one expert's slice, cut by `fill`
        return (Read(entry.hf[0]),)
    axis = entry.tp_axis
    if entry.kind == "qkv":
        heads, groups, d = head_layout(arch)
        mine = groups // size
        q_rows, kv_rows = mine * (heads // groups) * d, mine * d
        q, k, v = entry.hf
        return (
            Read(q, 0, rank * q_rows, (rank + 1) * q_rows),
            Read(k, 0, rank * kv_rows, (rank + 1) * kv_rows),
            Read(v, 0, rank * kv_rows, (rank + 1) * kv_rows),
        )
    # direct: one tensor; gated_mlp: gate and up each give half the local rows
    per_part = local_shape[axis] // len(entry.hf)
    return tuple(Read(name, axis, rank * per_part, (rank + 1) * per_part) for name in entry.hf)


def fill(
    entry: Mapping,
    arch: GPTArchitecture,
    out: torch.Tensor,
    index: int,
    part: torch.Tensor,
    size: int,
    rank: int = 0,
) -> None:
    """Copy slice `index` of `shard_reads` into its place in the rank's shard `out` (cast to
    `out`'s dtype), so the caller holds one slice at a time and no fused copy. A stacked
    expert's slice (`WHOLE_READ_KINDS`) is read whole and rank `rank`'s part of it copied.

    The places are `mappings.fuse_qkv`'s and `fuse_fc1`'s layouts (per query group: its query
    heads, its key head, its value head; gate rows then up rows) and `pad_rows`' zero rows past
    the vocabulary; the tests check `fill` against the whole-tensor conversion.
    """
    if entry.kind == "vocab":
        rows = part.shape[0]
        out[:rows].copy_(part)
        out[rows:].zero_()
    elif entry.kind == "qkv":
        heads, groups, d = head_layout(arch)
        mine = groups // (size if _sharded(entry, size) else 1)
        per = heads // groups
        grouped = out.view(mine, (per + 2) * d, *out.shape[1:])
        lo, hi = ((0, per * d), (per * d, (per + 1) * d), ((per + 1) * d, (per + 2) * d))[index]
        grouped[:, lo:hi].copy_(part.reshape(mine, hi - lo, *out.shape[1:]))
    elif entry.kind in HYBRID:
        hybrid_fill(
            entry.kind, len(entry.hf), arch, out, index, part, size if _sharded(entry, size) else 1
        )
    elif entry.kind == "gated_mlp":
        half = out.shape[0] // 2
        out[index * half : (index + 1) * half].copy_(part)
    elif entry.kind in WHOLE_READ_KINDS:  # the whole expert slice: this rank's part of it
        whole = from_stacked(entry.kind, part)
        out.copy_(
            shard_of(whole, entry.tp_axis, entry.kind, rank, size if _sharded(entry, size) else 1)
        )
    else:
        out.copy_(part)


# ----------------------------------------------------------------------------- reassembly
def merge_shards(
    parts: Sequence[torch.Tensor],
    axis: int | None,
    kind: str,
    sections: Sequence[int] | None = None,
) -> torch.Tensor:
    """The whole tensor of every rank's shard, in rank order (axis None or one part: the part
    itself). A `gated_mlp` shard is [this rank's gate rows; its up rows], so the gate halves are
    concatenated, then the up halves; every other kind concatenates along `axis`."""
    if axis is None or len(parts) == 1:
        return parts[0]
    if sections is not None:  # every rank holds an even share of each section, in order
        local = [n // len(parts) for n in sections]
        pieces = [part.split(local, dim=0) for part in parts]
        return torch.cat([p[i] for i in range(len(local)) for p in pieces], dim=0)
    if kind in GATED_KINDS:
        halves = [part.chunk(2, dim=0) for part in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(list(parts), dim=axis)


def shard_of(
    full: torch.Tensor,
    axis: int | None,
    kind: str,
    rank: int,
    size: int,
    sections: Sequence[int] | None = None,
) -> torch.Tensor:
    """Rank `rank`'s shard (of `size`) of a whole megatron tensor: the inverse of
    `merge_shards` (a contiguous block along `axis`; gate and up each cut for `gated_mlp`)."""
    if axis is None or size == 1:
        return full
    if sections is not None:
        return torch.cat([part.chunk(size, dim=0)[rank] for part in full.split(list(sections))])
    if kind in GATED_KINDS:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]])
    return full.chunk(size, dim=axis)[rank]


# ----------------------------------------------------------------------------------- LoRA
def lora_axes(tp_axis: int | None) -> tuple[int | None, int | None]:
    """TP axes of (lora_A [r, in], lora_B [out, r]) of an adapter beside a base linear sharded
    along `tp_axis`: a column-parallel base has A replicated and B sharded on its outputs; a
    row-parallel base has A sharded on its inputs and B replicated."""
    if tp_axis == COLUMN:
        return REPLICATED, 0
    if tp_axis == ROW:
        return 1, REPLICATED
    return REPLICATED, REPLICATED
