"""TRL's ORPO NLL: the chosen rows' prompt tokens scored too, for the NLL only.

TRL 1.16's `ORPOTrainer` takes its NLL term over every real token of the chosen sequence but the
first (prompt and completion: `concatenated_forward`'s cross-entropy on the unmasked input ids),
while the odds ratio reads the completion's log-probs alone. Our labels score the completion
only, so `with_prompt_nll` widens the chosen rows' labels to every position of the row and marks
the added ones `NLL_ONLY`: the statistics then keep the completion's sums in their first columns
and give the whole row's in the NLL columns (`forward.NLL_LOGP_SUM`), from one forward pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_kto.models.logprobs import IGNORE_INDEX
from megatron_kto.models.packing import kept_lengths
from megatron_kto.models.schedule import HOST_SCORED, HOST_SPANS, Batch, row_lengths

#: Batch key: [B, T] float, 1 where a chosen row's label is scored for the NLL only.
CHOSEN_NLL_ONLY = "chosen_nll_only"


def prompt_scored_labels(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Labels that score every position of each row: the next input token where `labels` has
    none (the prompt's targets), `labels` itself where it has one; right padding stays unscored.

    Args:
        tokens: [B, T] input tokens (a row is its sequence without the final token).
        labels: [B, T] next-token targets, `IGNORE_INDEX` on prompt and padding positions.
    """
    in_row = torch.arange(labels.shape[1], device=labels.device) < kept_lengths(labels)[:, None]
    following = F.pad(tokens[:, 1:], (0, 1), value=IGNORE_INDEX)
    prompt = torch.where(in_row, following, torch.full_like(following, IGNORE_INDEX))
    return torch.where(labels != IGNORE_INDEX, labels, prompt)


def with_prompt_nll(batch: Batch) -> Batch:
    """`batch` with its chosen rows' prompt targets scored and marked (`CHOSEN_NLL_ONLY`).

    The host facts `to_device` recorded for `chosen_labels` are updated without reading the
    device: a row of kept length k now scores its positions 0 .. k − 1.
    """
    labels = batch["chosen_labels"]
    full = prompt_scored_labels(batch["chosen"], labels)
    out = dict(batch)
    out["chosen_labels"] = full
    out[CHOSEN_NLL_ONLY] = ((full != IGNORE_INDEX) & (labels == IGNORE_INDEX)).to(torch.float32)
    kept = row_lengths(batch, "chosen_labels")
    for key, facts in ((HOST_SCORED, kept), (HOST_SPANS, [((0, k),) for k in kept])):
        if key in batch:
            out[key] = {**batch[key], "chosen_labels": facts}
    return out
