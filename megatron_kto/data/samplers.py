"""Megatron-style batch samplers: one global batch -> this data-parallel rank's share.

A global batch is ``global_batch_size`` (G) dataset indices; data-parallel rank ``r`` of ``DP``
gets the contiguous slice ``[r * G/DP, (r+1) * G/DP)`` of it, yielded as one list (the model
code splits it into micro-batches). All ranks compute the same global batches from the same
arguments, so no communication is needed.

Training (:class:`TrainingBatchSampler`) iterates across epochs from a global
``consumed_samples`` count (= optimizer steps x G), so a run resumed from a checkpoint sees
exactly the batches the uninterrupted run would have seen. Each epoch uses only full global
batches: the last ``len(dataset) % G`` samples of the epoch's order are dropped. In random
order the permutation changes every epoch (seed + epoch), so different samples are left out
each time.

With ``kl_prompt_keys`` (KTO: the dataset's prompt keys) each yielded entry is a triple
``(index, partner, epoch)``: the partner is chosen over the *global* batch by the rule of
``data.kl_pairs`` (the circular shift of DESIGN §1, never onto a row answering the same
prompt), whatever the data-parallel size, so z₀ — a mean over the global batch's KL rows —
does not change with DP (``data.kl_pairs.BatchKLPartners`` resolves the entries).

Validation (:class:`ValidationBatchSampler`) is one sequential pass over full global batches;
the tail of ``len(dataset) % G`` samples is not evaluated (``num_dropped`` says how many), which
keeps every validation batch the same shape as a training batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from megatron_kto.data.kl_pairs import batch_partners


def _check_layout(num_samples: int, global_batch_size: int, rank: int, size: int) -> None:
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"data-parallel rank {rank} is not in [0, {size})")
    if global_batch_size % size:
        raise ValueError(
            f"global_batch_size ({global_batch_size}) must be divisible by the data-parallel "
            f"size ({size})"
        )
    if num_samples < global_batch_size:
        raise ValueError(
            f"the dataset has {num_samples} examples, fewer than one global batch "
            f"({global_batch_size}); lower model.global_batch_size or add data"
        )


def _checked_keys(keys: np.ndarray | None, num_samples: int) -> np.ndarray | None:
    if keys is None:
        return None
    keys = np.asarray(keys)
    if keys.shape != (num_samples,):
        raise ValueError(f"kl_prompt_keys: expected {num_samples} keys, got {keys.shape}")
    return keys


def _global_batch(
    order: np.ndarray, batch: int, size: int, keys: np.ndarray | None
) -> tuple[list[int], list[int] | None]:
    start = batch * size
    indices = order[start : start + size].tolist()
    partners = None if keys is None else batch_partners(order, start, size, keys)
    return indices, partners


Share = list[int] | list[tuple[int, int, int]]


def rank_share(
    global_batch: list[int],
    rank: int,
    size: int,
    partners: Sequence[int] | None = None,
    epoch: int = 0,
) -> Share:
    """Data-parallel rank ``rank``'s contiguous slice of a global batch.

    Args:
        global_batch: the G dataset indices of one optimizer step, in order.
        rank, size: this rank's DP index and the DP size (must divide G).
        partners: the KL partner (dataset index) of each row of the global batch, or None.
        epoch: the pass the batch belongs to (carried along with partners).

    Returns:
        The indices, or ``(index, partner, epoch)`` triples when ``partners`` is given.
    """
    per_rank = len(global_batch) // size
    start, stop = rank * per_rank, (rank + 1) * per_rank
    if partners is None:
        return global_batch[start:stop]
    return [(i, p, epoch) for i, p in zip(global_batch[start:stop], partners[start:stop])]


class TrainingBatchSampler:
    """Yields this rank's share of each global batch, epoch after epoch.

    Iteration starts at ``consumed_samples`` and runs until ``max_epochs`` epochs are done (or
    forever when ``max_epochs`` is None; the trainer then stops on max_steps). The epoch of a
    batch is ``epoch_of(consumed_samples)``; use that with the trainer's own counter, because a
    DataLoader pulls indices ahead of the batches it has delivered.
    """

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        consumed_samples: int = 0,
        shuffle: bool = True,
        seed: int = 1234,
        max_epochs: int | None = None,
        kl_prompt_keys: np.ndarray | None = None,
    ) -> None:
        """Check the layout and remember where to start.

        Args:
            num_samples: dataset length.
            global_batch_size: G, indices per optimizer step across all DP ranks.
            data_parallel_rank: this rank's DP index.
            data_parallel_size: DP, the number of data-parallel ranks (must divide G).
            consumed_samples: samples consumed so far by the run (a multiple of G).
            shuffle: random order, reshuffled every epoch with ``seed + epoch``; else sequential.
            seed: the shuffling seed (the same on every rank).
            max_epochs: stop after this many epochs (None: never stop).
            kl_prompt_keys: [num_samples] prompt keys: yield ``(index, KL partner, epoch)``
                triples (KTO; see ``data.kl_pairs``).
        """
        _check_layout(num_samples, global_batch_size, data_parallel_rank, data_parallel_size)
        if consumed_samples < 0 or consumed_samples % global_batch_size:
            raise ValueError(
                f"consumed_samples ({consumed_samples}) must be a non-negative multiple of "
                f"global_batch_size ({global_batch_size})"
            )
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.rank = data_parallel_rank
        self.size = data_parallel_size
        self.consumed_samples = consumed_samples
        self.shuffle = shuffle
        self.seed = seed
        self.max_epochs = max_epochs
        self.kl_prompt_keys = _checked_keys(kl_prompt_keys, num_samples)
        self.epoch = self.epoch_of(consumed_samples)

    @property
    def batches_per_epoch(self) -> int:
        """Full global batches per epoch."""
        return self.num_samples // self.global_batch_size

    @property
    def samples_per_epoch(self) -> int:
        """Samples used per epoch (the dataset minus the dropped tail)."""
        return self.batches_per_epoch * self.global_batch_size

    def epoch_of(self, consumed_samples: int) -> int:
        """The 0-based epoch the next batch belongs to after ``consumed_samples`` samples."""
        return consumed_samples // self.samples_per_epoch

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The dataset indices of an epoch's full global batches, in order (int64 [samples/epoch])."""
        if self.shuffle:
            order = np.random.default_rng(self.seed + epoch).permutation(self.num_samples)
        else:
            order = np.arange(self.num_samples)
        return order[: self.samples_per_epoch]

    def batch_of_order(self, order: np.ndarray, batch: int) -> tuple[list[int], list[int] | None]:
        """Dataset indices of global batch ``batch`` of an epoch (``order = epoch_order(e)``)
        and their KL partners (None without ``kl_prompt_keys``)."""
        return _global_batch(order, batch, self.global_batch_size, self.kl_prompt_keys)

    def _share(self, order: np.ndarray, batch: int, epoch: int) -> Share:
        indices, partners = self.batch_of_order(order, batch)
        return rank_share(indices, self.rank, self.size, partners, epoch)

    def __iter__(self) -> Iterator[Share]:
        consumed = self.consumed_samples
        while self.max_epochs is None or self.epoch_of(consumed) < self.max_epochs:
            epoch = self.epoch_of(consumed)
            self.epoch = epoch
            order = self.epoch_order(epoch)
            first = (consumed - epoch * self.samples_per_epoch) // self.global_batch_size
            for batch in range(first, self.batches_per_epoch):
                yield self._share(order, batch, epoch)
                consumed += self.global_batch_size

    def __len__(self) -> int:
        """Batches left from ``consumed_samples`` to the end of ``max_epochs``."""
        if self.max_epochs is None:
            raise TypeError("an endless sampler (max_epochs=None) has no length")
        total = self.max_epochs * self.samples_per_epoch
        return max(0, total - self.consumed_samples) // self.global_batch_size


