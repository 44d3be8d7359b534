"""Shared pieces of the multi-rank equivalence tests (no tests here).

The model, batch, forward step and DP/PP result plumbing used by `test_parallel_logprobs.py`
and `test_parallel_optimizer.py`; the named layouts run inside one 4-rank spawn each.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.models.builder import ParallelLayout
from megatron_kto.models.logprobs import IGNORE_INDEX, masked_sum, token_logprobs

SEQ_LEN = 16
GLOBAL_BATCH = 8


def tiny_arch(**overrides: Any) -> GPTArchitecture:
    """4 layers (so PP=2 x VPP=2 has one layer per chunk), GQA with 2 KV groups, RoPE, SwiGLU.

    `padded_vocab_size` is fixed so TP=1 and TP=2 have the same embedding rows (otherwise the
    TP-dependent padding would make the checkpoints incompatible). A larger init std than the
    default makes the next-token distributions far from uniform, so a layout bug cannot hide
    in near-constant log-probs.
    """
    fields: dict[str, Any] = dict(
        num_layers=4,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        encoder_seq_length=SEQ_LEN,
        vocab_size=120,
        padded_vocab_size=128,
        init_method_std=0.1,
    )
    fields.update(overrides)
    return GPTArchitecture(**fields)


def gemma3_arch(**overrides: Any) -> GPTArchitecture:
    """`tiny_arch` with Gemma 3's layers: sliding window 5 in layers 1 and 3 (of 4), a local RoPE
    base there and linear scaling on the full layers, (1 + w) pre-, post- and Q/K norms, GeGLU,
    scaled embeddings and scores, head dim 32 (not hidden / heads)."""
    fields: dict[str, Any] = dict(
        activation="geglu",
        zero_centered_norms=True,
        post_norms=True,
        qk_layernorm=True,
        embedding_multiplier=8.0,
        softmax_scale=0.2,
        kv_channels=32,
        rotary_base=1_000_000,
        rotary_base_local=10_000,
        rotary_interpolation_factor=8.0,
        sliding_window=5,
        window_layers=[1, 0, 1, 0],
    )
    fields.update(overrides)
    return tiny_arch(**fields)


@dataclass(frozen=True)
class Layout:
    """A named parallel layout on a world of 4 (DP is whatever TP x PP leaves)."""

    name: str
    tp: int
    pp: int
    vpp: int | None = None

    def parallel_layout(self) -> ParallelLayout:
        return ParallelLayout(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.vpp,
        )


def make_batch(vocab_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A global batch of GLOBAL_BATCH rows: tokens, position ids and masked next-token labels.

    Row i has a prompt of 3 + i % 4 tokens (labels masked), then completion tokens, then right
    padding on odd rows — so masks differ per row and per micro-batch.
    """
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (GLOBAL_BATCH, SEQ_LEN), generator=g)
    labels = torch.full_like(tokens, IGNORE_INDEX)
    labels[:, :-1] = tokens[:, 1:]
    for i in range(GLOBAL_BATCH):
        prompt = 3 + i % 4
        labels[i, : prompt - 1] = IGNORE_INDEX
        if i % 2:
            labels[i, SEQ_LEN - 4 :] = IGNORE_INDEX
    position_ids = torch.arange(SEQ_LEN).expand(GLOBAL_BATCH, SEQ_LEN).contiguous()
    return {"samples": tokens, "position_ids": position_ids, "labels": labels}


def dp_shard(batch: dict[str, torch.Tensor], dp_rank: int, dp_size: int) -> dict:
    """This DP rank's contiguous slice of the global batch."""
    rows = GLOBAL_BATCH // dp_size
    return {k: v[dp_rank * rows : (dp_rank + 1) * rows] for k, v in batch.items()}


def collect_logprobs(b: dict, output: torch.Tensor, non_loss_data: bool = False) -> torch.Tensor:
    """Forward-only loss function: per-token log-probs of the micro-batch."""
    assert non_loss_data, "collect_logprobs is for forward-only schedules"
    return token_logprobs(output, b["labels"]).detach()


def logprob_forward_step(data_iter, model):
    """megatron-core forward step returning per-token log-probs as non-loss data."""
    b = next(data_iter)
    out = model(b["samples"], b["position_ids"], None)
    return out, partial(collect_logprobs, b)


def mean_completion_logprob_loss(
    b: dict, output: torch.Tensor, non_loss_data: bool = False
) -> tuple[torch.Tensor, dict]:
    """Training loss: mean over the micro-batch's rows of a nonlinear function of ℓ(y|x).

    ℓ = summed completion log-prob per row; loss = mean(-ℓ + 0.1·ℓ²/T) (the square makes the
    per-row gradient weight depend on the row's value, so a mis-scaled or mis-routed row would
    show). Being a per-micro-batch *mean*, megatron's in-place division by num_microbatches and
    DDP's averaging over DP turn the gradient into that of the global-batch mean.
    """
    seq_logp, _ = masked_sum(token_logprobs(output, b["labels"]), b["labels"])
    loss = (-seq_logp + 0.1 * seq_logp.square() / SEQ_LEN).mean()
    return loss, {"loss": loss.detach().clone()}


def train_forward_step(data_iter, model):
    """megatron-core forward step for training with `mean_completion_logprob_loss`."""
    b = next(data_iter)
    out = model(b["samples"], b["position_ids"], None)
    return out, partial(mean_completion_logprob_loss, b)


def gather_over_dp(local: torch.Tensor) -> torch.Tensor:
    """Concatenate equally shaped per-DP-rank tensors in DP-rank order (fixed-size all-gather)."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts)


def kto_train_step(model: Any, chunks: list, batch: dict) -> tuple[torch.Tensor, Any, dict]:
    """Reference pass, then one forward+backward KTO pass of `model` (a `MegatronGPTKTOModel`)
    on `batch` with zeroed gradient buffers: (reference log-probs, loss, metrics)."""
    from megatron_kto.models.kto_model import REF_KL, REF_SAMPLES

    refs = model.get_ref_policy_logprobs(batch)
    rows = batch["samples"].shape[0]
    batch[REF_SAMPLES], batch[REF_KL] = refs[:rows], refs[rows:]
    for c in chunks:
        c.zero_grad_buffer()
    loss, metrics = model.get_loss_and_metrics(batch, forward_only=False)
    return refs, loss, metrics
