"""LoRA adapters beside megatron-core's tensor-parallel linears (local and Transformer Engine).

An adapter never replaces the layer it adapts: it is called from a forward hook of the base
linear and adds ``scaling · B(A(dropout(x)))`` to the linear's output, so the base module, its
parameter names and its checkpoint keys stay exactly as megatron-core built them.

The adapter's input ``x`` is what the base's GEMM multiplies: the linear's input, or — for
Transformer Engine's `LayerNormLinear` (megatron's `TELayerNormColumnParallelLinear`, the QKV and
fc1 linears of the TE spec), which normalises its input itself — TE's own normalised input, which
the base is asked to return (`return_layernorm_output`, see `attach`). The adapter holds no
reference to the base's norm weight (its state is (A, B) only, the same keys under every layer
spec) and recomputes no norm: the normalised tensor it reads is the one TE made, in the
activation dtype. A's matmul saves it for A's gradient, and TE saves the same tensor whenever it
returns it (TE 2.9 `layernorm_linear.py`): one normalised input per adapted linear, as the memory
plan counts it (`planning.activations`, LoRA).

One `LoRALinear` serves one megatron linear and holds one (A, B) pair per Hugging Face projection
it fuses — `linear_qkv` = q/k/v, a gated `linear_fc1` = gate/up, the others one — so an adapter
maps one-to-one to `peft`'s `LoraConfig` (`q_proj`, ..., `down_proj`).

Tensor parallelism (the TP/SP facts are read from the wrapped layer):

* column-parallel base (`linear_qkv`, `linear_fc1`): A replicated, each B sharded on its output
  rows exactly as megatron shards the base projection (contiguous heads of this rank's query
  groups for q/k/v, this rank's slice of gate and of up); the per-projection outputs are laid
  out like the base output (per-group [q heads, k, v] interleave; [gate; up]).
  Without SP, ``copy_to_tensor_model_parallel_region`` on A's output all-reduces its gradient;
  with SP, A runs on this rank's sequence chunk and its output is all-gathered (r channels,
  not h), so A's gradient is partial: A is marked ``sequence_parallel`` and megatron's
  `finalize_model_grads` all-reduces it over TP.
* row-parallel base (`linear_proj`, `linear_fc2`): A sharded on its inputs like the base weight,
  B replicated; A's partial output is all-reduced (reduce-scattered along the sequence under
  SP, where B's gradient is then partial and B is marked ``sequence_parallel``).

Initialisation is deterministic per (seed, global layer, projection) and done on the full
(unsharded) tensor before slicing, so every TP/PP layout starts from the same adapter.

A run that starts from an imported adapter keeps a frozen copy of it (`hold_reference`): the
buffers `ref_A` / `ref_B` beside each pair, sharded like the trained pair, checkpointed with it,
never seen by the optimizer. `use_reference` makes the adapter compute with that copy instead,
so the reference policy (base + starting adapter) runs through the same forward as the policy.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

from megatron_kto.conversion.addressing import COLUMN, ROW, lora_axes
from megatron_kto.peft.hybrid_layout import HYBRID_LAYOUTS, fuse_blocks, projection_rows
from megatron_kto.peft.settings import INIT_METHODS


@dataclass(frozen=True)
class Projection:
    """One Hugging Face projection inside a megatron linear.

    Attributes:
        name: Hugging Face module name (`q_proj`, ...).
        in_features, out_features: full (unsharded) sizes of the projection.
    """

    name: str
    in_features: int
    out_features: int


@dataclass(frozen=True)
class FusedLayout:
    """How a column-parallel linear's output is made of its projections.

    Attributes:
        kind: 'qkv' (per query group: its query heads, key head, value head), 'fc1' ([gate; up]),
            'single', or a hybrid model's 'gated_qkv' / 'deltanet_in_proj' (`hybrid_layout`).
        groups: query groups (qkv, gated_qkv).
        heads_per_group, head_dim: qkv, gated_qkv.
        deltanet: the DeltaNet heads (`conversion.deltanet.DeltaNetShape`; deltanet_in_proj).
    """

    kind: str
    groups: int = 1
    heads_per_group: int = 1
    head_dim: int = 1
    deltanet: Any = None


def _init_full(method: str, shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    """A full fp32 CPU tensor initialised as NeMo's LoRA names it (`kaiming` is peft's default)."""
    t = torch.empty(shape)
    if method == "zero":
        return t.zero_()
    if method == "xavier":
        return torch.nn.init.xavier_normal_(t, generator=generator)
    if method == "normal":
        return torch.nn.init.normal_(t, std=0.2, generator=generator)
    if method == "kaiming":
        return torch.nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=generator)
    raise ValueError(f"unknown LoRA init method {method!r}; one of {INIT_METHODS}")


class LoRAPair(torch.nn.Module):
    """One projection's `lora_A` [r, in] and `lora_B` [out, r] (set by `LoRALinear`), and
    optionally their frozen starting values `ref_A` / `ref_B` (buffers)."""

    lora_A: torch.nn.Parameter
    lora_B: torch.nn.Parameter

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B)."""
        return self.lora_A, self.lora_B

    def hold_reference(self) -> None:
        """Keep a frozen copy of the current (A, B) as `ref_A` / `ref_B` (persistent buffers:
        checkpointed, untouched by the optimizer)."""
        self.register_buffer("ref_A", self.lora_A.detach().clone())
        self.register_buffer("ref_B", self.lora_B.detach().clone())

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The frozen copy (ref_A, ref_B)."""
        return self.ref_A, self.ref_B

    def holds_reference(self) -> bool:
        """Whether `hold_reference` was called."""
        return hasattr(self, "ref_A")


def _layer_kind(base: torch.nn.Module) -> str:
    """'column' or 'row' for megatron's local linears and its Transformer Engine wrappers."""
    if isinstance(base, ColumnParallelLinear):
        return "column"
    if isinstance(base, RowParallelLinear):
        return "row"
    mode = getattr(base, "parallel_mode", None)  # te.pytorch.Linear / LayerNormLinear
    if mode in ("column", "row"):
        return mode
    raise TypeError(f"LoRA cannot adapt {type(base).__name__}: not a tensor-parallel linear")


