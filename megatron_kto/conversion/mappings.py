"""Whole-tensor conversion, Hugging Face <-> megatron-core: one table drives both directions.

A family's table (`conversion/families/`, entries as `addressing.Mapping`) says which Hugging Face
tensors make one megatron tensor and how (`direct` copy, `qkv` fusion, `gated_mlp` fusion,
`vocab` rows). `to_megatron` / `to_hf` apply it with the pure fuse / split functions here, on
tensors fetched through a callable, so the caller decides how tensors are stored and streamed.
The layouts, the TP axes and the per-rank slices are `addressing`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.conversion.addressing import (
    EMBEDDING,
    FINAL_NORM,
    LOCAL_NORMS,
    OUTPUT,
    Mapping,
    head_layout,
    layer_entries,
)
from megatron_kto.conversion.deltanet import HYBRID_KINDS, hybrid_fuse, hybrid_split
from megatron_kto.conversion.families import Family
from megatron_kto.conversion.registry import get_family
from megatron_kto.conversion.stacked import WHOLE_READ_KINDS, from_stacked, restack, to_stacked

Getter = Callable[[str], torch.Tensor]


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
    if family is None or isinstance(family, str):
        return get_family(family or "llama")
    return family


def _placed(
    arch: GPTArchitecture, norms: dict[str, str], family: Family, layer: int
) -> Iterator[Mapping]:
    """Layer `layer`'s entries with their global (whole) names."""
    for entry in layer_entries(family, arch, norms, layer):
        yield entry.at(layer, norms)


def layer_table(
    arch: GPTArchitecture, norms: dict[str, str] = LOCAL_NORMS, family: str | Family | None = None
) -> dict[str, Mapping]:
    """Every layer's entries keyed by their megatron name (relative to `decoder.layers.{i}.`, norm
    names filled in; dense and MoE layers' together): what a caller gathering tensor-parallel
    shards reads the TP axis and the fusion kind from."""
    fam = _family(family)
    table: dict[str, Mapping] = {}
    kinds = {
        (arch.is_moe_layer(i), arch.is_linear_attention_layer(i)): i for i in range(arch.num_layers)
    }
    one_of_each_kind = kinds.values()
    for layer in one_of_each_kind:
        for entry in layer_entries(fam, arch, norms, layer):
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
    heads, groups, _ = head_layout(arch)
    yield EMBEDDING.megatron, pad_rows(get_hf(EMBEDDING.hf[0]), padded_vocab)
    for i in range(arch.num_layers):
        for entry in _placed(arch, norms, fam, i):
            tensors = [get_hf(h) for h in entry.hf]
            if entry.kind == "qkv":
                value = fuse_qkv(*tensors, heads=heads, groups=groups)
            elif entry.kind == "gated_mlp":
                value = fuse_fc1(*tensors)
            elif entry.kind in HYBRID_KINDS:
                value = hybrid_fuse(entry.kind, tensors, arch)
            elif entry.kind in WHOLE_READ_KINDS:
                value = from_stacked(entry.kind, tensors[0])
            else:
                (value,) = tensors
            yield entry.megatron, value
    yield FINAL_NORM.megatron, get_hf(FINAL_NORM.hf[0])
    if not arch.share_embeddings_and_output_weights:
        yield OUTPUT.megatron, pad_rows(get_hf(OUTPUT.hf[0]), padded_vocab)


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
    # Expert slices (`name#e`, GPT-OSS) leave as their stacked tensors.
    yield from restack(_to_hf(get_megatron, arch, norms, family, layers, embedding, head))


def _to_hf(get_megatron, arch, norms, family, layers, embedding, head):
    fam = _family(family)
    heads, groups, head_dim = head_layout(arch)
    vocab = arch.vocab_size
    if embedding:
        yield EMBEDDING.hf[0], get_megatron(EMBEDDING.megatron)[:vocab]
    for i in range(arch.num_layers) if layers is None else layers:
        for entry in _placed(arch, norms, fam, i):
            value = get_megatron(entry.megatron)
            if entry.kind == "qkv":
                parts = split_qkv(value, heads, groups, head_dim)
            elif entry.kind == "gated_mlp":
                parts = split_fc1(value)
            elif entry.kind in HYBRID_KINDS:
                parts = hybrid_split(entry.kind, value, arch, len(entry.hf))
            elif entry.kind in WHOLE_READ_KINDS:
                parts = (to_stacked(entry.kind, value),)
            else:
                parts = (value,)
            yield from zip(entry.hf, parts, strict=True)
    if head:
        yield FINAL_NORM.hf[0], get_megatron(FINAL_NORM.megatron)
        if not arch.share_embeddings_and_output_weights:
            yield OUTPUT.hf[0], get_megatron(OUTPUT.megatron)[:vocab]
