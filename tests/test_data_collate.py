"""Length policy and the KTO/DPO collate contract (shift, masking, circular KL shift, padding)."""

from __future__ import annotations

import pytest
import torch

from megatron_kto.data.collate import IGNORE_INDEX, dpo_custom_collate, kto_custom_collate
from megatron_kto.data.length_policy import (
    DROP_PROMPT_TOO_LONG,
    LengthPolicy,
    plan_lengths,
    truncate_prompt,
)

PAD = 0
M = IGNORE_INDEX

# ----------------------------------------------------------------------------- length policy


def test_keep_end_keeps_bos_and_the_prompt_tail():
    assert truncate_prompt([1, 10, 11, 12, 13], 3, "keep_end", bos_id=1) == [1, 12, 13]
    assert truncate_prompt([1, 10, 11], 1, "keep_end", bos_id=1) == [1]
    assert truncate_prompt([10, 11, 12, 13], 2, "keep_end", bos_id=None) == [12, 13]
    assert truncate_prompt([1, 10, 11, 12], 2, "keep_start", bos_id=1) == [1, 10]
    assert truncate_prompt([1, 10], 5, "keep_end", bos_id=1) == [1, 10]


def test_plan_truncates_prompt_then_completion_from_the_right():
    policy = LengthPolicy(max_length=10, max_prompt_length=4)
    plan = plan_lengths(policy, 6, [9])
    assert (plan.prompt_length, plan.completion_lengths) == (4, (6,))
    assert plan.prompt_truncated and plan.completion_truncated and plan.drop_reason is None
    plan = plan_lengths(policy, 3, [7])
    assert (plan.prompt_length, plan.completion_lengths) == (3, (7,))
    assert not plan.prompt_truncated and not plan.completion_truncated
    # DPO: each completion is cut independently.
    assert plan_lengths(policy, 4, [3, 8]).completion_lengths == (3, 6)


def test_prompt_longer_than_max_length_is_dropped_not_padded():
    plan = plan_lengths(LengthPolicy(max_length=8), 8, [3])
    assert plan.drop_reason == DROP_PROMPT_TOO_LONG
    assert plan_lengths(LengthPolicy(max_length=8), 7, [3]).completion_lengths == (1,)
    assert plan_lengths(LengthPolicy(), 1000, [1000]).completion_lengths == (1000,)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_length": 8, "max_prompt_length": 8}, "must be smaller than max_length"),
        ({"max_length": 1}, "max_length"),
        ({"max_length": 8, "truncation_mode": "middle"}, "truncation_mode"),
        ({"max_prompt_length": 0}, "max_prompt_length"),
    ],
)
def test_policy_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LengthPolicy(**kwargs)


# ----------------------------------------------------------------------------- KTO collate


def kto_examples(batch: int) -> list[dict]:
    # Distinct prompt lengths and completion tokens so every pairing is identifiable.
    return [
        {
            "prompt_ids": [1] + [10 + i] * (i % 3 + 1),
            "completion_ids": [100 + i] * (i % 2 + 1) + [2],
            "label": i % 2 == 0,
        }
        for i in range(batch)
    ]


def test_labels_are_shifted_and_prompt_masked():
    examples = [
        {"prompt_ids": [1, 5, 6], "completion_ids": [7, 8, 2], "label": True},
        {"prompt_ids": [1, 9], "completion_ids": [3, 2], "label": False},
    ]
    out = kto_custom_collate(examples, pad_id=PAD)
    assert out["samples"].tolist() == [[1, 5, 6, 7, 8], [1, 9, 3, PAD, PAD]]
    assert out["sample_labels"].tolist() == [[M, M, 7, 8, 2], [M, 3, 2, M, M]]
    # KL row 0 = prompt 0 + completion 1; KL row 1 = prompt 1 + completion 0.
    assert out["kl_samples"].tolist() == [[1, 5, 6, 3, PAD], [1, 9, 7, 8, PAD]]
    assert out["kl_sample_labels"].tolist() == [[M, M, 3, 2, M], [M, 7, 8, 2, M]]
    assert out["sample_lengths"].tolist() == [5, 3]
    assert out["kl_sample_lengths"].tolist() == [4, 4]
    assert out["preference"].tolist() == [1, 0]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 4]] * 2


