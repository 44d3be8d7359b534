"""Model weights straight from a Hugging Face directory: each rank reads only its own shard.

`pretrained_checkpoint.restore_from_path=<HF model dir>` needs no converted copy. Every rank
walks its own parameters (its pipeline stage's layers, its experts, its tensor-parallel shard),
names the whole megatron tensor each one is a shard of (global layer and expert index:
`addressing.ChunkLayout`), looks it up in the family's table (`addressing.megatron_sources`, built
from the same `Mapping` entries as the converter) and reads just the slices of the Hugging Face
tensors that shard is made of (`addressing.shard_reads`), through `safe_open(...).get_slice`, one slice at a time straight into the parameter — so a
rank's host memory while loading is its own shard plus one slice (and the file pages it maps),
not the model. The values are those the converter would have written
and `load_model` restored: same fusion functions, same zero padding, one cast to the parameter's
dtype (tests compare bit for bit).

Checks (one-line `CheckpointError`s naming the file): every tensor the model needs is in the
weights and nothing else is (as the converter checks), and every tensor's shape is the one the
model implies.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from megatron.core import parallel_state

from megatron_kto.checkpointing.errors import CheckpointError
from megatron_kto.conversion.addressing import (
    IGNORED_HF_PREFIXES,
    IGNORED_HF_SUFFIXES,
    OUTPUT,
    ChunkLayout,
    Mapping,
    expected_hf_shapes,
    fill,
    megatron_sources,
    norm_names,
    shard_reads,
)
from megatron_kto.conversion.errors import ConversionError
from megatron_kto.conversion.hf_dir import hf_weights, read_hf_architecture, skipped_hf_tensors
from megatron_kto.conversion.registry import get_family
from megatron_kto.conversion.safetensors_io import HFWeights
from megatron_kto.models.builder import named_weights, unwrap


@dataclass
class LoadStats:
    """What one rank read: its evidence of reading only its own shard."""

    bytes_read: int = 0
    """Bytes of the slices copied out of the safetensors files."""
    tensors: int = 0
    """Parameters filled."""
    largest_read: int = 0
    """Bytes of the largest single slice (what the load holds at once besides the model)."""


def _group(expert: bool) -> tuple[int, int]:
    """(rank, size) of the group that shards a tensor: expert tensor parallelism for experts."""
    if expert:
        return (
            parallel_state.get_expert_tensor_parallel_rank(),
            parallel_state.get_expert_tensor_parallel_world_size(),
        )
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )


def _check_names(
    weights: HFWeights, sources: dict[str, Mapping], tied: bool, skipped: set[str]
) -> None:
    """Every rank checks the whole directory's names (cheap), so all fail alike; `skipped`
    (multi-token-prediction layers, `hf_dir.skipped_hf_tensors`) are not read."""
    needed = {name for source in sources.values() for name in source.hf}
    where = weights.source_file()
    for name in sorted(needed):
        if name not in weights:
            missing = [n for n in weights.stored(name) if n not in weights.names()]
            raise CheckpointError(f"{where}: tensor {missing[0]} is missing from the weights")
    needed = {stored for name in needed for stored in weights.stored(name)}
    unused = sorted(
        n
        for n in weights.names() - needed - skipped
        if not n.endswith(IGNORED_HF_SUFFIXES)
        and not n.startswith(IGNORED_HF_PREFIXES)
        and not (tied and n == OUTPUT.hf[0])
    )
    if unused:
        raise CheckpointError(f"{where}: tensors this model does not map: {unused[:4]}")


def load_hf_model(hf_dir: str | Path, chunks: list[torch.nn.Module]) -> LoadStats:
    """Fill this rank's chunks (any TP/PP/VPP/EP layout) from a Hugging Face directory, reading
    only the slices they hold. Not collective: each rank reads its own files.

    Raises:
        CheckpointError: unsupported model, a missing, extra or mis-shaped tensor, or an
            unreadable file — one line naming the file.
    """
    hf_dir = Path(hf_dir)
    try:
        config, arch = read_hf_architecture(hf_dir, warn=lambda line: None)  # warned at resolve
        family = get_family(config.get("model_type"))
        weights = hf_weights(hf_dir, config)
        return _load(weights, arch, family, chunks, skipped_hf_tensors(config, weights.names()))
    except ConversionError as e:
        raise CheckpointError(str(e)) from None


def _load(
    weights: HFWeights, arch, family, chunks: list[torch.nn.Module], skipped: set[str]
) -> LoadStats:
    models = [unwrap(chunk) for chunk in chunks]
    params = [named_weights(model) for model in models]
    norms = norm_names({n for p in params for n in p})
    sources = megatron_sources(arch, norms, family)
    _check_names(weights, sources, arch.share_embeddings_and_output_weights, skipped)
    plan = []
    for model, named in zip(models, params, strict=True):
        layout = ChunkLayout.of(model)
        for local, param in named.items():
            name = str(layout.to_global(local))
            source = sources.get(name)
            if source is None:
                raise CheckpointError(
                    f"{weights.dir}: no Hugging Face source for megatron parameter {name}"
                )
            plan.append((name, param, source, *_group(source.expert)))
    shapes = weights.shapes({h for _, _, source, _, _ in plan for h in source.hf})
    for name, param, source, _, size in plan:  # every shape before any data is read
        expected = expected_hf_shapes(source, arch, tuple(param.shape), size)
        for hf_name, shape in zip(source.hf, expected, strict=True):
            if shapes[hf_name] != shape:
                raise CheckpointError(
                    f"{weights.source_file(hf_name)}: {hf_name}: shape {shapes[hf_name]} "
                    f"does not match {shape} that {name} needs (config.json and weights "
                    "disagree)"
                )
    stats = LoadStats()
    with torch.no_grad():
        for _, param, source, rank, size in plan:
            local_shape = tuple(param.shape)
            for i, r in enumerate(shard_reads(source, arch, local_shape, rank, size)):
                part = weights.get_rows(r.name, r.axis, r.start, r.stop)
                nbytes = part.numel() * part.element_size()
                stats.bytes_read += nbytes
                stats.largest_read = max(stats.largest_read, nbytes)
                fill(source, arch, param.data, i, part, size, rank)
                del part  # one slice held at a time
            stats.tensors += 1
    return stats


__all__ = ["LoadStats", "load_hf_model"]
