"""Hugging Face tensors that hold every expert of a layer in one tensor (GPT-OSS), and the MXFP4
form the published GPT-OSS checkpoints store them in.

GPT-OSS keeps a layer's experts stacked: `mlp.experts.gate_up_proj` [E, h, 2f],
`gate_up_proj_bias` [E, 2f], `down_proj` [E, f, h], `down_proj_bias` [E, h]. A family's table
names one expert's slice as `<name>#<e>` (`expert_slice`): the reader reads only that slice
(so a rank reads only its own experts), and `restack` turns a stream of slices back into the
stacked tensors on export.

MXFP4 (the published checkpoints): `<name>_blocks` [E, rows, G, 16] uint8, two FP4 (E2M1) values
per byte, low nibble first, and `<name>_scales` [E, rows, G] uint8, one power-of-two scale per
block of 32 values (E8M0: 2^(s − 127)). Dequantised, expert e's [rows, G·32] matrix transposed is
the [in, out] slice `transformers` computes (`integrations/mxfp4.py`). `dequantize_mxfp4` is that,
written for one expert's slices so a rank dequantises only its experts.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

SEP = "#"
#: Stacked kinds whose one Hugging Face tensor interleaves gate and up (gate at even, up at odd
#: positions of the last axis), megatron's layout being gate rows then up rows:
#: `interleaved_gated` a [2f] bias, `interleaved_gated_t` an [h, 2f] weight (transposed).
INTERLEAVED_KINDS = ("interleaved_gated", "interleaved_gated_t")
#: Kinds read whole (never TP-sliced on read): a rank reads its expert's whole slice.
WHOLE_READ_KINDS = (*INTERLEAVED_KINDS, "transposed")
BLOCKS, SCALES = "_blocks", "_scales"
#: E2M1 values of the 16 nibbles (sign bit 3, two exponent bits, one mantissa bit).
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def expert_slice(name: str, expert: int) -> str:
    """The name of expert `expert`'s slice of the stacked tensor `name`."""
    return f"{name}{SEP}{expert}"


def split_slice(name: str) -> tuple[str, int | None]:
    """(stacked tensor name, expert) of a slice name; (name, None) for a plain name."""
    base, sep, expert = name.rpartition(SEP)
    if not sep or not expert.isdigit():
        return name, None
    return base, int(expert)


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """One expert's MXFP4 weight as the [in, out] matrix `transformers` computes.

    Args:
        blocks: [rows, G, 16] uint8 (two FP4 values a byte, low nibble first).
        scales: [rows, G] uint8 E8M0 exponents (bias 127).
        dtype: the result's dtype (every FP4 value times a power of two is exact in bf16/fp32).

    Returns:
        [G·32, rows]: the dequantised [rows, G·32] matrix, transposed.
    """
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
            "([rows, G, 16] and [rows, G])"
        )
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    blocks = blocks.to(torch.uint8)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)
    values = values.reshape(*blocks.shape[:-1], 32)  # [rows, G, 32], nibbles in order
    exponents = scales.to(torch.int32) - 127
    values = torch.ldexp(values, exponents.unsqueeze(-1).to(torch.float32))
    return values.reshape(blocks.shape[0], -1).t().contiguous().to(dtype)


def mxfp4_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The dequantised stacked shape [E, in, out] of blocks [E, out, G, 16]."""
    experts, rows, groups, _ = blocks_shape
    return (experts, groups * 32, rows)


def restack(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensors` with expert slices (`name#e`) stacked back into their tensors, each yielded once
    all of its slices (0..E−1, in any order) have passed. Plain names pass through.

    Slices are held until their tensor is complete: one layer's experts at most, as a family's
    table lists a layer's entries together.
    """
    pending: dict[str, dict[int, torch.Tensor]] = {}
    order: list[str] = []
    for name, tensor in tensors:
        base, expert = split_slice(name)
        if expert is None:
            yield from _flush(pending, order)
            yield name, tensor
            continue
        if base not in pending:
            pending[base] = {}
            order.append(base)
        pending[base][expert] = tensor
    yield from _flush(pending, order)


def _flush(
    pending: dict[str, dict[int, torch.Tensor]], order: list[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    for base in order:
        parts = pending.pop(base)
        if sorted(parts) != list(range(len(parts))):
            raise ValueError(f"{base}: expert slices {sorted(parts)} are not 0..{len(parts) - 1}")
        yield base, torch.stack([parts[e] for e in range(len(parts))])
    order.clear()


def from_stacked(kind: str, hf: torch.Tensor) -> torch.Tensor:
    """The megatron tensor of one expert's slice of a stacked Hugging Face tensor (GPT-OSS):
    `interleaved_gated_t` [h, 2f] -> fc1 [2f, h] (gate rows, then up rows), `interleaved_gated`
    [2f] -> [2f] the same way, `transposed` [f, h] -> fc2 [h, f]."""
    if kind == "transposed":
        return hf.t()
    if kind == "interleaved_gated_t":
        return torch.cat([hf[:, 0::2].t(), hf[:, 1::2].t()], dim=0)
    if kind == "interleaved_gated":
        return torch.cat([hf[0::2], hf[1::2]])
    raise ValueError(f"not a stacked-expert kind: {kind}")


def to_stacked(kind: str, megatron: torch.Tensor) -> torch.Tensor:
    """Inverse of `from_stacked`."""
    if kind == "transposed":
        return megatron.t().contiguous()
    gate, up = megatron.chunk(2, dim=0)
    if kind == "interleaved_gated_t":
        gate, up = gate.t(), up.t()
    out = gate.new_empty(*gate.shape[:-1], 2 * gate.shape[-1])
    out[..., 0::2] = gate
    out[..., 1::2] = up
    return out