@pytest.mark.parametrize("batch", [2, 3, 4, 5, 7])
def test_kl_rows_are_a_circular_shift_never_a_reversal(batch):
    examples = kto_examples(batch)
    out = kto_custom_collate(examples, pad_id=PAD)
    completions = [tuple(e["completion_ids"]) for e in examples]
    kl_completions = []
    for i, example in enumerate(examples):
        prompt_len = len(example["prompt_ids"])
        length = int(out["kl_sample_lengths"][i]) + 1
        row = out["kl_samples"][i, : length - 1].tolist() + [
            int(out["kl_sample_labels"][i, length - 2])
        ]
        assert row[:prompt_len] == example["prompt_ids"]
        kl_completions.append(tuple(row[prompt_len:]))
    assert kl_completions == [completions[(i + 1) % batch] for i in range(batch)]
    assert sorted(kl_completions) == sorted(completions)  # a permutation of the batch's completions
    assert all(kl_completions[i] != completions[i] for i in range(batch))  # nobody keeps its own
    if batch > 2:
        assert kl_completions != completions[::-1]


def test_padding_is_shared_and_rounded_up():
    out = kto_custom_collate(kto_examples(3), pad_id=PAD, pad_to_multiple_of=8)
    lengths = torch.cat([out["sample_lengths"], out["kl_sample_lengths"]])
    assert all(
        out[k].shape == (3, 8)
        for k in ("samples", "kl_samples", "sample_labels", "kl_sample_labels", "position_ids")
    )
    assert all(out[k].dtype == torch.long for k in out)
    for key, labels_key, lengths_key in (("samples", "sample_labels", "sample_lengths"),
                                         ("kl_samples", "kl_sample_labels", "kl_sample_lengths")):  # fmt: skip
        for i, n in enumerate(out[lengths_key].tolist()):
            assert (out[key][i, n:] == PAD).all() and (out[labels_key][i, n:] == M).all()
    assert int(lengths.max()) <= 8


def test_kl_completion_is_cut_to_max_length():
    examples = [
        {"prompt_ids": [1, 5, 5, 5], "completion_ids": [7, 2], "label": True},
        {"prompt_ids": [1], "completion_ids": [8, 8, 8, 8, 2], "label": False},
    ]
    out = kto_custom_collate(examples, pad_id=PAD, max_length=6)
    # KL row 0: prompt of 4 + completion 1 cut to 2 tokens (its EOS is gone).
    assert out["kl_samples"][0, :5].tolist() == [1, 5, 5, 5, 8]
    assert out["kl_sample_labels"][0, :5].tolist() == [M, M, M, 8, 8]
    assert out["kl_sample_lengths"].tolist() == [5, 2]


def test_batch_of_one_has_no_kl_pair():
    with pytest.raises(ValueError, match="at least 2"):
        kto_custom_collate(kto_examples(1), pad_id=PAD)


# ----------------------------------------------------------------------------- DPO collate


def test_dpo_collate():
    examples = [
        {"prompt_ids": [1, 5], "chosen_ids": [6, 2], "rejected_ids": [7, 7, 7, 2]},
        {"prompt_ids": [1, 5, 5], "chosen_ids": [8, 2], "rejected_ids": [9, 2]},
    ]
    out = dpo_custom_collate(examples, pad_id=PAD, pad_to_multiple_of=4)
    assert out["chosen"].tolist() == [[1, 5, 6, PAD, PAD, PAD, PAD, PAD], [1, 5, 5, 8] + [PAD] * 4]
    assert out["rejected"].tolist()[0] == [1, 5, 7, 7, 7, PAD, PAD, PAD]
    assert out["chosen_labels"].tolist()[0] == [M, 6, 2, M, M, M, M, M]
    assert out["rejected_labels"].tolist()[1] == [M, M, 9, 2, M, M, M, M]
    assert out["chosen_lengths"].tolist() == [3, 4] and out["rejected_lengths"].tolist() == [5, 4]
    assert out["position_ids"].shape == (2, 8)
    assert dpo_custom_collate(examples[:1], pad_id=PAD)["chosen"].shape == (1, 5)
