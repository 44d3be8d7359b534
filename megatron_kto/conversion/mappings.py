"""The Hugging Face <-> megatron-core tensor map, as data: one table drives both directions.

A family (`conversion/families/`) lists, per transformer layer, `Mapping` entries: which Hugging
Face tensors make one megatron tensor, how (`direct` copy, `qkv` fusion, `gated_mlp` fusion) and
along which axis megatron shards it over tensor parallelism. `to_megatron` / `to_hf` apply a
family's table with pure functions on tensors fetched through a callable, so the caller decides
how tensors are stored and streamed.

Megatron names differ between the local layer spec and Transformer Engine's (TE fuses the
pre-attention / pre-MLP norms into `linear_qkv` / `linear_fc1`); `norm_names` picks the pair a
built model uses.

Layouts (h = hidden, d = head dim, n = query heads, g = KV groups, f = FFN size):
- `linear_qkv.weight` [(n + 2g)·d, h]: for each group, its n/g query heads, then its key head,
  then its value head (bias [(n + 2g)·d] the same way) — Hugging Face keeps q, k, v separate.
- `linear_fc1.weight` [2f, h]: gate rows then up rows (SwiGLU), for the dense MLP and each expert.
- embedding / output rows: the vocabulary padded to a TP-divisible size; padded rows are zero on
  import and dropped on export.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from megatron_kto.models.architecture import GPTArchitecture

if TYPE_CHECKING:
    from megatron_kto.conversion.registry import Family

Getter = Callable[[str], torch.Tensor]
Kind = Literal["direct", "qkv", "gated_mlp"]

#: megatron tensor-parallel axis of a weight: 0 column-parallel (output rows), 1 row-parallel
#: (input columns), None replicated on every TP rank.
COLUMN, ROW, REPLICATED = 0, 1, None


@dataclass(frozen=True)
class Mapping:
    """One megatron tensor of a layer and the Hugging Face tensors it is made of.

    `megatron` is relative to `decoder.layers.{i}.` and may name `{attn_norm}` / `{mlp_norm}`
    (filled from `norm_names`); `hf` names are relative to `model.layers.{i}.`.
    """

    megatron: str
    hf: tuple[str, ...]
    kind: Kind = "direct"
    tp_axis: int | None = REPLICATED


LOCAL_NORMS = {"attn_norm": "input_layernorm.weight", "mlp_norm": "pre_mlp_layernorm.weight"}
TE_NORMS = {
    "attn_norm": "self_attention.linear_qkv.layer_norm_weight",
    "mlp_norm": "mlp.linear_fc1.layer_norm_weight",
}
EMBEDDING = ("embedding.word_embeddings.weight", "model.embed_tokens.weight")
FINAL_NORM = ("decoder.final_layernorm.weight", "model.norm.weight")
OUTPUT = ("output_layer.weight", "lm_head.weight")


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


def _shape(arch: GPTArchitecture) -> tuple[int, int, int]:
    heads = arch.num_attention_heads
    return heads, arch.num_query_groups or heads, arch.kv_channels or arch.hidden_size // heads


def fuse_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int
) -> torch.Tensor:
    """Interleave separate q [n·d, ...], k [g·d, ...], v [g·d, ...] into megatron's per-group layout."""
    d = k.shape[0] // groups
    rest = q.shape[1:]
    per = heads // groups
    q = q.reshape(groups, per * d, *rest)
    k = k.reshape(groups, d, *rest)
    v = v.reshape(groups, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape((heads + 2 * groups) * d, *rest)


def split_qkv(
    qkv: torch.Tensor, heads: int, groups: int, head_dim: int
) -> tuple[torch.Tensor, ...]:
    """Inverse of `fuse_qkv`: (q, k, v)."""
    per = heads // groups
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, (per + 2) * head_dim, *rest)
    q, k, v = grouped.split([per * head_dim, head_dim, head_dim], dim=1)
    return (
        q.reshape(heads * head_dim, *rest),
        k.reshape(groups * head_dim, *rest),
        v.reshape(groups * head_dim, *rest),
    )


