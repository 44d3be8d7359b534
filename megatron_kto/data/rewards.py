"""The pairs' rewards from the data, for NeMo-Aligner's RPO losses (`model.dpo.loss_type`
`rpo_sq`, `rpo_fwd_kl`, `rpo_bwd_kl`).

A paired row may carry `chosen_reward` and `rejected_reward` (numbers; `formats` refuses any other
type in one line naming the row and the field). The tokenised shards keep them per pair (NaN
where absent); here they become one [pairs, 2] table. As in NeMo-Aligner, a row without a reward
takes `model.data.default_chosen_reward` / `default_rejected_reward` when set; when unset, the
first such row is named in one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from megatron_kto.config.errors import ConfigError
from megatron_kto.data.formats import REWARD_FIELDS
from megatron_kto.data.provenance import row_sources


def pair_rewards(
    dataset,
    paths: Sequence[Path],
    defaults: tuple[float | None, float | None],
    loss_type: str,
) -> np.ndarray:
    """[pairs, 2] float64 (chosen, rejected) rewards of a DPO dataset's pairs, in index order.

    Args:
        dataset: a `DPODataset` (its shards hold the rows' rewards).
        paths: its files, in shard order (to name a row).
        defaults: `model.data.default_chosen_reward` / `default_rejected_reward` (None: a
            missing reward is an error).
        loss_type: the loss that reads them, for the message.

    Raises:
        ConfigError: `file:line: chosen_reward: missing ...` for the first row without a reward
            and no default.
    """
    parts = [np.asarray(s.rewards, dtype=np.float64).reshape(-1, 2) for s in dataset.shards]
    rewards = np.concatenate(parts) if parts else np.zeros((0, 2))
    for column, (field, default) in enumerate(zip(REWARD_FIELDS, defaults, strict=True)):
        missing = np.isnan(rewards[:, column])
        if not missing.any():
            continue
        if default is None:
            (where,) = row_sources(dataset, paths, "dpo", [int(np.argmax(missing))])
            raise ConfigError(
                f"{where}: {field}: missing; model.dpo.loss_type {loss_type!r} reads each pair's "
                f"{' and '.join(REWARD_FIELDS)}: add them to every row or set "
                f"model.data.default_{field}"
            )
        rewards[missing, column] = default
    return rewards
