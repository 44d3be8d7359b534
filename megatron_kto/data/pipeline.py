"""From config to per-rank loaders: dataset, sampler and collate for one split of a run."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_kto.config.validate import ConfigError
from megatron_kto.data.collate import dpo_custom_collate, kto_custom_collate
from megatron_kto.data.dataset import build_dpo_dataset, build_kto_dataset
from megatron_kto.data.kl_pairs import BatchKLPartners, IndexedExamples, check_distinct_prompts
from megatron_kto.data.rewards import pair_rewards
from megatron_kto.data.samplers import (
    TrainingBatchSampler,
    ValidationBatchSampler,
    build_dataloader,
)
from megatron_kto.data.stats import DatasetStats
from megatron_kto.data.tokenizers import Tokenizer
from megatron_kto.losses.dpo_types import loss_type_names, needs_rewards
from megatron_kto.losses.kto import uses_kl_reference_point

#: Where relative paths in the bundled configs are anchored when not found from the cwd.
REPO_ROOT = Path(__file__).resolve().parents[2]


def resolve_path(path: str) -> Path:
    """A config path: as given (absolute or relative to the cwd), else relative to the repo root."""
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists():
        return p
    anchored = REPO_ROOT / p
    return anchored if anchored.exists() else p


@dataclass
class Split:
    """One split's dataset and how this rank iterates it."""

    name: str
    dataset: torch.utils.data.Dataset
    stats: DatasetStats
    collate: Callable[[list[Any]], dict[str, torch.Tensor]]
    global_batch_size: int
    data_parallel_rank: int
    data_parallel_size: int
    shuffle: bool
    seed: int
    num_workers: int
    kl_prompt_keys: np.ndarray | None = None
    """KTO: prompt keys by dataset index; the sampler then yields (index, KL partner, epoch)
    entries chosen over the global batch (`data.kl_pairs`)."""
    pin_memory: bool = False
    """Batches come in pinned host memory (CUDA runs: asynchronous host->device copies)."""
    paths: list[Path] = field(default_factory=list)
    """The split's data files, in dataset order (`provenance.row_sources` names rows by them)."""
    kind: str = "kto"
    """'kto' or 'dpo' (how the files' rows become examples)."""

    @property
    def num_global_batches(self) -> int:
        """Full global batches in one pass (the incomplete tail is dropped)."""
        return len(self.dataset) // self.global_batch_size

    def loader(self, epoch: int = 0, batches_done: int = 0) -> Iterable[dict[str, torch.Tensor]]:
        """This rank's collated batches of `epoch`, starting after `batches_done` global batches.

        Training splits resume exactly (same order as an uninterrupted run); validation is one
        sequential pass.
        """
        if self.name != "train":
            sampler: Any = ValidationBatchSampler(
                len(self.dataset),
                self.global_batch_size,
                self.data_parallel_rank,
                self.data_parallel_size,
                kl_prompt_keys=self.kl_prompt_keys,
            )
        else:
            samples_per_epoch = self.num_global_batches * self.global_batch_size
            sampler = TrainingBatchSampler(
                len(self.dataset),
                self.global_batch_size,
                self.data_parallel_rank,
                self.data_parallel_size,
                consumed_samples=epoch * samples_per_epoch + batches_done * self.global_batch_size,
                shuffle=self.shuffle,
                seed=self.seed,
                max_epochs=epoch + 1,
                kl_prompt_keys=self.kl_prompt_keys,
            )
        return build_dataloader(
            self.dataset, sampler, self.collate, self.num_workers, pin_memory=self.pin_memory
        )

    def global_batches(
        self, epoch: int, count: int
    ) -> Iterator[tuple[list[int], list[int] | None]]:
        """The first `count` global batches of `epoch` (all DP ranks' rows, in order) and their
        KL partners — what `loader` deals out, for precomputing the reference."""
        if self.name != "train":
            sampler: Any = ValidationBatchSampler(
                len(self.dataset), self.global_batch_size, 0, 1, self.kl_prompt_keys
            )
            for b in range(count):
                yield sampler.global_batch(b)
            return
        sampler = TrainingBatchSampler(
            len(self.dataset),
            self.global_batch_size,
            0,
            1,
            shuffle=self.shuffle,
            seed=self.seed,
            kl_prompt_keys=self.kl_prompt_keys,
        )
        order = sampler.epoch_order(epoch)
        for b in range(count):
            yield sampler.batch_of_order(order, b)

    def describe(self) -> str:
        """Start-up report: counts, drops by the length policy, class-balance warnings."""
        return f"[{self.name}] " + self.stats.summary()


