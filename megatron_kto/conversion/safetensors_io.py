"""Stream tensors out of and into Hugging Face safetensors files (single or sharded + index).

Reading returns one tensor at a time through `safe_open`, so a converter holds at most one
source tensor besides the model it fills; quantised tensors (MXFP4 experts, `stacked.py`; fp8
block-scaled weights, `fp8.py`) come out dequantised to fp32, a slice of one from the slices of
its stored parts. Writing collects tensors into shards of at most `max_shard_bytes` and writes
`model.safetensors.index.json` when there are several.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megatron_kto.console import one_line
from megatron_kto.conversion.errors import ConversionError
from megatron_kto.conversion.fp8 import (
    FP8_E4M3,
    SCALE_DTYPES,
    SCALE_INV,
    block_span,
    dequantize_fp8,
    scale_grid,
)
from megatron_kto.conversion.stacked import (
    BLOCKS,
    SCALES,
    dequantize_mxfp4,
    mxfp4_shape,
    split_slice,
)

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


#: A vision-language checkpoint's language model (`hf_dir.VL_WRAPPERS`): its tensors are listed
#: under the text model's names (`model.language_model.X` as `model.X`); the vision tower's
#: tensors are not listed.
LANGUAGE_PREFIX = "model.language_model."
VISION_PREFIXES = ("model.visual.",)


#: The per-block inverse scales of an fp8 checkpoint's weights (DeepSeek-V3's `weight_scale_inv`).
FP8_SCALE_SUFFIX = ".weight_scale_inv"


class HFWeights:
    """Read-only access to the tensors of a Hugging Face model directory.

    With `prefixes` (stored prefix -> name prefix, a family's `weight_prefixes`) it is a view:
    tensors are named as the family's tables name them, and stored tensors under none of the
    prefixes (a multimodal checkpoint's vision tower) are not part of it.

    With `fp8_block` (`fp8.fp8_block` of the config.json) a tensor stored with a
    `<name>_scale_inv` next to it is read dequantised (`fp8.dequantize_fp8`), a slice of it from
    the slices of the weight and of its scales that the slice touches.
    """

    def __init__(
        self,
        model_dir: str | Path,
        prefixes: tuple[tuple[str, str], ...] = (),
        fp8_block: tuple[int, int] | None = None,
    ):
        """
        Raises:
            ConversionError: no safetensors weights, or an unreadable index/file; fp8 scales
                (`*_scale_inv`) without an fp8 `quantization_config`.
        """
        self.dir = Path(model_dir)
        self.fp8_block = fp8_block
        #: name -> stored dtype as safetensors names it ("F8_E4M3"), of the tensors `shapes` read.
        self._dtypes: dict[str, str] = {}
        index, single = self.dir / INDEX, self.dir / SINGLE
        current = index if index.is_file() else single
        try:
            if index.is_file():
                weight_map = json.loads(index.read_text())["weight_map"]
                self._file_of = {name: self.dir / f for name, f in weight_map.items()}
            elif single.is_file():
                with safe_open(single, framework="pt") as f:
                    self._file_of = {name: single for name in f.keys()}
            else:
                raise ConversionError(
                    f"{self.dir}: no {SINGLE} or {INDEX} (only safetensors weights are read)"
                )
        except (SafetensorError, OSError, ValueError, KeyError) as e:
            if isinstance(e, ConversionError):
                raise
            raise ConversionError(f"{current}: unreadable weights: {_one_line(e)}") from e
        #: name -> the name stored in the file (differs only in a view).
        self._stored = {name: name for name in self._file_of}
        if prefixes:
            self._stored = {
                new + name[len(old) :]: name
                for name in self._file_of
                for old, new in prefixes
                if name.startswith(old)
            }
            self._file_of = {name: self._file_of[stored] for name, stored in self._stored.items()}
        elif any(name.startswith(LANGUAGE_PREFIX) for name in self._file_of):
            # A vision-language checkpoint (`hf_dir.VL_WRAPPERS`): its language model under the
            # text model's names, the vision tower not listed.
            stored = {}
            for name in self._file_of:
                if name.startswith(VISION_PREFIXES):
                    continue
                public = name
                if name.startswith(LANGUAGE_PREFIX):
                    public = "model." + name[len(LANGUAGE_PREFIX) :]
                stored[public] = name
            self._stored = stored
            self._file_of = {name: self._file_of[s] for name, s in stored.items()}
        scales = sorted(n for n in self._file_of if n.endswith(SCALE_INV))
        if scales and fp8_block is None:
            raise ConversionError(
                f"{self.source_file(scales[0])}: tensor {scales[0]} is an fp8 block scale, but "
                "config.json has no quantization_config with quant_method fp8"
            )

    def names(self) -> set[str]:
        """All tensor names."""
        return set(self._file_of)

    def __contains__(self, name: str) -> bool:
        return all(n in self._file_of for n in self.stored(name))

    def stored(self, name: str) -> tuple[str, ...]:
        """The stored tensors a name reads: itself; for an expert slice (`stacked.expert_slice`)
        its stacked tensor, or the `_blocks` and `_scales` of an MXFP4 one; an fp8 weight and its
        `_scale_inv`."""
        base, expert = split_slice(name)
        if expert is None and self._scale_of(name):
            return (name, name + SCALE_INV)
        if expert is None or base in self._file_of:
            return (base,)
        return (base + BLOCKS, base + SCALES)

    def _scale_of(self, name: str) -> bool:
        """Whether `name` is an fp8 weight read with its `_scale_inv` (an fp8 checkpoint)."""
        return self.fp8_block is not None and name + SCALE_INV in self._file_of

    def _read(
        self, name: str, axis: int | None = None, start: int = 0, stop: int = 0, fp8: bool = False
    ) -> torch.Tensor:
        """Stored tensor `name`, or its slice [start, stop) along `axis`, as stored. A float8
        tensor is read only as an fp8 weight (`fp8`): without its scales it is refused."""
        path = self._file_of[name]
        try:
            with safe_open(path, framework="pt") as handle:
                if axis is None:
                    tensor = handle.get_tensor(self._stored[name])
                else:
                    lazy = handle.get_slice(self._stored[name])
                    index = [slice(None)] * len(lazy.get_shape())
                    index[axis] = slice(start, stop)
                    tensor = lazy[tuple(index)]
        except (SafetensorError, OSError, ValueError) as e:
            raise ConversionError(f"{path}: cannot read tensor {name}: {_one_line(e)}") from e
        if not fp8 and tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ConversionError(
                f"{path}: tensor {name} is {tensor.dtype} without a {name}{SCALE_INV} block "
                "scale read with it (an fp8 checkpoint needs quantization_config quant_method fp8)"
            )
        return tensor

    def _slice(self, name: str, expert: int) -> torch.Tensor:
        return self._read(name, 0, expert, expert + 1)[0]

    def _fp8(self, name: str, axis: int | None, start: int, stop: int) -> torch.Tensor:
        """fp8 weight `name` (axis None) or its rows / columns [start, stop), dequantised to
        fp32 from the slices of the weight and of its scales that they touch."""
        assert self.fp8_block is not None
        if axis is None:
            axis, start, stop = 0, 0, self._shapes([name])[name][0]
        side = self.fp8_block[axis]
        first, last = block_span(start, stop, side)
        weight = self._read(name, axis, start, stop, fp8=True)
        scale = self._read(name + SCALE_INV, axis, first, last, fp8=True)
        offset = (start - first * side, 0) if axis == 0 else (0, start - first * side)
        try:
            return dequantize_fp8(weight, scale, self.fp8_block, offset)
        except ValueError as e:
            raise ConversionError(f"{self.source_file(name)}: tensor {name}: {e}") from None

    def get(self, name: str) -> torch.Tensor:
        """One tensor, read from disk now; for an expert slice only that expert's bytes (MXFP4
        ones dequantised to fp32).

        Raises:
            KeyError: no such tensor.
            ConversionError: its file is missing or corrupt.
        """
        base, expert = split_slice(name)
        if self._scale_of(name):
            return self._fp8(name, None, 0, 0)
        if expert is not None:
            stored = self.stored(name)
            if len(stored) == 1:
                return self._slice(base, expert)
            blocks, scales = (self._slice(n, expert) for n in stored)
            try:
                return dequantize_mxfp4(blocks, scales)
            except ValueError as e:
                raise ConversionError(f"{self.source_file(stored[0])}: {base}: {e}") from None
        # A file is opened per tensor: `safe_open` memory-maps it, and the pages read stay in
        # this process's resident memory while the map lives — the whole source model by the end
        # of an import if handles were kept. Re-reading the header each time costs microseconds.
        return self._read(name)

    def source_file(self, name: str | None = None) -> Path:
        """The file that holds tensor `name` (the index or single file when `name` is None or
        absent) — what an error about it names."""
        if name is not None and name in self._file_of:
            return self._file_of[name]
        return self.dir / (INDEX if (self.dir / INDEX).is_file() else SINGLE)

    def shapes(self, names: Iterable[str]) -> dict[str, tuple[int, ...]]:
        """Whole shapes of `names`, from the files' headers (no tensor data is read).

        Raises:
            KeyError: no such tensor.
            ConversionError: a file is missing or corrupt, or lacks a tensor its index names.
        """
        names = list(names)
        slices = {n: split_slice(n) for n in names}
        stored = {s for n in names for s in self.stored(n)}
        whole = self._shapes(stored)
        out = {}
        for name, (base, expert) in slices.items():
            if expert is None:
                if self._scale_of(name):
                    self._check_fp8(name, whole[name], whole[name + SCALE_INV])
                out[name] = whole[name]
            elif base in whole:
                out[name] = whole[base][1:]
            else:
                out[name] = mxfp4_shape(whole[base + BLOCKS])[1:]
        return out

    def _shapes(self, names: Iterable[str]) -> dict[str, tuple[int, ...]]:
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self._file_of[name], []).append(name)
        out = {}
        for path, in_file in by_file.items():
            try:
                with safe_open(path, framework="pt") as handle:
                    present = set(handle.keys())
                    for name in in_file:
                        stored = self._stored[name]
                        if stored not in present:
                            raise ConversionError(
                                f"{path}: tensor {stored} is missing from the file"
                            )
                        lazy = handle.get_slice(stored)
                        out[name] = tuple(lazy.get_shape())
                        self._dtypes[name] = lazy.get_dtype()
            except (SafetensorError, OSError, ValueError) as e:
                if isinstance(e, ConversionError):
                    raise
                raise ConversionError(f"{path}: unreadable weights: {_one_line(e)}") from e
        return out

    def _check_fp8(self, name: str, shape: tuple[int, ...], scale: tuple[int, ...]) -> None:
        """An fp8 weight's stored dtype and its scales' dtype and shape, from the headers."""
        assert self.fp8_block is not None
        where = self.source_file(name)
        if self._dtypes[name] != FP8_E4M3:
            raise ConversionError(
                f"{where}: tensor {name} is stored as {self._dtypes[name]}, but has a block scale "
                f"{name}{SCALE_INV}: fp8 weights must be {FP8_E4M3} (quantization_config.fmt e4m3)"
            )
        if self._dtypes[name + SCALE_INV] not in SCALE_DTYPES:
            raise ConversionError(
                f"{where}: tensor {name}{SCALE_INV} is stored as {self._dtypes[name + SCALE_INV]}:"
                f" block scales must be one of {SCALE_DTYPES}"
            )
        if len(shape) != 2 or scale != scale_grid(shape, self.fp8_block):  # type: ignore[arg-type]
            bm, bn = self.fp8_block
            raise ConversionError(
                f"{where}: tensor {name}{SCALE_INV}: shape {scale} does not match the "
                f"{bm}x{bn} blocks of {name} {shape} (quantization_config.weight_block_size)"
            )

    def get_rows(self, name: str, axis: int | None, start: int, stop: int) -> torch.Tensor:
        """Tensor `name` (axis None), or its slice [start, stop) along `axis`, read from disk now.

        Only the slice's bytes are copied out of the memory-mapped file (`get_slice`); the file
        is unmapped again before returning (see `get`).

        Raises:
            KeyError: no such tensor.
            ConversionError: its file is missing or corrupt.
        """
        if axis is None:
            return self.get(name)
        if self._scale_of(name):
            return self._fp8(name, axis, start, stop)
        if split_slice(name)[1] is not None:
            return self.get(name).narrow(axis, start, stop - start)
        return self._read(name, axis, start, stop)


def _one_line(error: BaseException) -> str:
    # safetensors' messages can be long: the first 300 characters name the problem
    return one_line(error)[:300]


@dataclass
class ShardSet:
    """Shard files written under temporary names, in order, and where each tensor went."""

    files: list[str] = field(default_factory=list)
    """Temporary file names (relative to the output directory), in write order."""
    weight_map: dict[str, str] = field(default_factory=dict)
    """Tensor name -> temporary file name."""
    total: int = 0
    """Bytes of all tensors."""


def write_shard_files(
    tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | Path,
    dtype: torch.dtype,
    max_shard_bytes: int = 5 * 1024**3,
    stem: str = "shard",
) -> ShardSet:
    """Write `tensors` (cast to `dtype`, moved to the host one at a time) as safetensors files
    `<stem>-<k>.tmp` of at most `max_shard_bytes` each (a larger tensor gets a file of its own);
    `finish_shards` gives them their final names. At most one file's tensors are held at once."""
    out_dir = Path(out_dir)
    shard: dict[str, torch.Tensor] = {}
    size = 0
    result = ShardSet()

    def flush() -> None:
        nonlocal shard, size
        name = f"{stem}-{len(result.files):05d}.tmp"
        save_file(shard, str(out_dir / name), metadata={"format": "pt"})
        result.files.append(name)
        shard, size = {}, 0

    for name, tensor in tensors:
        tensor = tensor.detach().to(device="cpu", dtype=dtype).contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > max_shard_bytes:
            flush()
        shard[name] = tensor
        result.weight_map[name] = f"{stem}-{len(result.files):05d}.tmp"
        size += nbytes
        result.total += nbytes
    if shard:
        flush()
    return result


def finish_shards(out_dir: str | Path, parts: list[ShardSet]) -> list[str]:
    """Rename the temporary files of `parts` (in order) to the names `transformers` writes —
    `model.safetensors` when there is one file, else `model-0000k-of-0000n.safetensors` plus
    `model.safetensors.index.json` — and return the final names."""
    out_dir = Path(out_dir)
    tmp_names = [name for part in parts for name in part.files]
    count = len(tmp_names)
    if count == 0:
        raise ValueError(f"{out_dir}: no tensors were written")
    final = (
        [SINGLE]
        if count == 1
        else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    )
    renamed = dict(zip(tmp_names, final, strict=True))
    for tmp, name in renamed.items():
        os.replace(out_dir / tmp, out_dir / name)
    if count > 1:
        weight_map = {k: renamed[v] for part in parts for k, v in part.weight_map.items()}
        index = {
            "metadata": {"total_size": sum(part.total for part in parts)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return final


def write_sharded(
    tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | Path,
    dtype: torch.dtype,
    max_shard_bytes: int = 5 * 1024**3,
) -> list[str]:
    """Write `tensors` (cast to `dtype`) as safetensors shards under `out_dir`; returns the files.

    One shard is named `model.safetensors`; several are `model-0000k-of-0000n.safetensors` with
    an index, as `transformers` writes them.
    """
    part = write_shard_files(tensors, out_dir, dtype, max_shard_bytes)
    if not part.files:  # a model with no tensors still gets its (empty) file
        save_file({}, str(Path(out_dir) / "shard-00000.tmp"), metadata={"format": "pt"})
        part.files.append("shard-00000.tmp")
    return finish_shards(out_dir, [part])
