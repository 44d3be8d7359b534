"""FP8 block-scaled checkpoints, as DeepSeek-V3/R1, Kimi-K2 and Qwen3 "-FP8" publish them, and the
`quantization_config` of a config.json.

A quantised linear weight `<name>` [rows, cols] is stored as float8_e4m3fn next to
`<name>_scale_inv` [⌈rows/bm⌉, ⌈cols/bn⌉] fp32 — one scale per bm×bn block of the weight
(`quantization_config.weight_block_size` [bm, bn], [128, 128] in every published checkpoint),
the blocks at the bottom and right edge partial when a side is not a multiple of the block. The
value is `float32(weight[i, j]) * scale_inv[i // bm, j // bn]`, computed in fp32 and then cast to
the model's dtype — what `transformers` computes when it loads such a checkpoint without an
accelerator (`integrations/finegrained_fp8.py`: `Fp8Dequantize`, and for partial edge blocks the
block-indexed `_dequantize_fp8_weight`, as DeepSeek's own `weight_dequant`). `dequantize_fp8`
computes it for any rectangle of the weight, so a rank reads and dequantises only its
tensor-parallel slice (and its experts).

`transformers` 5.24's load path derives the block from the scale grid (rows // grid rows) instead
of reading `weight_block_size`: for a side that is not a multiple of the block and spans more
than one block it raises (DeepSeek-V3's `kv_a_proj_with_mqa` [576, 7168]: 576 rows, 5 scale
rows) or uses other blocks ([200, ·] with 2 scale rows: blocks of 100). We follow the format.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_kto.conversion.errors import ConversionError

SCALE_INV = "_scale_inv"
#: safetensors' header names of the stored dtypes: the fp8 weights read, and their scales.
FP8_E4M3 = "F8_E4M3"
SCALE_DTYPES = ("F32", "BF16", "F16")
#: quant_method values read: block-scaled fp8 here, MXFP4 experts in `stacked.py`.
READ_METHODS = ("fp8", "mxfp4")


def fp8_block(config: dict[str, Any], where: str) -> tuple[int, int] | None:
    """The fp8 weight block [bm, bn] a config.json's `quantization_config` names (None: no fp8
    weights — no quantization_config, or MXFP4 experts).

    Raises:
        ConversionError: a quantization the loader does not read (another quant_method, fmt or
            activation scheme, a per-tensor or malformed block), in one line naming the key.
    """
    quant = config.get("quantization_config")
    if quant is None:
        return None
    key = f"{where}: quantization_config"
    if not isinstance(quant, dict):
        raise ConversionError(f"{key}: expected an object, got {quant!r}")
    method = quant.get("quant_method")
    if method not in READ_METHODS:
        raise ConversionError(
            f"{key}.quant_method {method!r} is not supported (block-scaled fp8 and mxfp4 "
            "checkpoints are read; dequantise others to bf16 first)"
        )
    if method == "mxfp4":
        return None
    for field, value, allowed in (
        ("fmt", quant.get("fmt", "e4m3"), ("e4m3",)),
        ("activation_scheme", quant.get("activation_scheme", "dynamic"), ("dynamic",)),
        ("scale_fmt", quant.get("scale_fmt") or "float", ("float", "ue8m0")),
    ):
        if value not in allowed:
            only = " or ".join(allowed)
            raise ConversionError(f"{key}.{field} {value!r} is not supported (only {only})")
    block = quant.get("weight_block_size")
    if not (
        isinstance(block, list | tuple)
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ConversionError(
            f"{key}.weight_block_size {block!r} is not supported (two block sides such as "
            "[128, 128]; per-tensor fp8 scales are not read)"
        )
    return int(block[0]), int(block[1])


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The `_scale_inv` shape of a weight of `shape` [rows, cols]: one scale per block, the edge
    blocks partial."""
    rows, cols = shape
    return -(-rows // block[0]), -(-cols // block[1])


def block_span(start: int, stop: int, side: int) -> tuple[int, int]:
    """The blocks [first, last) of side `side` that rows (or columns) [start, stop) touch."""
    return start // side, -(-stop // side)


def dequantize_fp8(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    offset: tuple[int, int] = (0, 0),
) -> torch.Tensor:
    """A rectangle of an fp8 weight, dequantised to fp32.

    Args:
        weight: [rows, cols] float8_e4m3fn: the rectangle (the whole weight, or a slice of it).
        scale_inv: the scales of the blocks the rectangle touches, [blocks down, blocks across].
        block: [bm, bn].
        offset: the rectangle's first row and column within its first block.

    Returns:
        [rows, cols] fp32: `float32(w) * scale_inv` of each value's block.

    Raises:
        ValueError: a weight not in float8_e4m3fn, or scales that do not cover the rectangle.
    """
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(
            f"an fp8 weight must be a float8_e4m3fn matrix, got {weight.dtype} "
            f"{tuple(weight.shape)}"
        )
    if not scale_inv.dtype.is_floating_point or scale_inv.dim() != 2:
        raise ValueError(f"block scales must be a float matrix, got {scale_inv.dtype}")
    (rows, cols), (bm, bn), (r, c) = weight.shape, block, offset
    need = scale_grid((r + rows, c + cols), block)
    if tuple(scale_inv.shape) != need:
        raise ValueError(
            f"scale shape {tuple(scale_inv.shape)} does not match the {need} blocks of "
            f"{bm}x{bn} a weight of {tuple(weight.shape)} needs"
        )
    scale = scale_inv.to(torch.float32)
    # Expanded one axis at a time and cut to the rectangle: the expanded scale is the size of
    # the rectangle's rows, never of the whole weight.
    scale = scale.repeat_interleave(bm, dim=0)[r : r + rows]
    scale = scale.repeat_interleave(bn, dim=1)[:, c : c + cols]
    return weight.to(torch.float32) * scale
