"""Per-layer expert load of the training passes: `load_imbalance/layer_<i>` = (tokens of the
busiest expert) / (mean tokens per expert) of MoE layer i over a step's global batch — 1 is a
perfectly balanced layer, E (the expert count) every token on one expert.

`ExpertLoad(chunks)` hooks every megatron MoE router (`TopKRouter`) of this rank's chunks; the
forward step (`router_stats.announce_micro_batches`) calls `begin(token_mask(batch))` per
micro-batch, so padding is not counted, and the hooks count each expert's tokens only while
autograd is on (the training pass: reference, KL and validation passes are not counted).
`step_values` sums the [layers, experts] counts of the step over the whole world in one
fixed-size all-reduce: data-parallel ranks add their own tokens, pipeline stages their own
layers (zeros elsewhere) and tensor-parallel ranks without sequence parallelism the same tokens
again, a uniform factor the ratio does not see. Not logged under context parallelism
(`expert_load`).
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

PREFIX = "load_imbalance/layer_"
#: The per-batch scalar (`get_loss_and_metric_sums`) holding every layer's ratio.
KEY = "load_imbalance"


class ExpertLoad:
    """Forward hooks counting the tokens routed to each expert of every MoE layer."""

    def __init__(self, chunks: list[torch.nn.Module], num_layers: int):
        """
        Args:
            chunks: this rank's model chunks (unwrapped or wrapped).
            num_layers: the model's layer count (global).
        """
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.utils import get_model_config

        config = get_model_config(chunks[0])
        self._experts = int(config.num_moe_experts)
        self._layers = num_layers
        self._counts: Tensor | None = None
        self._mask: Tensor | None = None
        self._warned = False
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self._tp = tp if config.sequence_parallel and tp > 1 else 1
        self._layer_of: dict[int, int] = {}
        self.moe_layers: list[int] = []
        for chunk in chunks:
            for module in chunk.modules():
                router = getattr(getattr(module, "mlp", None), "router", None)
                if isinstance(router, TopKRouter) and hasattr(module, "layer_number"):
                    self._layer_of[id(router)] = module.layer_number - 1  # 1-based, global
        self._handles = []
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter) and id(module) in self._layer_of:
                    self._handles.append(module.register_forward_hook(self._hook))

    def begin(self, mask: Tensor) -> None:
        """Start a micro-batch whose counted tokens are `mask` ([S, B], `token_mask`)."""
        if self._tp > 1:  # this rank's sequence slice, as megatron's scatter cuts it
            from megatron.core import parallel_state

            mask = mask.chunk(self._tp, dim=0)[parallel_state.get_tensor_model_parallel_rank()]
        self._mask = mask.reshape(-1)

    def finish(self) -> None:
        """End of this stage's forward of the micro-batch."""
        self._mask = None

    def _hook(self, router: torch.nn.Module, args: tuple, output: tuple) -> None:
        if self._mask is None or not torch.is_grad_enabled():
            return
        routing_map = output[1].reshape(-1, self._experts)
        mask = self._mask
        if mask.numel() != routing_map.shape[0]:
            # A layout that reshapes the rows past the forward step (context parallelism):
            # count every routed token, padding included.
            if not self._warned:
                logger.warning(
                    "load_imbalance: the router sees %d tokens, the micro-batch mask %d; "
                    "padding tokens are counted",
                    routing_map.shape[0],
                    mask.numel(),
                )
                self._warned = True
            mask = torch.ones(routing_map.shape[0], device=routing_map.device)
        with torch.no_grad():
            counts = (routing_map.to(torch.float64) * mask.to(torch.float64)[:, None]).sum(0)
            if self._counts is None:
                self._counts = torch.zeros(
                    self._layers, self._experts, dtype=torch.float64, device=counts.device
                )
            self._counts[self._layer_of[id(router)]] += counts

    def step_values(self, device: torch.device) -> dict[str, Tensor]:
        """{`KEY`: [layers] max / mean tokens per expert of every layer over the step's training
        passes (0 for a dense layer)}, the same on every rank — a world all-reduce: every rank
        calls it at the same point; resets. Stays on the device (no host read)."""
        counts = self._counts
        if counts is None:
            counts = torch.zeros(self._layers, self._experts, dtype=torch.float64, device=device)
        self._counts = None
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(counts)
        ratio = counts.max(dim=1).values / counts.mean(dim=1).clamp(min=1e-30)
        return {KEY: ratio}

    def remove(self) -> None:
        """Detach the hooks."""
        for handle in self._handles:
            handle.remove()


def add_load_metrics(metrics: dict[str, float], scalars: dict[str, Tensor]) -> dict[str, float]:
    """`metrics` with `load_imbalance/layer_<i>` for every layer that routed tokens (one host
    read of the [layers] ratios in `scalars`, when present)."""
    if KEY in scalars:
        for layer, value in enumerate(scalars[KEY].tolist()):
            if value > 0:
                metrics[f"{PREFIX}{layer}"] = value
    return metrics


def expert_load(chunks: list[torch.nn.Module]) -> ExpertLoad | None:
    """The expert-load counter of a mixture-of-experts model's chunks; None for a dense one, and
    under context parallelism, where a forward step sees its rank's reordered share of each row
    and `token_mask` cannot tell padding from tokens."""
    from megatron.core.utils import get_model_config

    config = get_model_config(chunks[0])
    if not config.num_moe_experts or config.context_parallel_size > 1:
        return None
    return ExpertLoad(chunks, config.num_layers)
