"""Speed-only settings that matter on GPUs, decided in one place from what the machine has.

Nothing here changes the math of a step: each switch selects a fused kernel or an overlap of
communication with compute for an operation megatron-core would otherwise run unfused or in
sequence. The decisions are pure functions of an `Accelerator` record, so CPU tests can check
what a CUDA + Transformer Engine machine would get without either being present. None of these
settings has been measured on a GPU by this project yet (see README, "GPU settings").
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from packaging.version import InvalidVersion, Version

logger = logging.getLogger(__name__)

#: Transformer Engine versions megatron-core 0.16.1 is tested with: its `dev` extra pins
#: `transformer-engine>=2.9.0a0,<2.12.0`. Its code gates individual features on versions from
#: 0.8 to 2.10 (`is_te_min_version`), so older releases import but lose features; outside the
#: tested range we warn.
TE_TESTED_MIN = Version("2.9.0a0")
TE_TESTED_BELOW = Version("2.12.0")

#: The Apex extension megatron-core's own linear layers (the output layer in every spec) need
#: for gradient-accumulation fusion (`tensor_parallel/layers.py`, `fused_weight_gradient_mlp_cuda`).
GRAD_ACCUM_FUSION_MODULE = "fused_weight_gradient_mlp_cuda"


@dataclass(frozen=True)
class Accelerator:
    """What the process can use; `detect()` fills it in, tests construct it by hand."""

    cuda: bool
    """A CUDA device is available."""
    transformer_engine: str | None = None
    """Installed Transformer Engine version, or None."""
    grad_accum_fusion_kernel: bool = False
    """Apex's `fused_weight_gradient_mlp_cuda` extension is importable."""
    flash_attn: bool = False
    """The `flash_attn` package (flash-attention 2, one of TE's attention backends) is importable."""
    fla: bool = False
    """The `fla` package (flash-linear-attention: gated DeltaNet kernels) is importable."""
    compute_capability: tuple[int, int] | None = None
    """The GPU's compute capability, e.g. (8, 0) for an A100; None when not read (reading it
    initialises CUDA, so it is read only once the device is set: `detect(read_device=True)`)."""
    cudnn: int | None = None
    """cuDNN's runtime version as torch reports it (e.g. 91301 for 9.13.1), None when unknown."""

    @classmethod
    def detect(cls, read_device: bool = False) -> Accelerator:
        """Inspect this process (imports neither Transformer Engine nor Apex nor flash-attn).

        Args:
            read_device: also read the current GPU's compute capability (initialises CUDA: only
                after the launch environment is applied and the device is set).
        """
        cuda = torch.cuda.is_available()
        return cls(
            cuda=cuda,
            transformer_engine=_installed_version("transformer_engine", "transformer-engine"),
            grad_accum_fusion_kernel=importlib.util.find_spec(GRAD_ACCUM_FUSION_MODULE) is not None,
            flash_attn=importlib.util.find_spec("flash_attn") is not None,
            fla=importlib.util.find_spec("fla") is not None,
            compute_capability=torch.cuda.get_device_capability() if cuda and read_device else None,
            cudnn=torch.backends.cudnn.version() if cuda else None,
        )

    @property
    def has_transformer_engine(self) -> bool:
        """Transformer Engine is usable (it needs CUDA)."""
        return self.cuda and self.transformer_engine is not None