class LoRALinear(torch.nn.Module):
    """The adapters of one megatron linear; `forward(x)` returns what to add to its output.

    Args:
        base: the megatron linear (its weight gives dtype/device; its TP/SP facts are read).
        projections: the Hugging Face projections it fuses that get an adapter, in fused order
            (absent projections of a fused linear contribute zero).
        layout: how the fused output is laid out.
        all_projections: every projection of the linear, in fused order.
        rank, alpha, dropout: LoRA hyper-parameters (scaling = alpha / rank).
        init_a, init_b: init methods of A and B.
        seed: base seed; combined with `key` so initialisation is layout-independent.
        key: the linear's global name (e.g. `decoder.layers.3.self_attention.linear_qkv`).
    """

    def __init__(
        self,
        base: torch.nn.Module,
        projections: list[Projection],
        layout: FusedLayout,
        all_projections: list[Projection],
        *,
        rank: int,
        alpha: float,
        dropout: float,
        init_a: str,
        init_b: str,
        seed: int,
        key: str,
    ):
        super().__init__()
        self.key = key
        self.kind = _layer_kind(base)
        self.layout = layout
        self.names = [p.name for p in projections]
        self.all_names = [p.name for p in all_projections]
        self.scaling = alpha / rank
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else None
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False))
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        weight = base.weight
        self.axes = lora_axes(ROW if self.kind == "row" else COLUMN)
        """TP axes of (lora_A, lora_B) (`addressing.lora_axes` of the base's axis)."""
        self.adapters = torch.nn.ModuleDict()
        for p in projections:
            gen = torch.Generator().manual_seed(seed + zlib.crc32(f"{key}.{p.name}".encode()))
            a_full = _init_full(init_a, (rank, p.in_features), gen)
            b_full = _init_full(init_b, (p.out_features, rank), gen)
            pair = LoRAPair()
            pair.lora_A = self._param(a_full, shard_dim=self.axes[0], w=weight)
            pair.lora_B = self._param(b_full, shard_dim=self.axes[1], w=weight)
            self.adapters[p.name] = pair
        self.enabled = True
        self.use_reference = False

    def hold_reference(self) -> None:
        """Keep a frozen copy of the current adapter: `use_reference` computes with it."""
        for pair in self.adapters.values():
            pair.hold_reference()

    def holds_reference(self) -> bool:
        """Whether the adapter holds a frozen copy (`hold_reference`)."""
        return all(pair.holds_reference() for pair in self.adapters.values())

    def _param(self, full: torch.Tensor, shard_dim: int | None, w: torch.Tensor):
        if shard_dim is not None:
            full = full.chunk(self.tp, dim=shard_dim)[self.tp_rank]
        param = torch.nn.Parameter(full.contiguous().to(device=w.device, dtype=w.dtype))
        tensor_parallel.set_tensor_model_parallel_attributes(
            param, is_parallel=shard_dim is not None, dim=shard_dim or 0, stride=1
        )
        # A replicated weight whose gradient comes from this rank's sequence chunk only:
        # finalize_model_grads all-reduces such gradients over TP.
        replicated_partial = self.sequence_parallel and shard_dim is None
        param.sequence_parallel = replicated_partial
        return param

    def shard(self, name: str, which: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full (unsharded) `lora_A` / `lora_B` of projection `name`."""
        axis = self.shard_axes()[f"adapters.{name}.{which}"]
        return full if axis is None else full.chunk(self.tp, dim=axis)[self.tp_rank]

    def shard_axes(self) -> dict[str, int | None]:
        """TP axis of each parameter (None: replicated), keyed as in `state_dict()`."""
        a, b = self.axes
        out: dict[str, int | None] = {}
        for name in self.names:
            out[f"adapters.{name}.lora_A"] = a
            out[f"adapters.{name}.lora_B"] = b
            if self.adapters[name].holds_reference():
                out[f"adapters.{name}.ref_A"] = a
                out[f"adapters.{name}.ref_B"] = b
        return out

    def _dropped(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout is None or not self.training:
            return x
        if self.kind == "row" or self.sequence_parallel:
            # This rank's inputs differ from the other TP ranks': draw from the TP stream.
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return self.dropout(x)
        return self.dropout(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The adapters' contribution to the base linear's output for `x`, the input of the
        base's GEMM (with the frozen copy, and no dropout, while `use_reference`)."""
        if self.use_reference:
            # The reference is a fixed function: no dropout; buffers need no DDP pre-hook.
            pairs = {n: self.adapters[n].reference() for n in self.names}
        else:
            x = self._dropped(x)
            # Calling each pair (rather than reading its attributes) runs the forward pre-hooks
            # megatron DDP puts on parameter-owning modules: with the distributed optimizer's
            # overlapped parameter all-gather, that is where a rank waits for updated shards.
            pairs = {n: self.adapters[n]() for n in self.names}
        a = torch.cat([pairs[n][0] for n in self.names])
        # The scaling goes on the r-wide u, not on the output: one [tokens, out] tensor per call.
        u = _mm(x, a) * self.scaling
        if self.kind == "row":
            u = (
                reduce_scatter_to_sequence_parallel_region(u)
                if self.sequence_parallel
                else reduce_from_tensor_model_parallel_region(u)
            )
            return _mm(u, pairs[self.names[0]][1])
        u = (
            gather_from_sequence_parallel_region(u)
            if self.sequence_parallel
            else copy_to_tensor_model_parallel_region(u)
        )
        return _mm(u, self._fused_b({n: pairs[n][1] for n in self.names}))

    def _fused_b(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
        """This rank's B matrices as one [out_local, k·r] matrix laid out like the base output
        (block-diagonal in the k projections, zero where a projection has no adapter), so the
        fused output is one matmul — no per-projection outputs to concatenate."""
        if len(self.all_names) == 1:
            return b[self.all_names[0]]
        rank = next(iter(b.values())).shape[1]
        k = len(self.names)

        def block(name: str, rows: int, lead: tuple[int, ...]) -> torch.Tensor:
            if name not in b:
                return b[self.names[0]].new_zeros(*lead, rows, k * rank)
            j = self.names.index(name)
            part = b[name].reshape(*lead, rows, rank)
            return torch.nn.functional.pad(part, (j * rank, (k - 1 - j) * rank))

        lay = self.layout
        if lay.kind in HYBRID_LAYOUTS:
            if "in_proj_qkv" in b and self.tp > 1:
                b = {**b, "in_proj_qkv": self._own_qkv_rows(b["in_proj_qkv"])}
            rows = projection_rows(lay, len(self.all_names), self.tp)
            blocks = [
                block(n, r, ()) if n in b else b[self.names[0]].new_zeros(r, k * rank)
                for n, r in zip(self.all_names, rows, strict=True)
            ]
            return fuse_blocks(lay, blocks, self.tp)
        if lay.kind == "fc1":
            rows = next(iter(b.values())).shape[0]
            return torch.cat([block(n, rows, ()) for n in self.all_names])
        groups = lay.groups // self.tp
        sizes = (lay.heads_per_group * lay.head_dim, lay.head_dim, lay.head_dim)
        pieces = [block(n, size, (groups,)) for n, size in zip(self.all_names, sizes, strict=True)]
        return torch.cat(pieces, dim=1).reshape(-1, k * rank)

    def _own_qkv_rows(self, b: torch.Tensor) -> torch.Tensor:
        """This rank's rows [q | k | v] of Qwen3.5's `in_proj_qkv` B from its stored shard.

        B is sharded as every column-parallel B is (a contiguous block of the HF rows [q | k |
        v], so checkpoints, import and export are those of any adapter), but the rank's base rows
        are three blocks: its key heads' q and k and its value heads' v. The shards are
        all-gathered (r columns: small) and the rank's blocks taken; in backward the gradient is
        reduce-scattered, each row's coming from the one rank that uses it."""
        full = gather_from_sequence_parallel_region(b, tensor_parallel_output_grad=True)
        s = self.layout.deltanet
        qk = s.key_heads * s.key_dim
        parts = full.split([qk, qk, s.value_heads * s.value_dim])
        return torch.cat([part.chunk(self.tp)[self.tp_rank] for part in parts])


def _mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.t() over x's last dimension, as one 2-D matmul.

    `torch.matmul` of a non-contiguous N-d input (megatron's [s, b, h] activations are often
    a transposed view) picks its kernel by whether `w` requires grad, so the no-grad reference
    pass (frozen copy) and the policy pass would round differently from the same numbers; one
    2-D matmul on the flattened input is the same kernel in both (measured: 1e-7 apart before).
    """
    out = torch.matmul(x.reshape(-1, x.shape[-1]), w.t())
    return out.view(*x.shape[:-1], w.shape[0])


def fuses_norm(base: torch.nn.Module) -> bool:
    """Whether `base` normalises its input before its GEMM (TE's `LayerNormLinear`)."""
    return hasattr(base, "layer_norm_weight") and hasattr(base, "return_layernorm_output")


def _split_te_output(output: tuple) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(out, bias, normalised input) of megatron's `TELayerNormColumnParallelLinear` asked for
    TE's norm output: TE returns `(out, ln_out)`, or `(out, bias, ln_out)` with `return_bias`;
    the wrapper passes the latter on as is and pairs the former with None."""
    if len(output) == 3:
        return output
    (out, ln_out), bias = output
    return out, bias, ln_out


def attach(base: torch.nn.Module, adapter: LoRALinear) -> Callable[[], None]:
    """Add `adapter`'s output to `base`'s through a forward hook; returns the hook's remover.

    megatron's linears (local and TE wrappers) return `(output, bias)`; the adapter's term is
    added to `output` only, and only while `adapter.enabled`. A TE `LayerNormLinear` base is
    made to return its normalised input too (`return_layernorm_output`), which the hook gives
    the adapter and strips, so the base still returns `(output, bias)`. That norm output is this
    rank's sequence chunk under sequence parallelism (`return_layernorm_output_gathered` stays
    off: TE 2.9's backward drops the gradient of the gathered one, and the adapter gathers its
    r-wide A output instead of the h-wide input). The remover restores TE's setting. The hook
    runs before any forward hook the base already has (it adds to the base's own output).
    """
    fused = fuses_norm(base)
    if fused:
        base.return_layernorm_output = True
        base.return_layernorm_output_gathered = False

    def hook(module, args, output):
        if fused:
            out, bias, x = _split_te_output(output)
        else:
            (out, bias), x = output, args[0]
        if not adapter.enabled:
            return out, bias
        return out + adapter(x).to(out.dtype), bias

    # First among the base's forward hooks: the adapter's term is part of the linear's output
    # that any other hook reads (multi-latent attention gathers `linear_kv_down_proj`'s output
    # over TP in one, `models/mla.py`: the term must be in what is gathered).
    handle = base.register_forward_hook(hook, prepend=True)

    def remove() -> None:
        handle.remove()
        if fused:
            base.return_layernorm_output = False

    return remove
