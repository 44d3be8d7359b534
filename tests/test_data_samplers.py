"""Megatron-style samplers: determinism, epochs, resume from consumed_samples, DP sharding."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest

from megatron_kto.data.collate import kto_custom_collate
from megatron_kto.data.samplers import (
    TrainingBatchSampler,
    ValidationBatchSampler,
    build_dataloader,
)

N, G = 103, 12  # 8 full global batches per epoch, 7 samples dropped


def take(sampler, count: int) -> list[list[int]]:
    return list(itertools.islice(iter(sampler), count))


def global_batches(dp: int, count: int, **kwargs) -> list[list[int]]:
    """Concatenate the ranks' shares of each global batch, in rank order."""
    shares = [take(TrainingBatchSampler(N, G, r, dp, **kwargs), count) for r in range(dp)]
    return [sum((shares[r][b] for r in range(dp)), []) for b in range(count)]


def test_random_order_is_seeded_identical_across_instances_and_reshuffled_per_epoch():
    a = take(TrainingBatchSampler(N, G, 0, 1, seed=7), 16)
    assert a == take(TrainingBatchSampler(N, G, 0, 1, seed=7), 16)
    assert a != take(TrainingBatchSampler(N, G, 0, 1, seed=8), 16)
    epoch0, epoch1 = sum(a[:8], []), sum(a[8:], [])
    assert len(set(epoch0)) == len(epoch0) == 96 and len(set(epoch1)) == 96
    assert epoch0 != epoch1


def test_sequential_order_and_dropped_tail():
    batches = take(TrainingBatchSampler(N, G, 0, 1, shuffle=False, max_epochs=2), 100)
    assert len(batches) == 16
    assert batches[0] == list(range(12)) and batches[7] == list(range(84, 96))
    assert batches[8] == list(range(12))  # epoch 2 starts over; samples 96..102 never appear


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_resume_from_consumed_samples_sees_the_same_batches(shuffle, dp):
    full = global_batches(dp, 20, shuffle=shuffle, seed=3)
    for steps in (0, 1, 7, 8, 9, 15):  # including both sides of the epoch boundary
        resumed = global_batches(
            dp, 20 - steps, shuffle=shuffle, seed=3, consumed_samples=steps * G
        )
        assert resumed == full[steps:], steps


