"""A weight gradient summed over chunks in fp32, as megatron-core's own linear layers sum it.

The chunked output layer (`models.chunked_logprobs`) produces its weight gradient as a sum of
one ``grad_output.T @ input`` product per chunk. Summed in a half-precision buffer, every chunk
would round the running total to bf16 (8 significant bits): hundreds of chunks lose most of the
gradient's precision. megatron-core's layers instead add their weight gradient into the fp32
`main_grad` that its `DistributedDataParallel` gives every parameter (with
`gradient_accumulation_fusion`: Apex's fused GEMM accumulates straight into it), mark the
parameter `grad_added_to_main_grad`, and hand autograd a dummy gradient that DDP's backward hook
then ignores. `WeightGradSum` follows the same contract:

* a half-precision weight inside megatron DDP (fp32 `main_grad`, `grad_added_to_main_grad`):
  each chunk's product is added into `main_grad`; the returned gradient is a dummy — zeros when
  the parameter is flagged `zero_out_wgrad` (an embedding tied to the output layer on one stage,
  whose lookup gradient still reaches `main_grad` through the hook), otherwise never read;
* any other weight: the products are summed in an fp32 buffer, cast to the weight's dtype once
  at the end (for an fp32 weight that buffer is the gradient itself, summed as before).

Each chunk's product is formed with fp32 accumulation: Apex's fused kernel on CUDA when present
(what megatron uses), an fp32 GEMM of the (exactly upcast) half-precision operands elsewhere.
On CUDA without Apex the product is a half-precision GEMM — rounded once per chunk, as
megatron's unfused layers round once per micro-batch — added to the fp32 sum.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

from megatron_kto.runtime.gpu_settings import GRAD_ACCUM_FUSION_MODULE


@functools.cache
def _fused_wgrad_kernel() -> ModuleType | None:
    """Apex's fused weight-gradient extension (CUDA only), or None when it is not installed."""
    try:
        return importlib.import_module(GRAD_ACCUM_FUSION_MODULE)
    except ImportError:
        return None


def adds_into_main_grad(weight: torch.Tensor) -> bool:
    """Whether `WeightGradSum` adds `weight`'s gradient straight into its `main_grad`.

    True for a half-precision parameter of megatron DDP with an fp32 `main_grad` (DDP sets
    `grad_added_to_main_grad` on every trainable parameter and its hook honours it). An fp32
    weight keeps autograd's fp32 gradient: nothing to gain, and its numbers stay as they were.
    """
    main_grad = getattr(weight, "main_grad", None)
    return (
        weight.dtype != torch.float32
        and main_grad is not None
        and main_grad.dtype == torch.float32
        and hasattr(weight, "grad_added_to_main_grad")
    )


class WeightGradSum:
    """Sum of ``grad_output.T @ input`` over chunks for a [out, in] weight, kept in fp32."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.into_main_grad = adds_into_main_grad(weight)
        self.total = (
            weight.main_grad
            if self.into_main_grad
            else torch.zeros_like(
                weight, dtype=torch.float32, memory_format=torch.contiguous_format
            )
        )

    def add(self, grad_output: torch.Tensor, inputs: torch.Tensor) -> None:
        """Add one chunk's product.

        Args:
            grad_output: [n, out] in the weight's dtype (what the input gradient uses too).
            inputs: [n, in] in the weight's dtype.
        """
        if grad_output.dtype == torch.float32 or not self.total.is_cuda:
            # fp32 products of the exactly upcast operands (a no-op cast for fp32 weights).
            self.total.addmm_(grad_output.t().float(), inputs.float())
            return
        kernel = _fused_wgrad_kernel()
        if kernel is not None:
            kernel.wgrad_gemm_accum_fp32(inputs.contiguous(), grad_output.contiguous(), self.total)
        else:
            self.total.add_(grad_output.t() @ inputs)

    def result(self) -> torch.Tensor:
        """The gradient to return from the autograd Function for the weight."""
        if not self.into_main_grad:
            return self.total.to(self.weight.dtype)
        self.weight.grad_added_to_main_grad = True
        # DDP's hook adds `weight.grad` to `main_grad` only when the flag is off or the parameter
        # is `zero_out_wgrad`; autograd still wants a gradient of the weight's shape.
        if getattr(self.weight, "zero_out_wgrad", False):
            return torch.zeros_like(self.weight)
        return torch.empty_like(self.weight)
