"""LoRA training checkpoints: the adapters (and their optimizer state) only, plus the base's identity.

The frozen base never changes, so a LoRA run's checkpoint holds the adapter tensors (global
keys `lora.layers.<i>...`, resharded on load like any dist-checkpoint tensor) and, in
`lora_base.json`, which base they were trained on: the `pretrained_checkpoint.restore_from_path`
and a fingerprint of the base weights. Resuming rebuilds the base from its own checkpoint and
refuses one whose fingerprint differs.

The fingerprint is (parameter count, Σw, Σw²) of every frozen tensor in float64, each counted once
over all ranks (`models.unique_params`: replicas once, every EP rank's experts), so it does not
depend on the layout beyond float64 rounding; two bases agree when they match to a relative 1e-9.
The sums read each tensor a slice of `FINGERPRINT_SLICE` elements at a time, so the float64
working copy is one slice (8 MiB), never a whole tensor: a full float64 copy of Llama-3-8B's
weights would be 8 GB next to its 16 GB of bf16 weights.

The fingerprint is of the weights as the run held them: a half-precision run (`trainer.precision`
bf16 or 16) fingerprints its base rounded to that dtype. A base rebuilt in float32 (the
`--merge-lora` export) is checked by rounding each slice to the run's dtype before summing
(`build_lora_model`), the rounding megatron applied when the run cast the restored base.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from megatron_kto.checkpointing.adapter_files import (
    BASE_FILE,
    adapter_sharded_state_dict,
    check_same_base,
)
from megatron_kto.checkpointing.errors import CheckpointError
from megatron_kto.models.builder import unwrap
from megatron_kto.models.unique_params import counted_here, world_sum

#: Elements of a tensor the fingerprint converts to float64 at once (8 MiB of float64).
FINGERPRINT_SLICE = 2**20
#: A trained adapter matrix's dist-checkpoint key: lora.layers.<i>.<linear>.adapters.<proj>.<A|B>
#: (the frozen starting copy, `ref_A` / `ref_B`, is not matched).
_TRAINED = re.compile(r"lora\.layers\.(\d+)\.\w+\.adapters\.(\w+)\.(lora_A|lora_B)")


def _slices(w: torch.Tensor, size: int) -> Iterator[torch.Tensor]:
    """`w`'s elements as 1-D pieces of at most `size` elements (views of a contiguous `w`; a
    non-contiguous one is read a block of leading-dimension rows at a time)."""
    if w.is_contiguous() or w.dim() < 2:
        yield from w.reshape(-1).split(size)
        return
    rows = max(1, size // max(1, w[0].numel()))
    for block in w.split(rows):
        yield from block.reshape(-1).split(size)  # copies one block, not the tensor


def _moments(w: torch.Tensor, slice_elements: int, dtype: torch.dtype | None) -> torch.Tensor:
    """[Σw, Σw²] of one tensor (rounded to `dtype` first, if given) in float64 on its device,
    converting at most `slice_elements` elements to float64 at a time (a non-contiguous `w`
    also copies a block of about as many elements in its own dtype)."""
    total = torch.zeros(2, dtype=torch.float64, device=w.device)
    for piece in _slices(w.detach(), slice_elements):
        x = (piece if dtype is None else piece.to(dtype)).double()
        # dot(x, x) rather than (x * x).sum(): no second slice-sized temporary.
        total += torch.stack([x.sum(), torch.dot(x, x)])
        # Released before the next slice is made, or two slices would be alive at once.
        del piece, x
    return total


def base_fingerprint(
    chunks: list[torch.nn.Module],
    slice_elements: int = FINGERPRINT_SLICE,
    dtype: torch.dtype | None = None,
) -> list[float]:
    """[count, Σw, Σw²] over the frozen (base) parameters of the whole model, each tensor once
    whatever the layout, the experts of every EP rank included (a collective over the world).

    Args:
        chunks: the model chunks.
        slice_elements: elements converted to float64 at a time.
        dtype: fingerprint the weights as this dtype holds them (each slice rounded to it):
            the dtype a run held its base in, when the base is rebuilt in a wider one. None:
            as the parameters are.

    Extra memory is one float64 slice of `slice_elements` elements (and, for a non-contiguous
    tensor or a `dtype`, a block of about as many in its own dtype), whatever the model's size.
    """
    device = next(unwrap(chunks[0]).parameters()).device
    total = torch.zeros(3, dtype=torch.float64, device=device)
    for p in counted_here(chunks):
        if not p.requires_grad:
            total[0] += p.numel()
            total[1:] += _moments(p, slice_elements, dtype).to(device)
    return [float(x) for x in world_sum(total).cpu()]


def base_record(restore_from_path: str | None, fingerprint: list[float]) -> dict[str, Any]:
    """What `lora_base.json` holds."""
    return {"restore_from_path": restore_from_path, "fingerprint": fingerprint}


def run_config(ckpt_dir: Path) -> Any:
    """The run config stored with a training checkpoint (None if it has none)."""
    from omegaconf import OmegaConf

    from megatron_kto.checkpointing import files

    path = Path(ckpt_dir) / files.CONFIG
    return OmegaConf.load(path) if path.is_file() else None


def run_param_dtype(cfg: Any) -> torch.dtype | None:
    """The dtype a run's model parameters (its frozen base among them) were held in, from
    `trainer.precision` of its stored config (resolved when the run started); None if unset."""
    from megatron_kto.config.machine import canonical_precision

    if cfg.trainer.precision is None:
        return None
    half = {"bf16": torch.bfloat16, "16": torch.float16}
    return half.get(canonical_precision(cfg.trainer.precision), torch.float32)


def is_lora_checkpoint(ckpt_dir: Path) -> bool:
    """Whether a checkpoint holds a LoRA run's adapters (and no base weights)."""
    return (Path(ckpt_dir) / BASE_FILE).is_file()


