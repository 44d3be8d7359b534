"""The router load-balancing loss of Hugging Face's MoE models (Switch Transformer eqs. 4-6).

Hugging Face (`load_balancing_loss_func` of Mixtral / Qwen2-MoE / Qwen3-MoE) computes it over one
forward pass — every layer's router, every non-padding token of the batch — jointly:

    f_e = (top-k selections of expert e, summed over layers and tokens) / (L · N)
    P_e = (softmax router probability of e, summed over layers and tokens) / (L · N)
    loss = E · Σ_e f_e · P_e

with N the non-padding tokens, L the MoE layers, E the experts. f carries no gradient. It is not
an average of per-layer losses (a product of sums over layers), and it does not divide by k — so
megatron-core's per-layer `switch_load_balancing_loss_func` (which divides by k and averages
layers) cannot give it; the per-layer sums below can, added up in any order.
TRL's `KTOTrainer` (and `DPOTrainer`) adds `router_aux_loss_coef · loss` of the policy's forward
over each micro-batch — whole sequences, final token included, under their attention mask — to
that micro-batch's training loss; so do we (`models.router_stats`, which runs the final token in
training passes for it), with the same tokens counted.
"""

from __future__ import annotations

import torch
from torch import Tensor


def layer_sums(logits: Tensor, selected: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One router's contribution: (selection counts [E], probability sums [E], tokens []).

    Args:
        logits: [N, E] router logits (any float dtype; the softmax runs in float32, as HF's).
        selected: [N, E] bool, the experts each token is routed to (its top-k).
        mask: [N] 1 for tokens that count, 0 for padding.
    """
    weight = mask.to(torch.float32)
    probs = torch.softmax(logits.float(), dim=-1)
    counts = (selected.to(torch.float32) * weight[:, None]).sum(0)
    return counts, (probs * weight[:, None]).sum(0), weight.sum()


def balance_loss(counts: Tensor, prob_sums: Tensor, tokens: Tensor) -> Tensor:
    """E · Σ_e f_e · P_e from summed `layer_sums` (tokens summed over layers too: L · N).

    Returns 0 when no token counted (an empty micro-batch contributes nothing).
    """
    rows = tokens.clamp(min=1.0)
    return counts.shape[-1] * ((counts.detach() / rows) * (prob_sums / rows)).sum()
