"""Pure reorderings between Hugging Face's gated DeltaNet projections and megatron-core's.

Hugging Face Qwen3-Next keeps two input projections grouped by key head —
`in_proj_qkvz` rows per key head [q (dk) | k (dk) | v (r·dv) | z (r·dv)] and `in_proj_ba` rows
per key head [b (r) | a (r)], with r = value heads per key head. Qwen3.5 keeps four plain
projections, `in_proj_qkv` [q (all) | k (all) | v (all)], `in_proj_z`, `in_proj_b`, `in_proj_a`.
megatron-core's `GatedDeltaNet.in_proj` is one column-parallel linear whose rows on every TP rank
are [q | k | v | z | beta | alpha] of that rank's heads (so the global tensor is those blocks,
rank after rank), and its `conv1d` channels on a rank are [q | k | v] of its heads — the order
of HF's conv channels on one rank.

All functions here work on one TP rank's slice: `rank` of `tp` (key heads, and the value heads
they serve, are split evenly, as megatron requires).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_kto.config.architecture import GPTArchitecture


@dataclass(frozen=True)
class DeltaNetShape:
    """Head counts and sizes of one gated DeltaNet layer."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int

    @property
    def group(self) -> int:
        """Value heads per key head."""
        return self.value_heads // self.key_heads

    def check_tp(self, tp: int) -> None:
        if self.key_heads % tp or self.value_heads % tp:
            raise ValueError(
                f"linear_num_key_heads {self.key_heads} and linear_num_value_heads "
                f"{self.value_heads} must both divide by model.tensor_model_parallel_size {tp}"
            )


def split_hf_qkvz_ba(
    qkvz: torch.Tensor, ba: torch.Tensor, shape: DeltaNetShape
) -> dict[str, torch.Tensor]:
    """Qwen3-Next's grouped `in_proj_qkvz` / `in_proj_ba` weights as plain per-part tensors,
    each head-major over all heads: q, k [Hk·dk, h], v, z [Hv·dv, h], b, a [Hv, h]."""
    h = qkvz.shape[-1]
    r, dk, dv = shape.group, shape.key_dim, shape.value_dim
    grouped = qkvz.reshape(shape.key_heads, 2 * dk + 2 * r * dv, h)
    q, k, v, z = grouped.split([dk, dk, r * dv, r * dv], dim=1)
    b, a = ba.reshape(shape.key_heads, 2 * r, h).split([r, r], dim=1)
    return {n: t.reshape(-1, h) for n, t in dict(q=q, k=k, v=v, z=z, b=b, a=a).items()}


