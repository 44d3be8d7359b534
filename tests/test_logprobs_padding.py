"""Padded vocabulary columns are not tokens: log-probs and mean logits ignore them."""

from __future__ import annotations

import pytest
import torch

from megatron_kto.models.forward import LOGIT_SUM, LOGP_SUM, sequence_stats
from megatron_kto.models.logprobs import IGNORE_INDEX, token_logprobs
from megatron_kto.runtime import init_runtime, teardown

VOCAB, PADDED = 100, 128


@pytest.fixture(scope="module", autouse=True)
def runtime():
    rt = init_runtime(1, 1, seed=0)
    yield rt
    teardown()


def _inputs():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 6, PADDED, generator=g) * 3
    logits[..., VOCAB:] = 9.0  # large padded logits: they would dominate if they counted
    labels = torch.randint(0, VOCAB, (2, 6), generator=g)
    labels[:, :2] = IGNORE_INDEX
    return logits, labels


def test_padded_columns_are_left_out_of_the_softmax():
    logits, labels = _inputs()
    mask = labels != IGNORE_INDEX
    want = torch.log_softmax(logits[..., :VOCAB].double(), -1)
    want = want.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * mask
    got = token_logprobs(logits.clone(), labels, VOCAB)
    assert torch.allclose(got.double(), want, atol=1e-5)
    everything = token_logprobs(logits.clone(), labels)  # no vocab_size: all 128 columns
    assert (everything - got)[mask].max() < -1.0  # so the test above can tell the difference


def test_masked_logits_still_get_gradients_on_real_columns_only():
    logits, labels = _inputs()
    logits.requires_grad_()
    token_logprobs(logits, labels, VOCAB).sum().backward()
    assert (logits.grad[..., VOCAB:] == 0).all()
    assert logits.grad[..., :VOCAB].abs().sum() > 0


def test_sequence_stats_mean_logit_over_real_columns():
    logits, labels = _inputs()
    stats = sequence_stats(logits.clone(), labels, VOCAB)
    mask = labels != IGNORE_INDEX
    want = (logits[..., :VOCAB].mean(-1) * mask).sum(-1)
    assert torch.allclose(stats[:, LOGIT_SUM], want, atol=1e-4)
    assert torch.allclose(
        stats[:, LOGP_SUM], token_logprobs(logits.clone(), labels, VOCAB).sum(-1), atol=1e-5
    )
