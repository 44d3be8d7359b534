"""Where a KTO example's KL partner comes from, when it is not the collate's in-batch shift.

Two rules, both the circular shift of DESIGN §1 over a well-defined sequence of examples:

* **Global-batch partners** (`BatchKLPartners`, the default for training and validation): the
  sampler yields ``(index, partner)`` pairs whose partner is the next row of the *global* batch
  (``data.samplers.rank_share``). Collating only this rank's share would otherwise shift
  within the share, so the KL rows — and z₀ — would change with the data-parallel size.

* **Dataset-order partners** (`IndexedExamples`), for reference log-probs precomputed once per
  dataset:

With `model.kto.reference_policy=precomputed` the reference log-probs of every sample row and
KL row are computed in one pass before training and looked up by dataset index afterwards. The
KL row of an example must then not depend on which batch it lands in, so instead of the
in-batch circular shift, example i of an N-example dataset is paired with the completion of
example (i + 1) mod N — the same circular-shift rule, applied over the whole dataset in index
order. Like the in-batch rule it never pairs a row with its own completion (for N >= 2), and the
set of KL completions equals the dataset's completions.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset


class BatchKLPartners(Dataset):
    """A view of a KTO dataset indexed by ``(index, partner)`` pairs (from a sampler built with
    ``kl_partners=True``); items carry ``kl_completion_ids`` = the partner's completion.

    Args:
        dataset: a `KTODataset`.
    """

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> dict[str, Any]:
        index, partner = key
        item = dict(self.dataset[index])
        item["kl_completion_ids"] = self.dataset[partner]["completion_ids"]
        return item


class IndexedExamples(Dataset):
    """A view of a KTO or DPO dataset whose items also carry `index` (+ `index_offset`) and,
    for KTO, `kl_completion_ids` = the completion of item (i + 1) mod N.

    Args:
        dataset: a `KTODataset` or `DPODataset`.
        index_offset: added to `index` (so several splits can share one lookup table).
        fixed_kl_pairs: attach `kl_completion_ids` (KTO).
    """

    def __init__(self, dataset: Dataset, index_offset: int = 0, fixed_kl_pairs: bool = True):
        self.dataset = dataset
        self.index_offset = index_offset
        self.fixed_kl_pairs = fixed_kl_pairs

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        item = dict(self.dataset[index])
        item["index"] = index + self.index_offset
        if self.fixed_kl_pairs:
            partner = self.dataset[(index + 1) % len(self.dataset)]
            item["kl_completion_ids"] = partner["completion_ids"]
        return item