def build_split(
    cfg: Any,
    split: str,
    algorithm: str,
    tokenizer: Tokenizer,
    runtime: Any,
    max_length: int,
    index_offset: int | None = None,
) -> Split | None:
    """Build the `split` ("train" or "validation") of a run, or None if it has no files.

    KTO rows get their KL partners over the global batch (`data.kl_pairs`). With `index_offset`
    set (precomputed reference), items also carry `index` = offset + dataset index (and, for KTO,
    the `epoch` of the KL partner): the keys of the precomputed reference log-probs.

    Tokenisation is cached beside the data; local rank 0 of each node writes the cache while the
    other ranks wait at a barrier.
    """
    d, m = cfg.model.data, cfg.model
    files = list(getattr(d.data_prefix, split))
    if not files:
        return None
    paths = [resolve_path(f) for f in files]
    for path in paths:
        if not path.exists():
            key = f"model.data.data_prefix.{split}"
            raise ConfigError(f"{key}: {path} does not exist")
    build = build_kto_dataset if algorithm == "kto" else build_dpo_dataset
    dataset, stats = build(
        paths,
        tokenizer,
        max_length,
        max_prompt_length=d.max_prompt_length,
        truncation_mode=d.truncation_mode,
        is_cache_writer=runtime.local_rank == 0,
        barrier=torch.distributed.barrier if torch.distributed.is_initialized() else None,
        use_cache=d.use_cache,
    )
    if algorithm == "dpo" and needs_rewards(m.dpo.loss_type):
        dataset.rewards = pair_rewards(
            dataset,
            paths,
            (d.default_chosen_reward, d.default_rejected_reward),
            loss_type_names(m.dpo.loss_type)[0],
        )
    # KTO KL partners are chosen over the global batch (so KL rows and z0 do not depend on the
    # data-parallel size), never among rows that answer the same prompt.
    keys = None
    if algorithm == "kto":
        keys = np.asarray(dataset.prompt_keys)
        try:
            check_distinct_prompts(keys, f"model.data.data_prefix.{split}")
        except ValueError as err:
            if m.kto.loss_type != "apo_zero_unpaired":
                raise ConfigError(str(err)) from None
            # This loss has no KL term (no KL rows are built): with a single prompt, rows are
            # told apart by position so the sampler's partner rule has nothing to refuse.
            keys = np.arange(len(keys), dtype=np.int64)
        dataset = BatchKLPartners(dataset, index_offset)
    elif index_offset is not None:
        dataset = IndexedExamples(dataset, index_offset)
    if algorithm == "kto":
        collate = partial(
            kto_custom_collate,
            pad_id=tokenizer.pad_id,
            pad_to_multiple_of=d.pad_to_multiple_of,
            max_length=max_length,
            # A loss that ignores z₀ needs no KL rows: none are built, so none are run.
            kl_rows=uses_kl_reference_point(m.kto.loss_type),
        )
    else:
        collate = partial(
            dpo_custom_collate, pad_id=tokenizer.pad_id, pad_to_multiple_of=d.pad_to_multiple_of
        )
    return Split(
        name="train" if split == "train" else split,
        dataset=dataset,
        stats=stats,
        collate=collate,
        global_batch_size=m.global_batch_size,
        data_parallel_rank=runtime.data_parallel_rank,
        data_parallel_size=runtime.data_parallel_size,
        shuffle=d.shuffle,
        seed=m.seed,
        num_workers=d.num_workers,
        kl_prompt_keys=keys,
        pin_memory=runtime.device.type == "cuda",
        paths=paths,
        kind=algorithm,
    )
