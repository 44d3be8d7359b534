"""KL partners never pair a prompt with a completion written for that same prompt
(`data.kl_pairs`), in any order or strategy: global batches of the training sampler (sequential
and shuffled), validation, the collate's in-batch rule, paired data, several completions per
prompt, a batch or a dataset with a single prompt."""

from __future__ import annotations

import functools
import json
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_kto.data.collate import kto_custom_collate
from megatron_kto.data.kl_pairs import batch_partners, check_distinct_prompts, partner_positions
from megatron_kto.data.samplers import TrainingBatchSampler, ValidationBatchSampler

REPO = Path(__file__).resolve().parents[1]


def is_permutation(partners: np.ndarray) -> bool:
    return sorted(partners.tolist()) == list(range(len(partners)))


def test_distinct_prompts_keep_design_circular_shift():
    assert partner_positions([5, 9, 2, 7]).tolist() == [1, 2, 3, 0]


def test_paired_rows_in_order_shift_by_two():
    """{prompt, chosen, rejected} expands to adjacent rows with one prompt: the plain shift would
    pair (p_k, chosen_k) with (p_k, rejected_k); the rule shifts by 2 instead."""
    keys = [0, 0, 1, 1, 2, 2, 3, 3]
    assert partner_positions(keys).tolist() == [2, 3, 4, 5, 6, 7, 0, 1]
    assert partner_positions([0, 0, 1, 1]).tolist() == [2, 3, 0, 1]


def test_group_sorted_permutation_when_no_shift_works():
    keys = np.array([0, 1, 0, 2, 1, 0])
    # Every circular shift meets a same-prompt row somewhere, so rule 2 applies.
    assert all(np.any(keys == np.roll(keys, -s)) for s in range(1, 6))
    partners = partner_positions(keys)
    assert is_permutation(partners) and np.all(keys[partners] != keys)


@pytest.mark.parametrize("g", [2, 3, 5, 8, 16, 33])
def test_random_batches_never_meet_their_own_prompt(g):
    """Property check over 400 seeded random batches per size, from all-distinct prompts to a
    single one: every row gets another prompt's completion; a permutation (the KL completions
    are the batch's completions) whenever no prompt fills more than half the batch."""
    rng = np.random.default_rng(g)
    for trial in range(400):
        keys = rng.integers(0, 1 + trial % g, size=g)
        partners = partner_positions(keys)
        if len(np.unique(keys)) == 1:
            assert partners is None
            continue
        assert np.all(keys[partners] != keys), keys
        if 2 * np.bincount(keys).max() <= g:
            assert is_permutation(partners), keys


def test_one_prompt_filling_most_of_the_batch_takes_the_next_other_prompt():
    keys = np.array([0, 0, 1, 0, 0])
    assert partner_positions(keys).tolist() == [2, 2, 3, 2, 2]


def test_single_prompt_batch_borrows_the_rows_after_it():
    keys = np.array([7, 7, 7, 7, 1, 7, 2, 3])  # batch 0 = rows 0..3, one prompt
    order = np.arange(8)
    assert batch_partners(order, 0, 4, keys) == [4, 6, 7, 4]
    with pytest.raises(ValueError, match="all 3 examples have the same prompt"):
        batch_partners(np.arange(3), 0, 3, np.zeros(3, dtype=np.int64))
    with pytest.raises(ValueError, match="data.jsonl: all 3 examples have the same prompt"):
        check_distinct_prompts(np.zeros(3, dtype=np.int64), "data.jsonl")


def test_single_prompt_last_batch_wraps_to_the_start_of_the_pass():
    keys = np.array([1, 2, 7, 7])
    assert batch_partners(np.arange(4), 2, 2, keys) == [0, 1]


def _entries(shares):
    return [e for share in shares for e in share]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("dp", [1, 2])
