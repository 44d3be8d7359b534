"""Collate functions: the tensor contract between the data pipeline and the model code.

Conventions shared by both collates, for one sequence ``s = prompt_ids + completion_ids``:

* input tokens are ``s[:-1]`` and labels are ``s[1:]``, so label ``t`` is the next-token target
  of input position ``t``; labels whose target is a prompt token are ``IGNORE_INDEX`` (-100), so
  only completion tokens are scored;
* every row of a batch is right-padded to one length ``T`` (rounded up to
  ``pad_to_multiple_of``): tokens with ``pad_id``, labels with -100. There is no attention
  mask: attention is causal and padding sits on the right, so real tokens never attend to it,
  and padded positions are excluded by their -100 labels;
* ``position_ids`` is ``arange(T)`` per row; ``*_lengths`` are the unpadded input lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from megatron_kto.data.kl_pairs import partner_positions

IGNORE_INDEX = -100


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def inputs_and_labels(
    prompt_ids: Sequence[int], completion_ids: Sequence[int]
) -> tuple[list[int], list[int]]:
    """Input tokens and shifted, prompt-masked labels of one sequence.

    Args:
        prompt_ids: prompt tokens (at least one).
        completion_ids: completion tokens (at least one).

    Returns:
        (inputs, labels), both of length ``len(prompt) + len(completion) - 1``.
    """
    if not prompt_ids or not completion_ids:
        raise ValueError(
            f"need a non-empty prompt and completion, got {len(prompt_ids)} prompt and "
            f"{len(completion_ids)} completion tokens"
        )
    sequence = list(prompt_ids) + list(completion_ids)
    # Targets s[1:P] are prompt tokens (masked); targets s[P:] are the completion.
    labels = [IGNORE_INDEX] * (len(prompt_ids) - 1) + list(completion_ids)
    return sequence[:-1], labels


def _padded(rows: Sequence[Sequence[int]], length: int, value: int) -> Tensor:
    out = torch.full((len(rows), length), value, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
    return out


def _padded_length(lengths: Sequence[int], pad_to_multiple_of: int) -> int:
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    return _round_up(max(lengths), pad_to_multiple_of)


def kl_completion(
    prompt_ids: Sequence[int], completion_ids: Sequence[int], max_length: int | None
) -> list[int]:
    """The completion of a KL row, cut from the right so prompt + completion fits ``max_length``."""
    if max_length is None or len(prompt_ids) + len(completion_ids) <= max_length:
        return list(completion_ids)
    room = max_length - len(prompt_ids)
    if room < 1:
        raise ValueError(
            f"a prompt of {len(prompt_ids)} tokens leaves no room for a KL completion within "
            f"max_length={max_length}; build the dataset with the same max_length"
        )
    return list(completion_ids[:room])


def _with_index(examples: Sequence[dict[str, Any]], batch: dict[str, Tensor]) -> dict[str, Tensor]:
    # Examples for a precomputed reference (`data.kl_pairs`) carry their dataset index (and, for
    # KTO, the epoch of their KL partner), the keys of the precomputed log-probs.
    for key in ("index", "epoch"):
        if key in examples[0]:
            batch[key] = torch.tensor([int(e[key]) for e in examples], dtype=torch.long)
    return batch


def in_batch_partners(prompts: Sequence[Sequence[int]]) -> list[int]:
    """KL partner position of each row of a batch: `data.kl_pairs.partner_positions` with
    prompts identified by their token ids.

    Raises:
        ValueError: every row has the same prompt.
    """
    ids: dict[tuple[int, ...], int] = {}
    keys = [ids.setdefault(tuple(p), len(ids)) for p in prompts]
    positions = partner_positions(keys)
    if positions is None:
        raise ValueError(
            f"all {len(prompts)} examples of the batch have the same prompt, so no KL row can "
            "pair a prompt with a completion written for another one; mix prompts in the batch "
            "or give fixed partners (data.kl_pairs)"
        )
    return positions.tolist()


def kto_custom_collate(
    examples: Sequence[dict[str, Any]],
    pad_id: int,
    pad_to_multiple_of: int = 1,
    max_length: int | None = None,
    kl_rows: bool = True,
) -> dict[str, Tensor]:
    """Collate KTO examples with their KL rows.

    KL row ``i`` is ``prompt_i + completion_j`` with j chosen by the rule of ``data.kl_pairs``:
    ``(i + 1) mod B`` — a circular shift, so the KL completions are exactly the batch's
    completions, permuted (a reversal would pair the middle row with itself for odd B) —
    unless that would give a row a completion written for its own prompt (equal prompt ids),
    e.g. the two rows of one paired example. Samples and KL rows are padded together to one
    length T.

    Args:
        examples: ``{"prompt_ids", "completion_ids", "label"}`` dicts (B >= 2). Examples that
            also carry ``kl_completion_ids`` (partners chosen over the global batch, see
            ``data.kl_pairs``) use those instead, and B = 1 is allowed; ``index`` and
            ``epoch`` keys are passed through as LongTensors [B].
        pad_id: token id used for padding.
        pad_to_multiple_of: T is rounded up to a multiple of this.
        max_length: most tokens of a KL row's prompt + completion; its completion is cut from
            the right to fit (None: no limit).
        kl_rows: build the KL rows; False for a loss that ignores z₀ (`apo_zero_unpaired`):
            then the ``kl_*`` keys are absent, T is the longest sample row, and B = 1 is fine.

    Returns:
        ``samples``, ``kl_samples``, ``sample_labels``, ``kl_sample_labels``, ``position_ids``:
        LongTensor [B, T]; ``preference`` (1 desirable, 0 undesirable), ``sample_lengths``,
        ``kl_sample_lengths``: LongTensor [B].

    Raises:
        ValueError: B < 2, or all rows share one prompt (no KL pair exists).
    """
    if not kl_rows:
        return _kto_samples_only(examples, pad_id, pad_to_multiple_of)
    batch = len(examples)
    # Training and validation give each row its KL partner, chosen over the global batch
    # (`data.kl_pairs`); then a batch (a data-parallel share) of one is fine.
    fixed_pairs = batch > 0 and "kl_completion_ids" in examples[0]
    if batch < 2 and not fixed_pairs:
        raise ValueError(
            f"kto_custom_collate got {batch} example(s), but KL rows pair each prompt with "
            "another example's completion, so a batch needs at least 2 (or fixed partners "
            "from data.kl_pairs)"
        )
    prompts = [list(e["prompt_ids"]) for e in examples]
    completions = [list(e["completion_ids"]) for e in examples]
    sample_rows = [inputs_and_labels(p, c) for p, c in zip(prompts, completions)]
    if fixed_pairs:
        kl_sources = [list(e["kl_completion_ids"]) for e in examples]
    else:
        kl_sources = [completions[j] for j in in_batch_partners(prompts)]
    kl_rows = [
        inputs_and_labels(p, kl_completion(p, kl_sources[i], max_length))
        for i, p in enumerate(prompts)
    ]
    sample_lengths = [len(inputs) for inputs, _ in sample_rows]
    kl_lengths = [len(inputs) for inputs, _ in kl_rows]
    length = _padded_length(sample_lengths + kl_lengths, pad_to_multiple_of)
    return _with_index(
        examples,
        {
            "samples": _padded([r[0] for r in sample_rows], length, pad_id),
            "kl_samples": _padded([r[0] for r in kl_rows], length, pad_id),
            "sample_labels": _padded([r[1] for r in sample_rows], length, IGNORE_INDEX),
            "kl_sample_labels": _padded([r[1] for r in kl_rows], length, IGNORE_INDEX),
            "position_ids": torch.arange(length, dtype=torch.long).repeat(batch, 1),
            "preference": torch.tensor([int(bool(e["label"])) for e in examples], dtype=torch.long),
            "sample_lengths": torch.tensor(sample_lengths, dtype=torch.long),
            "kl_sample_lengths": torch.tensor(kl_lengths, dtype=torch.long),
        },
    )


def _kto_samples_only(
    examples: Sequence[dict[str, Any]], pad_id: int, pad_to_multiple_of: int
) -> dict[str, Tensor]:
    if not examples:
        raise ValueError("kto_custom_collate got an empty batch")
    rows = [inputs_and_labels(e["prompt_ids"], e["completion_ids"]) for e in examples]
    lengths = [len(inputs) for inputs, _ in rows]
    length = _padded_length(lengths, pad_to_multiple_of)
    return _with_index(
        examples,
        {
            "samples": _padded([r[0] for r in rows], length, pad_id),
            "sample_labels": _padded([r[1] for r in rows], length, IGNORE_INDEX),
            "position_ids": torch.arange(length, dtype=torch.long).repeat(len(examples), 1),
            "preference": torch.tensor([int(bool(e["label"])) for e in examples], dtype=torch.long),
            "sample_lengths": torch.tensor(lengths, dtype=torch.long),
        },
    )


def dpo_custom_collate(
    examples: Sequence[dict[str, Any]], pad_id: int, pad_to_multiple_of: int = 1
) -> dict[str, Tensor]:
    """Collate DPO pairs; chosen and rejected rows are padded together to one length T.

    Args:
        examples: ``{"prompt_ids", "chosen_ids", "rejected_ids"}`` dicts (B >= 1).
        pad_id: token id used for padding.
        pad_to_multiple_of: T is rounded up to a multiple of this.

    Returns:
        ``chosen``, ``rejected``, ``chosen_labels``, ``rejected_labels``, ``position_ids``:
        LongTensor [B, T]; ``chosen_lengths``, ``rejected_lengths``: LongTensor [B]; with
        rewards in the examples (the RPO losses), ``chosen_rewards``, ``rejected_rewards``:
        float32 [B].
    """
    if not examples:
        raise ValueError("dpo_custom_collate got an empty batch")
    chosen = [inputs_and_labels(e["prompt_ids"], e["chosen_ids"]) for e in examples]
    rejected = [inputs_and_labels(e["prompt_ids"], e["rejected_ids"]) for e in examples]
    chosen_lengths = [len(r[0]) for r in chosen]
    rejected_lengths = [len(r[0]) for r in rejected]
    length = _padded_length(chosen_lengths + rejected_lengths, pad_to_multiple_of)
    rewards = {
        f"{side}_rewards": torch.tensor([e[f"{side}_reward"] for e in examples])
        for side in ("chosen", "rejected")
        if "chosen_reward" in examples[0]
    }
    return _with_index(
        examples,
        rewards
        | {
            "chosen": _padded([r[0] for r in chosen], length, pad_id),
            "rejected": _padded([r[0] for r in rejected], length, pad_id),
            "chosen_labels": _padded([r[1] for r in chosen], length, IGNORE_INDEX),
            "rejected_labels": _padded([r[1] for r in rejected], length, IGNORE_INDEX),
            "position_ids": torch.arange(length, dtype=torch.long).repeat(len(examples), 1),
            "chosen_lengths": torch.tensor(chosen_lengths, dtype=torch.long),
            "rejected_lengths": torch.tensor(rejected_lengths, dtype=torch.long),
        },
    )
