"""RMSNorm / LayerNorm for megatron-core's local layer spec that also work with sequence parallelism.

Without Apex or Transformer Engine, megatron-core's local spec builds its norms with
`WrappedTorchNorm`, which refuses `sequence_parallel=True` (megatron/core/transformer/
torch_norm.py). Under sequence parallelism each TP rank normalises only its slice of the sequence,
so the gradient of a norm's weight (and bias) on one rank covers only those positions; megatron-core
sums such gradients over the TP group in `finalize_model_grads`
(`_allreduce_non_tensor_model_parallel_grads`) for every parameter whose `sequence_parallel`
attribute is true — Apex's and TE's norms set that attribute, and so does this one.

The computation is `torch.nn.functional.rms_norm` / `layer_norm`, the same kernels
`torch.nn.RMSNorm` / `torch.nn.LayerNorm` call, so results are bit-identical to the modules
megatron's local spec would have built, and the state-dict keys (`weight`, `bias`) are the same.

Zero-centered RMSNorm (`config.layernorm_zero_centered_gamma`, Gemma's `(1 + w)` norms): the
weight starts at 0 and scales by `1 + w`; as `transformers`' Gemma norms, it normalises and scales
in fp32 and casts back to the input's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig


class LocalNorm(torch.nn.Module):
    """`config.normalization` ('RMSNorm' or 'LayerNorm') over the last dimension."""

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool | None = None,
        normalization: str | None = None,
    ):
        """
        Args:
            config: the model's transformer config (normalization, sequence_parallel, dtype).
            hidden_size: size of the normalised (last) dimension.
            eps: added to the variance.
            persist_layer_norm: Apex kernel option; must be False here.
            zero_centered_gamma: scale by `1 + weight` (RMSNorm only); None: as
                `config.layernorm_zero_centered_gamma` says.
            normalization: overrides `config.normalization` (megatron's builders may pass it).
        """
        super().__init__()
        kind = normalization or config.normalization
        if kind not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"model.normalization must be 'RMSNorm' or 'LayerNorm', got {kind!r}")
        self.zero_centered = (
            config.layernorm_zero_centered_gamma
            if zero_centered_gamma is None
            else zero_centered_gamma
        )
        if self.zero_centered and kind != "RMSNorm":
            raise ValueError("zero-centered gamma is supported by LocalNorm for RMSNorm only")
        self.kind = kind
        self.eps = eps
        self.normalized_shape = (hidden_size,)
        factory = {"device": None, "dtype": config.params_dtype}
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, **factory))
        if kind == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, **factory))
        else:
            self.register_parameter("bias", None)
        for param in self.parameters():
            # Read by megatron-core's finalize_model_grads: sum this gradient over the TP group.
            param.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of `x` (any leading shape)."""
        if self.zero_centered:
            normed = F.rms_norm(x.float(), self.normalized_shape, None, self.eps)
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        if self.kind == "RMSNorm":
            return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.kind}, {self.normalized_shape[0]}, eps={self.eps}"