def lora_base_dir(ckpt_dir: Path) -> Path | None:
    """The resolved base checkpoint a LoRA checkpoint's adapters were trained on (None if the
    run started from a random initialisation)."""
    from megatron_kto.checkpointing.locate import resolve_pretrained_dir

    base = json.loads((Path(ckpt_dir) / BASE_FILE).read_text())["restore_from_path"]
    return resolve_pretrained_dir(base) if base else None


def trained_adapter_key(key: str) -> tuple[int, str, str] | None:
    """(global layer, Hugging Face projection, "lora_A" | "lora_B") of a LoRA checkpoint's
    tensor key, or None for any other key (the frozen starting copy, optimizer state, ...)."""
    match = _TRAINED.fullmatch(key)
    return None if match is None else (int(match[1]), match[2], match[3])


def read_trained_adapters(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """The trained adapter matrices of a LoRA checkpoint, by checkpoint key, whole (as one TP=1
    rank holds them) and in their stored dtype, read from the dist checkpoint's files alone: only
    these tensors' bytes are read, no model is built and the base is not touched.

    Needs torch.distributed initialised (megatron-core's loader; a world of one is enough).

    Raises:
        CheckpointError: not a readable dist checkpoint.
    """
    from megatron.core import dist_checkpointing

    try:
        metadata = dist_checkpointing.load_tensors_metadata(str(ckpt_dir))
        wanted = {k: v for k, v in metadata.items() if trained_adapter_key(k) is not None}
        # Whole tensors: requests of several processes would overlap, which the access-integrity
        # check refuses (megatron-core's `load_plain_tensors` skips it for the same reason).
        loaded = dist_checkpointing.load(wanted, str(ckpt_dir), validate_access_integrity=False)
    except Exception as e:  # megatron-core raises several types; surface one clear line
        raise CheckpointError(
            f"{ckpt_dir}: cannot read the adapters: {type(e).__name__}: {e}"
        ) from e
    return {k: loaded[k] for k in wanted}  # `load` adds the checkpoint's common (non-tensor) state


def load_adapters(ckpt_dir: Path, chunks: list[torch.nn.Module]) -> None:
    """Collectively load a LoRA checkpoint's adapters into chunks that have them (any layout)."""
    from megatron_kto.checkpointing.model_io import load_adapter_state, model_sharded_state_dict
    from megatron_kto.checkpointing.spec_compat import load_sharded

    sharded = adapter_sharded_state_dict(model_sharded_state_dict(chunks))
    loaded = load_sharded(sharded, ckpt_dir)
    for i, chunk in enumerate(chunks):
        load_adapter_state(
            chunk, loaded["model" if len(chunks) == 1 else f"model{i}"], str(ckpt_dir)
        )


def build_lora_model(ckpt_dir: Path, chunks: list[torch.nn.Module], arch: Any) -> Any:
    """Make freshly built chunks the model a LoRA checkpoint describes: its base weights (from
    the run's `pretrained_checkpoint.restore_from_path`, checked against the fingerprint taken
    in the run's parameter dtype, so float32 chunks take a bf16 run's adapters) plus its
    adapters. Collective.

    Returns:
        The run's `wiring.LoRASettings`.

    Raises:
        CheckpointError: not a LoRA checkpoint, its base is not restorable, or it changed.
    """
    from megatron_kto.checkpointing.pretrained import restore_pretrained
    from megatron_kto.peft.settings import lora_settings
    from megatron_kto.peft.wiring import apply_lora

    ckpt_dir = Path(ckpt_dir)
    cfg = run_config(ckpt_dir)
    if cfg is None or not is_lora_checkpoint(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir}: not a LoRA training checkpoint")
    base = json.loads((ckpt_dir / BASE_FILE).read_text())["restore_from_path"]
    if not base:
        raise CheckpointError(
            f"{ckpt_dir}: its run had no pretrained_checkpoint.restore_from_path, so the base "
            "weights (a random initialisation) cannot be rebuilt"
        )
    restore_pretrained(base, chunks)
    settings = lora_settings(cfg.model)
    apply_lora(chunks, arch, settings)
    check_same_base(ckpt_dir, base_fingerprint(chunks, dtype=run_param_dtype(cfg)))
    load_adapters(ckpt_dir, chunks)
    return settings