class ValidationBatchSampler:
    """One sequential pass: this rank's share of each full global batch; the tail is dropped."""

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        kl_prompt_keys: np.ndarray | None = None,
    ) -> None:
        """Check the layout.

        Args:
            num_samples: dataset length.
            global_batch_size: G.
            data_parallel_rank: this rank's DP index.
            data_parallel_size: DP (must divide G).
            kl_prompt_keys: [num_samples] prompt keys: yield ``(index, KL partner, 0)``
                triples (KTO; see ``data.kl_pairs``).
        """
        _check_layout(num_samples, global_batch_size, data_parallel_rank, data_parallel_size)
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.rank = data_parallel_rank
        self.size = data_parallel_size
        self.kl_prompt_keys = _checked_keys(kl_prompt_keys, num_samples)

    @property
    def num_dropped(self) -> int:
        """Samples in the incomplete last global batch, which are not evaluated."""
        return self.num_samples % self.global_batch_size

    def global_batch(self, batch: int) -> tuple[list[int], list[int] | None]:
        """Dataset indices of global batch ``batch`` and their KL partners (None without keys).

        The pass order for KL partners is the whole dataset (the dropped tail included)."""
        order = np.arange(self.num_samples)
        return _global_batch(order, batch, self.global_batch_size, self.kl_prompt_keys)

    def __iter__(self) -> Iterator[Share]:
        for batch in range(len(self)):
            indices, partners = self.global_batch(batch)
            yield rank_share(indices, self.rank, self.size, partners, 0)

    def __len__(self) -> int:
        return self.num_samples // self.global_batch_size


def build_dataloader(
    dataset: Dataset,
    batch_sampler: TrainingBatchSampler | ValidationBatchSampler,
    collate_fn: Callable[[list[Any]], Any],
    num_workers: int = 0,
    pin_memory: bool = False,
) -> DataLoader:
    """A DataLoader that yields one collated DP share per global batch.

    Args:
        dataset: a KTO or DPO dataset.
        batch_sampler: one of this module's samplers.
        collate_fn: e.g. ``functools.partial(kto_custom_collate, pad_id=tok.pad_id)``.
        num_workers: worker processes (0: collate in the main process).
        pin_memory: return batches in pinned host memory, so that the trainer's
            ``non_blocking`` copies to the GPU are asynchronous (CUDA runs only).

    Returns:
        The loader.
    """
    return DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        collate_fn=collate_fn,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        pin_memory=pin_memory,
        # Every iterator over a DataLoader draws its workers' base seed from `generator`, by
        # default torch's global generator — the one dropout uses. A resumed run creates its
        # first iterator mid-epoch, where an uninterrupted run did not, so that draw would shift
        # every later dropout mask. A private (fixed-seed) generator keeps the global stream
        # untouched; the samplers above do the shuffling with their own seeded generator anyway.
        generator=torch.Generator(),
    )