def test_training_sampler_with_paired_and_multi_completion_data(shuffle, dp):
    """Paired data (2 rows per prompt, adjacent) and unpaired data with 3-6 completions per
    prompt: over 3 epochs, no KL partner answers its row's prompt."""
    rng = np.random.default_rng(0)
    datasets = {
        "paired": np.repeat(np.arange(60), 2),
        "multi": np.repeat(np.arange(30), rng.integers(3, 7, size=30)),
    }
    for name, keys in datasets.items():
        n, g = len(keys), 12
        samplers = [
            TrainingBatchSampler(n, g, r, dp, shuffle=shuffle, max_epochs=3, kl_prompt_keys=keys)
            for r in range(dp)
        ]
        batches = list(zip(*samplers))
        assert len(batches) == 3 * (n // g)
        for shares in batches:
            entries = _entries(shares)
            rows = np.array([i for i, _, _ in entries])
            partners = np.array([p for _, p, _ in entries])
            assert np.all(keys[rows] != keys[partners]), name
            if 2 * np.bincount(keys[rows]).max() <= g:
                assert sorted(partners.tolist()) == sorted(rows.tolist()), name


def test_validation_sampler_with_paired_data():
    keys = np.repeat(np.arange(20), 2)
    for dp in (1, 2, 4):
        for shares in zip(*[ValidationBatchSampler(40, 8, r, dp, keys) for r in range(dp)]):
            entries = _entries(shares)
            rows = [i for i, _, _ in entries]
            assert [p for _, p, _ in entries] == rows[2:] + rows[:2]  # shift by 2
            assert {e for _, _, e in entries} == {0}


def test_collate_in_batch_rule_uses_prompt_ids():
    collate = functools.partial(kto_custom_collate, pad_id=0)
    # Two paired examples in order: prompts [1, 10] x2, [1, 11] x2.
    examples = [
        {"prompt_ids": [1, 10 + k // 2], "completion_ids": [20 + k, 2], "label": k % 2 == 0}
        for k in range(4)
    ]
    kl = collate(examples)["kl_samples"].tolist()
    # KL row: prompt (2 tokens) + partner completion's first token at position 2.
    assert [row[2] for row in kl] == [22, 23, 20, 21]
    distinct = [dict(e, prompt_ids=[1, 10 + k]) for k, e in enumerate(examples)]
    assert [row[2] for row in collate(distinct)["kl_samples"].tolist()] == [21, 22, 23, 20]
    same = [dict(e, prompt_ids=[1, 10]) for e in examples]
    with pytest.raises(ValueError, match="all 4 examples of the batch have the same prompt"):
        collate(same)


def test_build_split_refuses_a_single_prompt_dataset(tmp_path):
    """One `error:` line naming the key, before any model exists (ConfigError -> exit 2)."""
    from hydra import compose, initialize_config_dir

    from megatron_kto.config.schema import register
    from megatron_kto.config.validate import ConfigError
    from megatron_kto.data.pipeline import build_split
    from megatron_kto.data.tokenizers import load_tokenizer

    rows = [{"prompt": "Name two fruit words .", "completion": f" {w} .", "label": i % 2 == 0}
            for i, w in enumerate(["apple", "plum", "car", "bus"])]  # fmt: skip
    data = tmp_path / "one_prompt.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(
            config_name="gpt_kto",
            overrides=[f"model.data.data_prefix.train=[{data}]", "model.data.use_cache=false"],
        )
    tok = load_tokenizer("sentencepiece", str(REPO / "examples/data/tokenizer/tiny_sp.model"))
    runtime = types.SimpleNamespace(
        local_rank=0, data_parallel_rank=0, data_parallel_size=1, device=torch.device("cpu")
    )
    with pytest.raises(ConfigError, match="model.data.data_prefix.train: all 4 examples"):
        build_split(cfg, "train", "kto", tok, runtime, 64)
    cfg.model.kto.loss_type = "apo_zero_unpaired"  # no KL term: accepted
    split = build_split(cfg, "train", "kto", tok, runtime, 64)
    assert split is not None and len(split.dataset) == 4
