"""Order-independent KL pairs, for reference log-probs precomputed once per dataset.

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