def fuse_fc1(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU fc1: gate rows then up rows."""
    return torch.cat([gate, up], dim=0)


def split_fc1(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_fc1`: (gate, up)."""
    return tuple(fc1.chunk(2, dim=0))  # type: ignore[return-value]


def pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """Vocabulary rows zero-padded to `rows`."""
    if weight.shape[0] > rows:
        raise ValueError(f"{weight.shape[0]} vocabulary rows do not fit in {rows}")
    out = weight.new_zeros(rows, *weight.shape[1:])
    out[: weight.shape[0]] = weight
    return out


def _family(family: str | Family | None) -> Family:
    from megatron_kto.conversion.registry import get_family

    if family is None or isinstance(family, str):
        return get_family(family or "llama")
    return family


def layer_mappings_at(
    family: Family, arch: GPTArchitecture, norms: dict[str, str], layer: int
) -> tuple[Mapping, ...]:
    """The table of layer `layer` (global index): a dense layer of an MoE model
    (`moe_layer_freq`) has the dense MLP's entries, an MoE layer the router and experts."""
    return family.layer_mappings(arch.layer_architecture(layer), norms)


def _layer_entries(
    arch: GPTArchitecture, norms: dict[str, str], family: Family, layer: int
) -> Iterator[tuple[str, tuple[str, ...], Kind]]:
    for entry in layer_mappings_at(family, arch, norms, layer):
        yield entry.megatron.format(**norms), entry.hf, entry.kind


def layer_table(
    arch: GPTArchitecture, norms: dict[str, str] = LOCAL_NORMS, family: str | Family | None = None
) -> dict[str, Mapping]:
    """Every layer's entries keyed by their megatron name (relative to `decoder.layers.{i}.`, norm
    names filled in; dense and MoE layers' together): what a caller gathering tensor-parallel
    shards reads the TP axis and the fusion kind from."""
    fam = _family(family)
    table: dict[str, Mapping] = {}
    one_of_each_kind = {arch.is_moe_layer(i): i for i in range(arch.num_layers)}.values()
    for layer in one_of_each_kind:
        for entry in layer_mappings_at(fam, arch, norms, layer):
            table.setdefault(entry.megatron.format(**norms), entry)
    return table


def to_megatron(
    get_hf: Getter,
    arch: GPTArchitecture,
    padded_vocab: int,
    norms: dict[str, str] = LOCAL_NORMS,
    family: str | Family | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Megatron (TP=1, EP=1) tensors from Hugging Face ones, one at a time.

    Args:
        get_hf: returns the Hugging Face tensor of a name (raises KeyError if absent).
        arch: the model's architecture.
        padded_vocab: embedding rows of the megatron model.
        norms: `norm_names(...)` of the target model.
        family: the model family (a registered HF model type or a `Family`); None means llama.
    """
    fam = _family(family)
    heads, groups, _ = _shape(arch)
    yield EMBEDDING[0], pad_rows(get_hf(EMBEDDING[1]), padded_vocab)
    for i in range(arch.num_layers):
        for mname, hnames, kind in _layer_entries(arch, norms, fam, i):
            tensors = [get_hf(f"model.layers.{i}.{h}") for h in hnames]
            if kind == "qkv":
                value = fuse_qkv(*tensors, heads=heads, groups=groups)
            elif kind == "gated_mlp":
                value = fuse_fc1(*tensors)
            else:
                (value,) = tensors
            yield f"decoder.layers.{i}.{mname}", value
    yield FINAL_NORM[0], get_hf(FINAL_NORM[1])
    if not arch.share_embeddings_and_output_weights:
        yield OUTPUT[0], pad_rows(get_hf(OUTPUT[1]), padded_vocab)


def to_hf(
    get_megatron: Getter,
    arch: GPTArchitecture,
    norms: dict[str, str] = LOCAL_NORMS,
    family: str | Family | None = None,
    layers: Iterable[int] | None = None,
    embedding: bool = True,
    head: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face tensors from megatron (TP=1, EP=1) ones, one at a time; the inverse of
    `to_megatron` for the same family.

    Args:
        layers, embedding, head: the part of the model to convert — by default all of it; a
            pipeline stage passes its own layers (global indices) and whether it holds the
            embedding and the head (final norm, output layer).
    """
    fam = _family(family)
    heads, groups, head_dim = _shape(arch)
    vocab = arch.vocab_size
    if embedding:
        yield EMBEDDING[1], get_megatron(EMBEDDING[0])[:vocab]
    for i in range(arch.num_layers) if layers is None else layers:
        for mname, hnames, kind in _layer_entries(arch, norms, fam, i):
            value = get_megatron(f"decoder.layers.{i}.{mname}")
            if kind == "qkv":
                parts = split_qkv(value, heads, groups, head_dim)
            elif kind == "gated_mlp":
                parts = split_fc1(value)
            else:
                parts = (value,)
            for h, part in zip(hnames, parts, strict=True):
                yield f"model.layers.{i}.{h}", part
    if head:
        yield FINAL_NORM[1], get_megatron(FINAL_NORM[0])
        if not arch.share_embeddings_and_output_weights:
            yield OUTPUT[1], get_megatron(OUTPUT[0])[:vocab]