@pytest.mark.parametrize("dp", [2, 3, 4])
def test_dp_shards_are_disjoint_and_cover_every_full_batch(dp):
    g = 12
    samplers = [TrainingBatchSampler(N, g, r, dp, seed=5, max_epochs=1) for r in range(dp)]
    shares = [list(s) for s in samplers]
    seen = [i for rank in shares for batch in rank for i in batch]
    assert all(len(batch) == g // dp for rank in shares for batch in rank)
    assert len(seen) == len(set(seen)) == (N // g) * g  # no example twice within an epoch
    assert set(seen) == set(samplers[0].epoch_order(0).tolist())
    # Each rank holds a contiguous slice of the global batch.
    for b in range(len(shares[0])):
        order = samplers[0].epoch_order(0)[b * g : (b + 1) * g].tolist()
        assert sum((shares[r][b] for r in range(dp)), []) == order


def test_epoch_bookkeeping_and_length():
    sampler = TrainingBatchSampler(N, G, 0, 1, consumed_samples=5 * G, max_epochs=3)
    assert (sampler.batches_per_epoch, sampler.samples_per_epoch) == (8, 96)
    assert sampler.epoch_of(0) == 0 and sampler.epoch_of(96) == 1 and sampler.epoch_of(95) == 0
    assert len(sampler) == 3 * 8 - 5 == len(list(sampler))
    assert sampler.epoch == 2  # the epoch of the last batch handed out
    with pytest.raises(TypeError):
        len(TrainingBatchSampler(N, G, 0, 1))


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((N, 10, 0, 4), {}, "divisible by the data-parallel size"),
        ((10, 12, 0, 1), {}, "fewer than one global batch"),
        ((N, G, 2, 2), {}, "rank 2 is not in"),
        ((N, G, 0, 1), {"consumed_samples": 5}, "multiple of global_batch_size"),
    ],
)
def test_bad_layouts(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainingBatchSampler(*args, **kwargs)


def test_validation_sampler_is_one_sequential_pass_without_the_tail():
    shares = [list(ValidationBatchSampler(N, G, r, 2)) for r in range(2)]
    assert (
        len(shares[0]) == 8
        and shares[0][0] == list(range(6))
        and shares[1][0] == list(range(6, 12))
    )
    assert sorted(i for s in shares for b in s for i in b) == list(range(96))
    assert ValidationBatchSampler(N, G, 0, 2).num_dropped == 7


def test_dataloader_yields_one_collated_share_per_global_batch():
    dataset = [
        {"prompt_ids": [1, i], "completion_ids": [i, 2], "label": i % 2 == 0} for i in range(40)
    ]
    sampler = TrainingBatchSampler(len(dataset), 8, 1, 2, shuffle=False, max_epochs=1)
    loader = build_dataloader(dataset, sampler, functools.partial(kto_custom_collate, pad_id=0))
    batches = list(loader)
    assert len(batches) == 5
    assert batches[0]["samples"][:, 1].tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("dp", [1, 2, 3, 6])
@pytest.mark.parametrize("shuffle", [False, True])
def test_kl_partners_are_the_global_batch_shift_for_every_dp(dp, shuffle):
    """With distinct prompts each row's KL partner is the next row of the *global* batch
    (mod G), so the ranks' shares together hold exactly the DP=1 pairs and no row is its own
    partner; the epoch travels with each entry."""
    keys = np.arange(N)  # every prompt distinct
    kwargs = {"shuffle": shuffle, "kl_prompt_keys": keys, "max_epochs": 2}
    expected = global_batches(1, 10, shuffle=shuffle, max_epochs=2)
    for b, batch in enumerate(global_batches(dp, 10, **kwargs)):
        rows = [i for i, _, _ in batch]
        assert rows == expected[b]
        assert [p for _, p, _ in batch] == rows[1:] + rows[:1]
        assert {e for _, _, e in batch} == {b // 8}  # 8 global batches per epoch
    shares = [list(ValidationBatchSampler(N, G, r, dp, keys))[0] for r in range(dp)]
    rows = [i for share in shares for i, _, _ in share]
    assert [p for share in shares for _, p, _ in share] == rows[1:] + rows[:1]


def test_kl_rows_do_not_depend_on_the_data_parallel_size():
    """Collated through `BatchKLPartners`, the KL rows of DP=3 shares, stacked, are the DP=1
    rows — including a share of one row, which the in-batch shift could not pair — also when
    rows share prompts (pairs of rows with one prompt, as paired data expands)."""
    from megatron_kto.data.kl_pairs import BatchKLPartners

    rows = [
        {"prompt_ids": [1, i // 2], "completion_ids": [i, i + 50], "label": i % 2 == 0}
        for i in range(36)
    ]
    keys = np.asarray([i // 2 for i in range(36)])
    dataset = BatchKLPartners(rows)
    collate = functools.partial(kto_custom_collate, pad_id=0)

    def kl_rows(dp: int, g: int, shuffle: bool) -> list[list[int]]:
        out = []
        for r in range(dp):
            sampler = TrainingBatchSampler(
                36, g, r, dp, shuffle=shuffle, max_epochs=1, kl_prompt_keys=keys
            )
            out += next(iter(build_dataloader(dataset, sampler, collate)))["kl_samples"].tolist()
        return out

    for shuffle in (False, True):
        single = kl_rows(1, 6, shuffle)
        assert kl_rows(3, 6, shuffle) == single
        assert kl_rows(6, 6, shuffle) == single  # one row per rank
        # Never a completion written for the row's own prompt (completion i answers i // 2).
        assert all(row[2] // 2 != row[1] for row in single)
