"""The reference-free step (ORPO) packed vs padded on one process (fp32), and the labels of
TRL's ORPO NLL over the prompt (`models.prompt_nll`); the set-up of `test_packing.py`."""

from __future__ import annotations

import pytest
import torch
from test_packing import TOL, _dpo_settings, _grads, _models, _pairs_batch, _TokenCounter

from megatron_kto.models.dpo_model import MegatronGPTDPOModel
from megatron_kto.models.schedule import to_device
from megatron_kto.runtime import init_runtime, teardown


@pytest.fixture(scope="module")
def runtime():
    yield init_runtime(1, 1, seed=5)
    teardown()


def test_prompt_scored_labels_hand_example():
    """Rows 'p1 p2 c1 c2' (input p1 p2 c1, labels − c1 c2) and 'p1 c1' + 2 padding (input p1 _ _,
    labels c1 − −): the prompt's targets are the following inputs, padding stays unscored, and
    the NLL-only marks are exactly the added positions."""
    from megatron_kto.models.prompt_nll import CHOSEN_NLL_ONLY, with_prompt_nll
    from megatron_kto.models.schedule import HOST_SCORED, HOST_SPANS

    tokens = torch.tensor([[11, 12, 21], [11, 0, 0]])
    labels = torch.tensor([[-100, 21, 22], [21, -100, -100]])
    batch = to_device({"chosen": tokens, "chosen_labels": labels}, torch.device("cpu"))
    out = with_prompt_nll(batch)
    assert out["chosen_labels"].tolist() == [[12, 21, 22], [21, -100, -100]]
    assert out[CHOSEN_NLL_ONLY].tolist() == [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert out[HOST_SCORED]["chosen_labels"] == [3, 1]
    assert out[HOST_SPANS]["chosen_labels"] == [((0, 3),), ((0, 1),)]
    assert torch.equal(batch["chosen_labels"], labels)  # the batch given is left as it was


def test_reference_free_step_packed_equals_padded(runtime):
    """ORPO (reference-free): the step is one forward+backward of the policy — the positions fed
    equal the rows' once, its reference refuses any call — with chunked log-probs, packed equal
    to padded: loss, TRL's metrics (``nll_loss``, ``log_odds_*``) and gradients; with TRL's NLL
    over the prompt too (``prompt_nll``) the full-logits pass (chunk size 0) equals them."""
    from megatron_kto.algorithms.reference_strategies import NoReferencePolicy

    batch = _pairs_batch(runtime, seed=5)
    real = int(batch["chosen_lengths"].sum() + batch["rejected_lengths"].sum())
    out = {}
    for pack, prompt_nll, chunk in ((False, False, 4), (True, False, 4), (False, True, 4),
                                    (True, True, 4), (False, True, 0), (True, True, 0)):  # fmt: skip
        chunks, _ = _models(runtime)
        settings = _dpo_settings(
            loss_type="orpo", average_log_probs=True, logprob_chunk_size=chunk,
            pack_sequences=pack, prompt_nll=prompt_nll,
        )  # fmt: skip
        model = MegatronGPTDPOModel(chunks, NoReferencePolicy("orpo"), settings)
        assert not model.needs_reference
        counter = _TokenCounter(chunks)
        for c in chunks:
            c.zero_grad_buffer()
        _, metrics = model.get_loss_and_metrics(dict(batch), forward_only=False)
        out[pack, prompt_nll, chunk] = (metrics, _grads(chunks), counter.positions)
    for prompt_nll in (False, True):
        (m_a, g_a, n_a), (m_b, g_b, n_b) = out[False, prompt_nll, 4], out[True, prompt_nll, 4]
        assert n_a == batch["chosen"].numel() + batch["rejected"].numel() and n_b == real
        assert {"nll_loss", "log_odds_ratio", "log_odds_chosen"} <= m_a.keys()
        for other in [(m_b, g_b)] + [out[p, True, 0][:2] for p in (False, True) if prompt_nll]:
            for name, want in m_a.items():
                assert abs(other[0][name] - want) <= TOL * max(1.0, abs(want)), name
            for name, want in g_a.items():
                assert (other[1][name] - want).abs().max() <= TOL * want.abs().max(), name
    # The prompt's targets change the NLL (and so the loss), not the odds ratio.
    plain, trl = out[False, False, 4][0], out[False, True, 4][0]
    assert plain["log_odds_ratio"] == pytest.approx(trl["log_odds_ratio"], rel=1e-6)
    assert plain["nll_loss"] != pytest.approx(trl["nll_loss"], rel=1e-3)
