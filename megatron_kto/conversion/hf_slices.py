"""Which slices of which Hugging Face tensors make one rank's shard of a megatron tensor.

The family tables (`mappings`, `moe`, `families/`) say how whole Hugging Face tensors make a whole
(TP=1, EP=1) megatron tensor. A rank under tensor parallelism holds one shard of it, and that
shard is made of *slices* of the same Hugging Face tensors:

- column-parallel `direct` weights (and the embedding / output rows): rows
  [r·n/t, (r+1)·n/t) — for the vocabulary, of the padded rows, the part past the real vocabulary
  being zeros;
- row-parallel weights: columns [r·n/t, (r+1)·n/t);
- the fused QKV (`qkv`): megatron's per-group layout makes TP rank r hold query groups
  [r·g/t, (r+1)·g/t) — the matching rows of q_proj (n/g heads per group), k_proj and v_proj,
  fused the same way;
- the fused SwiGLU fc1 (`gated_mlp`): megatron shards gate and up separately, so rank r holds
  rows [r·f/t, (r+1)·f/t) of gate_proj, then the same rows of up_proj;
- replicated tensors (norms, routers): the whole tensor.

Pipeline and expert parallelism need no slicing: a stage holds whole layers, an EP rank whole
experts; the caller names the global layer / expert (`megatron_sources` is keyed by global names).

Everything here is pure (names, shapes and index arithmetic; `fill` puts each slice where the
whole-tensor conversion's `fuse_qkv` / `fuse_fc1` / `pad_rows` put its rows), so the reader decides
how tensors are read — `checkpointing/hf_source.py` reads the slices lazily from the safetensors
files, one at a time, straight into the parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megatron_kto.conversion.mappings import (
    COLUMN,
    EMBEDDING,
    FINAL_NORM,
    OUTPUT,
    REPLICATED,
    Kind,
    layer_mappings_at,
)
from megatron_kto.models.architecture import GPTArchitecture

if TYPE_CHECKING:
    from megatron_kto.conversion.registry import Family

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Source:
    """The Hugging Face tensors one whole megatron tensor is made of, and how."""

    hf: tuple[str, ...]
    """Full Hugging Face names (`model.layers.3.self_attn.q_proj.weight`, ...)."""
    kind: Kind = "direct"
    tp_axis: int | None = REPLICATED
    """Megatron's tensor-parallel axis of the tensor (see `mappings.COLUMN` / `ROW`)."""
    vocab_rows: bool = False
    """Embedding / output weight: the vocabulary rows padded with zeros."""


@dataclass(frozen=True)
class Read:
    """One slice of one Hugging Face tensor: all of it (`axis` None), or [start, stop) along
    `axis` (possibly empty: a rank whose vocabulary rows are all padding)."""

    name: str
    axis: int | None = None
    start: int = 0
    stop: int = 0


def megatron_sources(
    arch: GPTArchitecture, norms: dict[str, str], family: Family
) -> dict[str, Source]:
    """Every whole megatron tensor of the model, by its global (TP=1, EP=1, PP=1) name.

    Covers the output layer even for tied embeddings: with PP > 1 the last stage holds its own
    copy of the embedding as `output_layer.weight`.
    """
    out = {EMBEDDING[0]: Source((EMBEDDING[1],), "direct", COLUMN, vocab_rows=True)}
    for i in range(arch.num_layers):
        for entry in layer_mappings_at(family, arch, norms, i):
            name = f"decoder.layers.{i}.{entry.megatron.format(**norms)}"
            hf = tuple(f"model.layers.{i}.{h}" for h in entry.hf)
            out[name] = Source(hf, entry.kind, entry.tp_axis)
    out[FINAL_NORM[0]] = Source((FINAL_NORM[1],))
    tied = arch.share_embeddings_and_output_weights
    out[OUTPUT[0]] = Source((EMBEDDING[1] if tied else OUTPUT[1],), "direct", COLUMN, True)
    return out


def _heads(arch: GPTArchitecture) -> tuple[int, int, int]:
    heads = arch.num_attention_heads
    return heads, arch.num_query_groups or heads, arch.kv_channels or arch.hidden_size // heads


