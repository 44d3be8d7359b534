"""The router load-balancing loss (`losses.router_aux`) against Hugging Face's own function.

`transformers`' `load_balancing_loss_func` (Qwen3-MoE's; Mixtral's is the same formula) is the
reference: random router logits of 3 layers, 8 experts, top-2, a padding mask. Value and the
gradient with respect to every logit must agree — the statistics are summed layer by layer and
token by token in our version, jointly in theirs.
"""

from __future__ import annotations

import pytest
import torch

from megatron_kto.losses.router_aux import balance_loss, layer_sums

LAYERS, TOKENS, EXPERTS, TOPK = 3, 40, 8, 2


def _ours(logits: list[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    sums = None
    for layer in logits:
        top = layer.topk(TOPK, dim=-1).indices
        selected = torch.zeros_like(layer, dtype=torch.bool).scatter_(1, top, True)
        part = layer_sums(layer, selected, mask)
        sums = list(part) if sums is None else [a + b for a, b in zip(sums, part, strict=True)]
    return balance_loss(*sums)


@pytest.mark.parametrize("masked", [False, True], ids=["no-padding", "padding"])
def test_value_and_gradient_equal_transformers(masked):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    g = torch.Generator().manual_seed(0)
    base = [torch.randn(TOKENS, EXPERTS, generator=g) * 2 for _ in range(LAYERS)]
    mask = torch.ones(2, TOKENS // 2)
    if masked:
        mask[0, 15:] = 0
        mask[1, 18:] = 0
    ours_in = [t.clone().requires_grad_() for t in base]
    theirs_in = [t.clone().requires_grad_() for t in base]
    ours = _ours(ours_in, mask.reshape(-1))
    theirs = load_balancing_loss_func(
        tuple(theirs_in), EXPERTS, TOPK, mask.long() if masked else None
    )
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    ours.backward()
    theirs.backward()
    for a, b in zip(ours_in, theirs_in, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-8)
    if masked:  # padding tokens get no gradient
        assert not ours_in[0].grad[15:20].any()


def test_order_and_micro_layering_do_not_matter():
    g = torch.Generator().manual_seed(1)
    logits = [torch.randn(TOKENS, EXPERTS, generator=g) for _ in range(LAYERS)]
    mask = torch.ones(TOKENS)
    perm = torch.randperm(TOKENS, generator=g)
    assert _ours(logits, mask).item() == pytest.approx(
        _ours([t[perm] for t in logits], mask).item(), rel=1e-6
    )
    assert balance_loss(torch.zeros(EXPERTS), torch.zeros(EXPERTS), torch.tensor(0.0)) == 0


def test_training_rows_run_the_whole_sequence():
    """`append_final_tokens`: each row's input becomes its whole sequence (TRL's input ids), at
    positions 0..len-1, nothing more scored; packing keeps exactly those tokens."""
    from megatron_kto.data.collate import kto_custom_collate
    from megatron_kto.models.packing import LABEL_WEIGHTS, PACKED, pack_micro_batch
    from megatron_kto.models.router_stats import append_final_tokens, token_mask

    examples = [
        {"prompt_ids": [5, 6, 7], "completion_ids": [8, 9], "label": True},
        {"prompt_ids": [10], "completion_ids": [11, 12, 13, 14], "label": False},
        {"prompt_ids": [15, 16], "completion_ids": [17], "label": True},
    ]
    batch = kto_custom_collate(examples, pad_id=0)
    micro = {
        "tokens": batch["samples"],
        "labels": batch["sample_labels"],
        "position_ids": batch["position_ids"],
        "row_lengths": batch["sample_lengths"].tolist(),
    }
    out = append_final_tokens(micro)
    sequences = [e["prompt_ids"] + e["completion_ids"] for e in examples]
    assert out["row_lengths"] == [len(s) for s in sequences]
    for row, seq in enumerate(sequences):
        assert out["tokens"][row, : len(seq)].tolist() == seq
        assert out["position_ids"][row, : len(seq)].tolist() == list(range(len(seq)))
    assert torch.equal(out["labels"][:, :-1], micro["labels"])
    assert (out["labels"][:, -1] == -100).all()
    mask = token_mask(out).t()  # [rows, T + 1]
    assert mask.sum(-1).tolist() == [len(s) for s in sequences]
    packed = pack_micro_batch(out, out["row_lengths"])
    assert packed["tokens"][0].tolist() == [t for s in sequences for t in s]
    assert token_mask(packed).sum().item() == sum(map(len, sequences))
    assert packed[PACKED].seqlens == tuple(len(s) for s in sequences)
    # LD-DPO's per-position weights follow the labels: one unscored (0) column more, packed along.
    weighted = append_final_tokens({**micro, LABEL_WEIGHTS: (micro["labels"] != -100) * 0.5})
    assert torch.equal(weighted[LABEL_WEIGHTS], (out["labels"] != -100) * 0.5)
    packed = pack_micro_batch(weighted, weighted["row_lengths"])
    assert torch.equal(packed[LABEL_WEIGHTS], (packed["labels"] != -100) * 0.5)
