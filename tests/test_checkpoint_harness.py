"""Shared pieces of the checkpoint tests (no tests here): a tiny trainable GPT on any layout.

`Run` builds model chunks (megatron DDP), the megatron optimizer (standard or distributed) and
an `OptimizerParamScheduler` for a layout; `Run.step()` trains one global batch through
megatron-core's schedule. Every DP rank trains on the same global batch, so the gradient — and
hence every weight — is the same whatever the layout (up to float rounding), which is what
makes cross-layout comparisons meaningful.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks, unwrap
from megatron_kto.models.schedule import run_schedule, split_micro_batches
from megatron_kto.runtime import init_runtime

SEQ_LEN = 16
BATCH = 4
MICRO_BATCH = 2


def tiny_arch(dropout: float = 0.0, num_layers: int = 2) -> GPTArchitecture:
    """2 layers by default (PP=2 gives one per stage), 64 embedding rows at TP=1 and TP=2 alike."""
    return GPTArchitecture(
        num_layers=num_layers,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        encoder_seq_length=SEQ_LEN,
        vocab_size=60,
        padded_vocab_size=64,
        init_method_std=0.1,
        hidden_dropout=dropout,
        attention_dropout=dropout,
    )


def make_batch(step: int, vocab: int = 60) -> dict[str, torch.Tensor]:
    """The global batch of `step`: independent of the global RNG and of the layout."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (BATCH, SEQ_LEN + 1), generator=g)
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "position_ids": torch.arange(SEQ_LEN).expand(BATCH, SEQ_LEN).contiguous(),
    }


def _loss(output: torch.Tensor, non_loss_data: bool = False) -> tuple[torch.Tensor, dict]:
    loss = output.float().mean()  # GPTModel with labels returns per-token cross entropy
    return loss, {"loss": loss.detach().clone()}


def _forward_step(data_iter: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    b = next(data_iter)
    return model(b["tokens"], b["position_ids"], None, labels=b["labels"]), partial(_loss)


@dataclass
class Run:
    """Model chunks + optimizer + scheduler of one rank."""

    chunks: list[torch.nn.Module]
    optimizer: Any
    scheduler: OptimizerParamScheduler
    arch: GPTArchitecture

    def step(self, step: int) -> None:
        """Train on the global batch of `step` (forward, backward, optimizer, scheduler)."""
        for c in self.chunks:
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        run_schedule(
            self.chunks,
            split_micro_batches(make_batch(step), MICRO_BATCH),
            _forward_step,
            forward_only=False,
        )
        ok, _, _ = self.optimizer.step()
        assert ok
        self.scheduler.step(increment=1)

    def params(self) -> dict[str, torch.Tensor]:
        """This rank's parameter shards by name (clones)."""
        out = {}
        for i, c in enumerate(self.chunks):
            for name, p in unwrap(c).named_parameters():
                out[f"{i}.{name}"] = p.detach().clone()
        return out


def build_run(
    tp: int = 1,
    pp: int = 1,
    distributed_optimizer: bool = False,
    seed: int = 1,
    dropout: float = 0.0,
    vpp: int | None = None,
    num_layers: int = 2,
    precision: str = "32",
) -> Run:
    """(Re)initialise megatron's parallel state for the layout and build a fresh `Run`.

    `precision="bf16"` gives bf16 parameters with fp32 main weights in the optimizer.
    """
    rt = init_runtime(tp, pp, vpp, seed=seed)
    arch = tiny_arch(dropout, num_layers)
    layout = ParallelLayout(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        precision=precision,
    )
    chunks = build_gpt_chunks(arch, layout, rt.device)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer
    )
    config = chunks[0].config
    chunks = [
        DistributedDataParallel(
            config=config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0
        )
        for i, c in enumerate(chunks)
    ]
    config.no_sync_func = chunks[0].no_sync if len(chunks) == 1 else [c.no_sync for c in chunks]
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-2,
            min_lr=1e-3,
            weight_decay=0.1,
            clip_grad=1.0,
            bf16=precision == "bf16",
            params_dtype=torch.bfloat16 if precision == "bf16" else torch.float32,
            use_distributed_optimizer=distributed_optimizer,
        ),
        chunks,
    )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=1e-2,
        min_lr=1e-3,
        lr_warmup_steps=2,
        lr_decay_steps=10,
        lr_decay_style="cosine",
        start_wd=0.1,
        end_wd=0.1,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    return Run(chunks, optimizer, scheduler, arch)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest element difference between two same-keyed tensor dicts."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Same keys and bit-identical tensors."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class LogCapture:
    """Collect warning records of the checkpointing package inside a spawned rank."""

    def __init__(self) -> None:
        import logging

        self.records: list[str] = []
        handler = logging.Handler(level=logging.WARNING)
        handler.emit = lambda record: self.records.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("megatron_kto.checkpointing").addHandler(handler)

    def take(self) -> list[str]:
        """Messages since the last call."""
        out, self.records = self.records, []
        return out


def params_from_model_checkpoint(path: Any, run: Run) -> dict[str, torch.Tensor]:
    """Load a model-only checkpoint into fresh chunks of `run`'s layout; their params by name."""
    from megatron.core import parallel_state

    from megatron_kto.checkpointing.model_io import load_model

    layout = ParallelLayout(
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=(
            parallel_state.get_virtual_pipeline_model_parallel_world_size()
        ),
    )
    chunks = build_gpt_chunks(run.arch, layout, torch.device("cpu"))
    load_model(path, chunks)
    return {
        f"{i}.{name}": p.detach().clone()
        for i, c in enumerate(chunks)
        for name, p in unwrap(c).named_parameters()
    }
