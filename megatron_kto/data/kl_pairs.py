"""KL partners: which completion each KTO row's KL row borrows.

The KL row of (prompt_i, completion_i) is (prompt_i, completion_j) for a *mismatched* j: a
completion written for another prompt. Rows that answer the same prompt (equal prompt keys,
``encoding.prompt_key``) are never partners — a paired row ``{prompt, chosen, rejected}``
expands to two adjacent rows with one prompt, and datasets often hold several completions per
prompt, so "the next row" alone would pair a prompt with its own answers and bias z₀.

**The rule** (:func:`partner_positions`), for the G rows of a global batch in order:

1. The smallest circular shift s in 1..min(G-1, 32) under which no row meets its own prompt:
   partner(i) = (i + s) mod G. With distinct neighbouring prompts s = 1, DESIGN §1's shift;
   paired rows in sequential order get s = 2. A shift is a permutation, so the KL completions
   are exactly the batch's completions.
2. Else, if no prompt fills more than half the batch: rows sorted by prompt group (largest
   group first, stable), each paired with the row m places later in that order (mod G), m =
   the largest group's size — still a permutation, and never within a group.
3. Else (one prompt fills more than half the batch): each row takes the next row in circular
   order whose prompt differs; completions may then repeat.
4. A batch with a single prompt has no mismatched completion: its rows take, in turn, the next
   rows *after the batch* in the pass order (the epoch's order, circularly) whose prompt
   differs. Only a dataset with a single prompt has none — `check_distinct_prompts` refuses it
   before training.

Where the rule is applied:

* **Global-batch partners** (`BatchKLPartners`, training and validation, every reference
  strategy): the sampler (``data.samplers``) applies the rule to each *global* batch and yields
  ``(index, partner, epoch)``, so KL rows — and z₀ — do not depend on the data-parallel size.
  A precomputed reference is computed for exactly these partners, epoch by epoch
  (``algorithms.precompute``), so `precomputed` trains exactly as `cpu_swap` does.
* **In-batch partners**: ``kto_custom_collate`` without fixed partners applies the same rule to
  its own batch, identifying prompts by their token ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset

#: Most circular shifts tried (rule 1) before the group-sorted permutation (rule 2).
MAX_SHIFT = 32


def partner_positions(keys: Sequence[int] | np.ndarray) -> np.ndarray | None:
    """KL partner of every row of one batch, by position (rules 1-3 of the module docstring).

    Args:
        keys: [G] prompt keys of the batch's rows, in order.

    Returns:
        int64 [G] partner positions with ``keys[partner[i]] != keys[i]``, or None when every
        row has the same prompt (rule 4 is the caller's: it needs rows outside the batch).
    """
    keys = np.asarray(keys)
    g = keys.shape[0]
    positions = np.arange(g)
    for shift in range(1, min(g - 1, MAX_SHIFT) + 1):
        if not np.any(keys == np.roll(keys, -shift)):
            return (positions + shift) % g
    uniques, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
    if len(uniques) < 2:
        return None
    largest = int(counts.max())
    if 2 * largest <= g:
        # Groups contiguous, largest first; moving `largest` places never lands in one's own
        # group, because no group is longer than `largest` and `largest` <= G/2.
        first_seen = np.full(len(uniques), g)
        np.minimum.at(first_seen, inverse, positions)
        order = np.lexsort((positions, first_seen[inverse], -counts[inverse]))
        partners = np.empty(g, dtype=np.int64)
        partners[order] = order[(np.arange(g) + largest) % g]
        return partners
    partners = np.empty(g, dtype=np.int64)
    for i in range(g):
        j = (i + 1) % g
        while keys[j] == keys[i]:
            j = (j + 1) % g
        partners[i] = j
    return partners


def batch_partners(order: np.ndarray, start: int, size: int, keys: np.ndarray) -> list[int]:
    """KL partners (dataset indices) of the batch ``order[start:start + size]`` of a pass.

    Args:
        order: the pass's dataset indices in order (an epoch's order, or 0..N-1 for validation).
        start: the batch's first position in ``order``.
        size: G, the global batch size.
        keys: int64 [N] prompt keys by dataset index.

    Returns:
        The partner's dataset index for each row of the batch, in order.

    Raises:
        ValueError: every example of the pass has the same prompt.
    """
    batch = np.asarray(order[start : start + size])
    positions = partner_positions(keys[batch])
    if positions is not None:
        return batch[positions].tolist()
    # Rule 4: one prompt in the whole batch; borrow from the rows that follow it in the pass.
    prompt = keys[batch[0]]
    following = np.roll(np.asarray(order), -(start + size))
    others = following[keys[following] != prompt]
    if others.size == 0:
        raise ValueError(
            f"all {len(order)} examples have the same prompt, so no KL row can pair a prompt "
            "with a completion written for another one; KTO needs at least two prompts"
        )
    return others[np.arange(size) % others.size].tolist()


def check_distinct_prompts(keys: np.ndarray, where: str) -> None:
    """Refuse KTO data whose examples all share one prompt (no mismatched KL pair exists).

    Args:
        keys: [N] prompt keys.
        where: the config key or file the data comes from, for the message.

    Raises:
        ValueError: fewer than two distinct prompts.
    """
    if keys.size and np.all(keys == keys[0]):
        raise ValueError(
            f"{where}: all {keys.size} examples have the same prompt; the KL term pairs each "
            "prompt with a completion written for another prompt, so KTO needs at least two "
            "distinct prompts (or model.kto.loss_type=apo_zero_unpaired, which has no KL term)"
        )


class BatchKLPartners(Dataset):
    """A view of a KTO dataset indexed by the sampler's ``(index, partner, epoch)`` entries.

    Items carry ``kl_completion_ids`` = the partner's completion. With ``index_offset`` set
    (precomputed reference), they also carry ``index`` (offset + dataset index) and ``epoch``,
    the key of the precomputed reference log-probs of the row and of its KL row.

    Args:
        dataset: a `KTODataset`.
        index_offset: None, or the offset of this split's rows in the precomputed table.
    """

    def __init__(self, dataset: Dataset, index_offset: int | None = None):
        self.dataset = dataset
        self.index_offset = index_offset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int, int]) -> dict[str, Any]:
        index, partner, epoch = key
        item = dict(self.dataset[index])
        item["kl_completion_ids"] = self.dataset[partner]["completion_ids"]
        if self.index_offset is not None:
            item["index"] = index + self.index_offset
            item["epoch"] = epoch
        return item


class IndexedExamples(Dataset):
    """A view of a DPO dataset whose items also carry ``index`` (+ ``index_offset``), the key
    of their precomputed reference log-probs.

    Args:
        dataset: a `DPODataset`.
        index_offset: added to `index` (so several splits can share one lookup table).
    """

    def __init__(self, dataset: Dataset, index_offset: int = 0):
        self.dataset = dataset
        self.index_offset = index_offset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        item = dict(self.dataset[index])
        item["index"] = index + self.index_offset
        return item