def _sharded(source: Source, size: int) -> bool:
    return source.tp_axis is not None and size > 1


def expected_hf_shapes(
    source: Source, arch: GPTArchitecture, local_shape: Shape, size: int
) -> tuple[Shape, ...]:
    """The whole Hugging Face tensors' shapes a shard of `local_shape` (one of `size` TP ranks)
    implies — what the weights must hold for the slices to mean what the model needs."""
    full = list(local_shape)
    if _sharded(source, size):
        full[source.tp_axis] *= size
    rest = tuple(full[1:])
    if source.vocab_rows:
        return ((arch.vocab_size, *rest),)
    if source.kind == "qkv":
        heads, groups, d = _heads(arch)
        return ((heads * d, *rest), (groups * d, *rest), (groups * d, *rest))
    if source.kind == "gated_mlp":
        return tuple((full[0] // 2, *rest) for _ in source.hf)
    return (tuple(full),)


def shard_reads(
    source: Source, arch: GPTArchitecture, local_shape: Shape, rank: int, size: int
) -> tuple[Read, ...]:
    """The slices TP rank `rank` of `size` reads to make its shard of `local_shape`.

    Args:
        source: the tensor's entry of `megatron_sources`.
        arch: the model's architecture.
        local_shape: the rank's parameter shape.
        rank, size: the rank's index in, and the size of, the group that shards the tensor (the
            tensor-parallel group; the expert tensor-parallel group for experts).
    """
    if source.vocab_rows:  # rows [r·P/t, (r+1)·P/t) of the padded vocabulary, clipped to V
        rows = local_shape[0]
        start = rank * rows if _sharded(source, size) else 0
        stop = max(start, min(start + rows, arch.vocab_size))
        return (Read(source.hf[0], 0, start, stop),)
    if not _sharded(source, size):
        return tuple(Read(name) for name in source.hf)
    axis = source.tp_axis
    if source.kind == "qkv":
        heads, groups, d = _heads(arch)
        mine = groups // size
        q_rows, kv_rows = mine * (heads // groups) * d, mine * d
        q, k, v = source.hf
        return (
            Read(q, 0, rank * q_rows, (rank + 1) * q_rows),
            Read(k, 0, rank * kv_rows, (rank + 1) * kv_rows),
            Read(v, 0, rank * kv_rows, (rank + 1) * kv_rows),
        )
    # direct: one tensor; gated_mlp: gate and up each give half the local rows
    per_part = local_shape[axis] // len(source.hf)
    return tuple(Read(name, axis, rank * per_part, (rank + 1) * per_part) for name in source.hf)


def fill(
    source: Source,
    arch: GPTArchitecture,
    out: torch.Tensor,
    index: int,
    part: torch.Tensor,
    size: int,
) -> None:
    """Copy slice `index` of `shard_reads` into its place in the rank's shard `out` (cast to
    `out`'s dtype), so the caller holds one slice at a time and no fused copy.

    The places are `fuse_qkv`'s and `fuse_fc1`'s layouts (per query group: its query heads, its
    key head, its value head; gate rows then up rows) and `pad_rows`' zero rows past the
    vocabulary; the tests check `fill` against the whole-tensor conversion.
    """
    if source.vocab_rows:
        rows = part.shape[0]
        out[:rows].copy_(part)
        out[rows:].zero_()
    elif source.kind == "qkv":
        heads, groups, d = _heads(arch)
        mine = groups // (size if _sharded(source, size) else 1)
        per = heads // groups
        grouped = out.view(mine, (per + 2) * d, *out.shape[1:])
        lo, hi = ((0, per * d), (per * d, (per + 1) * d), ((per + 1) * d, (per + 2) * d))[index]
        grouped[:, lo:hi].copy_(part.reshape(mine, hi - lo, *out.shape[1:]))
    elif source.kind == "gated_mlp":
        half = out.shape[0] // 2
        out[index * half : (index + 1) * half].copy_(part)
    else:
        out.copy_(part)