def _installed_version(module: str, *distributions: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return None
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def transformer_engine_warning(version: str | None) -> str | None:
    """A one-line warning when `version` is outside the range megatron-core 0.16.1 is tested
    with, else None (also None when Transformer Engine is absent)."""
    if version is None:
        return None
    try:
        parsed = Version(version)
    except InvalidVersion:
        return f"cannot parse the Transformer Engine version {version!r}; tested: >=2.9,<2.12"
    if TE_TESTED_MIN <= parsed < TE_TESTED_BELOW:
        return None
    return (
        f"Transformer Engine {version} is outside the range megatron-core 0.16.1 is tested with "
        f"(>=2.9,<2.12, e.g. the NGC PyTorch 25.11 image); features may be missing or fail"
    )


def fusion_settings(accelerator: Accelerator, arch: Any) -> dict[str, bool]:
    """`TransformerConfig` fusion switches for this machine and architecture.

    Args:
        accelerator: what the process can use.
        arch: the `GPTArchitecture` (activation, biases, position embedding).

    Returns:
        Keyword arguments for `TransformerConfig`; all False on CPU, where megatron-core's fused
        paths need CUDA kernels (and its `jit_fuser` would spend ~17 s compiling per process).
    """
    cuda = accelerator.cuda
    # megatron's bias+activation fusion exists for SwiGLU (with or without bias) and for GeLU
    # with a bias (TransformerConfig.__post_init__ rejects the other combinations).
    activation_fusable = arch.activation == "swiglu" or (
        arch.activation == "gelu" and arch.add_bias_linear
    )
    return {
        # Weight gradients accumulate straight into the fp32 main_grad buffers. TE's linear layers
        # do it themselves, but megatron's ColumnParallelLinear (the output layer in every spec)
        # raises at construction without Apex's kernel, so the switch follows the kernel.
        "gradient_accumulation_fusion": cuda and accelerator.grad_accum_fusion_kernel,
        # megatron's rope_utils take the fused RoPE kernel from Transformer Engine.
        # (Not MLA's: its fused path needs megatron's Triton kernels; the unfused one is exact.)
        "apply_rope_fusion": accelerator.has_transformer_engine
        and arch.position_embedding_type == "rope"
        and not getattr(arch, "multi_latent_attention", False),
        "bias_activation_fusion": cuda and activation_fusable,
        "bias_dropout_fusion": cuda,
        # Unfused softmax / norms: the TE spec has its own fused attention and norms; the local
        # spec's fused variants need Apex kernels we do not require.
        "masked_softmax_fusion": False,
        "persist_layer_norm": False,
    }


def ddp_overlap_settings(
    use_distributed_optimizer: bool,
    overlap_grad_reduce: bool | None = None,
    overlap_param_gather: bool | None = None,
) -> dict[str, bool]:
    """`DistributedDataParallelConfig` overlap switches.

    By default both overlaps are on with the distributed optimizer (reduce-scatter of a bucket's
    gradients during the rest of the backward pass; all-gather of updated parameters during the
    next forward pass) and off without it. An explicit True/False wins. Parameter gathering can
    only be overlapped by the distributed optimizer (megatron-core asserts it).

    Callers that read or write parameters outside a forward pass must first complete the
    deferred all-gather: `training_setup.finish_param_sync`.
    """
    grad = use_distributed_optimizer if overlap_grad_reduce is None else overlap_grad_reduce
    param = use_distributed_optimizer if overlap_param_gather is None else overlap_param_gather
    if param and not use_distributed_optimizer:
        raise ValueError("overlap_param_gather needs the distributed optimizer")
    return {"overlap_grad_reduce": bool(grad), "overlap_param_gather": bool(param)}


def launch_environment(
    cuda: bool, tensor_parallel_size: int, environ: MutableMapping[str, str]
) -> dict[str, str]:
    """Environment variables a rank must have before CUDA is initialised.

    megatron-core's tensor-parallel linear layers issue their gradient all-reduce (or, with
    sequence parallelism, reduce-scatter) before the weight-gradient GEMM and rely on
    `CUDA_DEVICE_MAX_CONNECTIONS=1` for the GPU to run them in that order, i.e. to overlap them
    (`tensor_parallel/layers.py`, linear_with_grad_accumulation_and_async_allreduce). A value the
    user set is kept.

    Returns:
        The variables to set (empty when none is needed or all are already set).
    """
    if not cuda or tensor_parallel_size <= 1 or "CUDA_DEVICE_MAX_CONNECTIONS" in environ:
        return {}
    return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def apply_launch_environment(cuda: bool, tensor_parallel_size: int) -> dict[str, str]:
    """Set `launch_environment(...)` in `os.environ`; call before `torch.cuda.set_device`.

    Returns:
        What was set.
    """
    wanted = launch_environment(cuda, tensor_parallel_size, os.environ)
    if wanted and torch.cuda.is_initialized():
        # The variable is read when the CUDA context is created; too late to matter now.
        logger.warning(
            "CUDA was initialised before megatron_kto could set %s; export it in the launch "
            "script for TP>1 compute/communication overlap",
            ", ".join(f"{k}={v}" for k, v in wanted.items()),
        )
    os.environ.update(wanted)
    if (
        cuda
        and tensor_parallel_size > 1
        and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "1") != "1"
    ):
        logger.warning(
            "CUDA_DEVICE_MAX_CONNECTIONS=%s: megatron-core's tensor-parallel overlap expects 1",
            os.environ["CUDA_DEVICE_MAX_CONNECTIONS"],
        )
    return wanted
