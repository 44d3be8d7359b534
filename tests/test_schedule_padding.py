"""`schedule.pad_sequence_dim`: the right-padding that sequence parallelism needs (no model)."""

from __future__ import annotations

import pytest
import torch

from megatron_kto.models.logprobs import IGNORE_INDEX
from megatron_kto.models.schedule import pad_sequence_dim


def _micro(length: int) -> dict[str, torch.Tensor]:
    tokens = torch.arange(2 * length).view(2, length) + 5
    labels = tokens.roll(-1, 1)
    labels[:, -1] = IGNORE_INDEX
    return {
        "tokens": tokens,
        "labels": labels,
        "position_ids": torch.arange(length).repeat(2, 1),
        "preference": torch.tensor([1, 0]),
        "ref_logps": torch.tensor([-3.0, -4.0]),
    }


def test_pads_sequence_keys_on_the_right_and_keeps_row_keys():
    batch = _micro(7)
    out = pad_sequence_dim(batch, 4)
    assert out["tokens"].shape == out["labels"].shape == out["position_ids"].shape == (2, 8)
    assert torch.equal(out["tokens"][:, :7], batch["tokens"]) and (out["tokens"][:, 7] == 0).all()
    assert torch.equal(out["labels"][:, :7], batch["labels"])
    assert (out["labels"][:, 7] == IGNORE_INDEX).all(), "padding carries no loss"
    assert (out["position_ids"][:, 7] == 0).all(), "a valid position id"
    assert out["preference"] is batch["preference"] and out["ref_logps"] is batch["ref_logps"]
    assert batch["tokens"].shape == (2, 7), "the input batch is not modified"


def test_no_copy_when_the_length_already_divides():
    batch = _micro(8)
    assert pad_sequence_dim(batch, 4) is batch
    assert pad_sequence_dim(_micro(7), 1)["tokens"].shape == (2, 7)


def test_unknown_sequence_key_is_refused():
    batch = _micro(5) | {"loss_mask": torch.ones(2, 5)}
    with pytest.raises(ValueError, match="'loss_mask'"):
        pad_sequence_dim(batch, 2)