def join_hf_qkvz_ba(
    parts: dict[str, torch.Tensor], shape: DeltaNetShape
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `split_hf_qkvz_ba`."""
    hk = shape.key_heads
    h = parts["q"].shape[-1]
    qkvz = torch.cat([parts[n].reshape(hk, -1, h) for n in "qkvz"], dim=1).reshape(-1, h)
    ba = torch.cat([parts[n].reshape(hk, -1, h) for n in "ba"], dim=1).reshape(-1, h)
    return qkvz, ba


def _head_rows(part: str, shape: DeltaNetShape) -> int:
    """Rows per head of a part (q, k: dk; v, z: dv; b, a: 1)."""
    return {"q": shape.key_dim, "k": shape.key_dim, "v": shape.value_dim, "z": shape.value_dim}.get(
        part, 1
    )


def _rank_rows(
    t: torch.Tensor, part: str, shape: DeltaNetShape, rank: int, tp: int
) -> torch.Tensor:
    per_rank = t.shape[0] // tp
    return t[rank * per_rank : (rank + 1) * per_rank]


def megatron_in_proj(
    parts: dict[str, torch.Tensor], shape: DeltaNetShape, rank: int, tp: int
) -> torch.Tensor:
    """This rank's `in_proj.weight`: [q | k | v | z | beta | alpha] of its heads."""
    shape.check_tp(tp)
    return torch.cat([_rank_rows(parts[n], n, shape, rank, tp) for n in "qkvzba"], dim=0)


def megatron_conv(conv: torch.Tensor, shape: DeltaNetShape, rank: int, tp: int) -> torch.Tensor:
    """This rank's `conv1d.weight` (or bias) from HF's [q | k | v] channels of all heads."""
    shape.check_tp(tp)
    qk = shape.key_heads * shape.key_dim
    q, k, v = conv.split([qk, qk, shape.value_heads * shape.value_dim], dim=0)
    return torch.cat([_rank_rows(t, "", shape, rank, tp) for t in (q, k, v)], dim=0)


def parts_from_megatron_in_proj(
    ranks: list[torch.Tensor], shape: DeltaNetShape
) -> dict[str, torch.Tensor]:
    """Inverse of `megatron_in_proj` over all ranks' slices (rank order)."""
    tp = len(ranks)
    sizes = [
        _head_rows(n, shape) * (shape.key_heads if n in "qk" else shape.value_heads) // tp
        for n in "qkvzba"
    ]
    pieces = [r.split(sizes, dim=0) for r in ranks]
    return {n: torch.cat([p[i] for p in pieces], dim=0) for i, n in enumerate("qkvzba")}


def conv_from_megatron(ranks: list[torch.Tensor], shape: DeltaNetShape) -> torch.Tensor:
    """Inverse of `megatron_conv` over all ranks' slices (rank order)."""
    tp = len(ranks)
    qk = shape.key_heads * shape.key_dim // tp
    sizes = [qk, qk, shape.value_heads * shape.value_dim // tp]
    pieces = [r.split(sizes, dim=0) for r in ranks]
    return torch.cat([torch.cat([p[i] for p in pieces], dim=0) for i in range(3)], dim=0)


# --------------------------------------------------------------- gated full attention
def fuse_gated_qkv(
    q_gate: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int
) -> torch.Tensor:
    """Megatron's `linear_qkv` with `attention_output_gate` from HF's gated attention.

    HF `q_proj` rows are per query head [query (d) | gate (d)]; megatron's rows are per query
    group [its queries (n/g·d) | their gates (n/g·d) | key (d) | value (d)].
    """
    d = k.shape[0] // groups
    per = heads // groups
    rest = q_gate.shape[1:]
    pairs = q_gate.reshape(groups, per, 2, d, *rest)
    query = pairs[:, :, 0].reshape(groups, per * d, *rest)
    gate = pairs[:, :, 1].reshape(groups, per * d, *rest)
    fused = torch.cat([query, gate, k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)], 1)
    return fused.reshape(-1, *rest)


def split_gated_qkv(
    qkv: torch.Tensor, heads: int, groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_gated_qkv`: (q_proj, k_proj, v_proj) in HF's layout."""
    per, d = heads // groups, head_dim
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, 2 * per * d + 2 * d, *rest)
    query, gate, k, v = grouped.split([per * d, per * d, d, d], dim=1)
    pairs = torch.stack(
        [query.reshape(groups, per, d, *rest), gate.reshape(groups, per, d, *rest)], dim=2
    )
    return pairs.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


# ------------------------------------------------------------- whole-tensor conversion
#: Fusion kinds of hybrid models (`addressing.Mapping.kind`); each is whole-tensor only for now:
#: per-rank slicing (direct HF load, gathers of the HF writer at TP > 1) refuses them.
HYBRID_KINDS = ("gated_qkv", "deltanet_in_proj", "deltanet_conv")


def shape_of(arch: GPTArchitecture) -> DeltaNetShape:
    """The DeltaNet head layout of an architecture."""
    return DeltaNetShape(
        arch.linear_num_key_heads,
        arch.linear_num_value_heads,
        arch.linear_key_head_dim,
        arch.linear_value_head_dim,
    )


def _heads(arch: GPTArchitecture) -> tuple[int, int, int]:
    heads = arch.num_attention_heads
    return heads, arch.num_query_groups or heads, arch.kv_channels or arch.hidden_size // heads


def hybrid_fuse(kind: str, tensors: list[torch.Tensor], arch: GPTArchitecture) -> torch.Tensor:
    """The whole (TP=1) megatron tensor of a hybrid kind from its HF tensors (entry order).

    `deltanet_in_proj` takes Qwen3-Next's (in_proj_qkvz, in_proj_ba) or Qwen3.5's
    (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)."""
    if kind == "gated_qkv":
        heads, groups, _ = _heads(arch)
        return fuse_gated_qkv(*tensors, heads=heads, groups=groups)
    if kind == "deltanet_conv":
        (conv,) = tensors  # HF's [q | k | v] channels are megatron's at TP=1
        return conv
    shape = shape_of(arch)
    if len(tensors) == 2:
        parts = split_hf_qkvz_ba(*tensors, shape)
    else:
        qkv, z, b, a = tensors
        qk = shape.key_heads * shape.key_dim
        q, k, v = qkv.split([qk, qk, shape.value_heads * shape.value_dim], dim=0)
        parts = dict(q=q, k=k, v=v, z=z, b=b, a=a)
    return megatron_in_proj(parts, shape, 0, 1)


def hybrid_split(
    kind: str, value: torch.Tensor, arch: GPTArchitecture, count: int
) -> tuple[torch.Tensor, ...]:
    """Inverse of `hybrid_fuse`: the `count` HF tensors of a whole megatron tensor."""
    if kind == "gated_qkv":
        return split_gated_qkv(value, *_heads(arch))
    if kind == "deltanet_conv":
        return (value,)
    shape = shape_of(arch)
    parts = parts_from_megatron_in_proj([value], shape)
    if count == 2:
        return join_hf_qkvz_ba(parts, shape)
    return torch.cat([parts["q"], parts["k"], parts["v"]]), parts["z"], parts["b"], parts["a"]


# ------------------------------------------------------------------- per-rank slices
# One TP rank's shard of a hybrid tensor, read straight from the HF tensors (direct loading) and
# reassembled from all ranks' shards (the HF writer's gathers). A rank holds the contiguous query
# groups (`gated_qkv`) or key heads, with the value heads they serve (`deltanet_*`).


def _local_sections(kind: str, arch: GPTArchitecture, size: int) -> list[int]:
    s = shape_of(arch)
    qk, v, hv = (
        s.key_heads * s.key_dim // size,
        s.value_heads * s.value_dim // size,
        s.value_heads // size,
    )
    return [qk, qk, v] if kind == "deltanet_conv" else [qk, qk, v, v, hv, hv]


def tp_sections(kind: str, arch: GPTArchitecture) -> list[int] | None:
    """Sections (along dim 0) of a whole megatron tensor that every TP rank holds an even share
    of, in order ([q | k | v | z | beta | alpha], [q | k | v]); None when a rank's shard is one
    contiguous block of the whole tensor (`gated_qkv`: whole query groups)."""
    if kind in ("deltanet_in_proj", "deltanet_conv"):
        return _local_sections(kind, arch, 1)
    return None


def hybrid_expected_shapes(
    kind: str, count: int, arch: GPTArchitecture, rest: tuple[int, ...]
) -> tuple[tuple[int, ...], ...]:
    """Shapes of the whole HF tensors of a hybrid entry (`rest`: trailing dims of the shard)."""
    if kind == "gated_qkv":
        heads, groups, d = _heads(arch)
        return ((heads * 2 * d, *rest), (groups * d, *rest), (groups * d, *rest))
    s = shape_of(arch)
    qk, v = s.key_heads * s.key_dim, s.value_heads * s.value_dim
    if kind == "deltanet_conv":
        return ((2 * qk + v, *rest),)
    if count == 2:
        return ((2 * qk + 2 * v, *rest), (2 * s.value_heads, *rest))
    return ((2 * qk + v, *rest), (v, *rest), (s.value_heads, *rest), (s.value_heads, *rest))


def hybrid_reads(
    kind: str, names: tuple[str, ...], arch: GPTArchitecture, rank: int, size: int
) -> list[tuple[str, int, int, int]]:
    """(HF name, axis, start, stop) of every slice rank `rank` of `size` reads, in fill order."""

    def rows(name: str, per_rank: int, offset: int = 0) -> tuple[str, int, int, int]:
        return (name, 0, offset + rank * per_rank, offset + (rank + 1) * per_rank)

    if kind == "gated_qkv":
        heads, groups, d = _heads(arch)
        mine = groups // size
        q, k, v = names
        return [rows(q, mine * (heads // groups) * 2 * d), rows(k, mine * d), rows(v, mine * d)]
    s = shape_of(arch)
    s.check_tp(size)
    qk, v = s.key_heads * s.key_dim, s.value_heads * s.value_dim
    qk_m, v_m, hv_m, hk_m = qk // size, v // size, s.value_heads // size, s.key_heads // size
    if kind == "deltanet_conv":
        (conv,) = names
        return [rows(conv, qk_m), rows(conv, qk_m, qk), rows(conv, v_m, 2 * qk)]
    if len(names) == 2:
        qkvz, ba = names
        return [rows(qkvz, hk_m * (2 * s.key_dim + 2 * s.group * s.value_dim)), rows(ba, 2 * hv_m)]
    qkv, z, b, a = names
    return [
        rows(qkv, qk_m),
        rows(qkv, qk_m, qk),
        rows(qkv, v_m, 2 * qk),
        rows(z, v_m),
        rows(b, hv_m),
        rows(a, hv_m),
    ]


def hybrid_fill(
    kind: str,
    count: int,
    arch: GPTArchitecture,
    out: torch.Tensor,
    index: int,
    part: torch.Tensor,
    size: int,
) -> None:
    """Copy slice `index` of `hybrid_reads` into its place in the rank's shard `out`."""
    rest = out.shape[1:]
    if kind == "gated_qkv":
        heads, groups, d = _heads(arch)
        mine, per = groups // size, heads // groups
        grouped = out.view(mine, (2 * per + 2) * d, *rest)
        if index == 0:
            pairs = part.reshape(mine, per, 2, d, *rest)
            grouped[:, : per * d].copy_(pairs[:, :, 0].reshape(mine, per * d, *rest))
            grouped[:, per * d : 2 * per * d].copy_(pairs[:, :, 1].reshape(mine, per * d, *rest))
        else:
            start = (2 * per + index - 1) * d
            grouped[:, start : start + d].copy_(part.reshape(mine, d, *rest))
        return
    sections = list(out.split(_local_sections(kind, arch, size), dim=0))
    if kind == "deltanet_conv" or count == 4:
        sections[index].copy_(part)
        return
    s = shape_of(arch)
    hk_m = s.key_heads // size
    if index == 0:
        grouped = part.reshape(hk_m, -1, *rest)
        widths = [s.key_dim, s.key_dim, s.group * s.value_dim, s.group * s.value_dim]
        for target, piece in zip(sections[:4], grouped.split(widths, dim=1)):
            target.copy_(piece.reshape(-1, *rest))
    else:
        b, a = part.reshape(hk_m, 2, s.group, *rest).unbind(1)
        sections[4].copy_(b.reshape(-1, *rest))
        sections[5].copy_(a.reshape(-1, *rest))
