"""Weights, gradients and optimizer state of one rank, byte for byte as megatron-core lays them out.

Pure arithmetic on the architecture and the layout (no tensors, no process group), so it can run
before launch. What it reproduces (megatron-core 0.16.1, the way `models.training_setup` builds):

* **Parameters per chunk** (`chunk_parameters`): the local/SDPA layer spec's parameters in
  `GPTModel.named_parameters()` order. TP shards the QKV rows ((n + 2g)·d/TP), the attention
  output columns (n·d/TP), the MLP ((2 if SwiGLU)·f/TP rows, f/TP columns) and the padded
  vocabulary (V/TP rows of the embedding and output layer); norms (and the row-parallel biases)
  are replicated. Layers split evenly over PP × VPP chunks; the embedding lives on the first
  chunk, the final norm and the output layer on the last; with tied embeddings and PP > 1 the
  last stage holds its own copy of the embedding as `output_layer.weight` (PP = 1: no output
  weight at all). Q/K norms (Qwen3) are one [d] weight each, replicated.
* **Mixture of experts** (`_moe_params`; the local spec's `MoELayer` with `SequentialMLP`
  experts): per MoE layer (`arch.is_moe_layer`; the others have the dense MLP) the router
  [E, h] (replicated), this rank's E/EP experts numbered from 0, each an MLP split over ETP
  ((2 if SwiGLU)·f_moe/ETP rows, f_moe/ETP columns), then the shared expert's gate [1, h]
  (replicated) and its MLP split over TP. The routed experts are marked `allreduce=False` at
  every EP (`training_setup.mark_experts_expert_parallel`): megatron DDP gives them buffers of
  their own (`chunk_buffers`), laid out as below with the expert-data-parallel size
  world/(ETP·EP·PP) in place of DP, and the distributed optimizer shards them over that group.
* **Megatron DDP buffers** (`ddp_buffer`): one contiguous buffer per chunk holding fp32
  gradients (`grad_reduce_in_fp32=True`), params laid out in reverse order. Without the
  distributed optimizer it is exactly Σ numel. With it, every parameter starts on a multiple of
  64 elements, every bucket is padded to a multiple of lcm(DP, 128), a tied embedding gets a
  bucket of its own, and the parameters themselves move into a second, param-dtype buffer of the
  same (padded) size. Buckets hold `bucket_size` elements (max(4e7, 1e6·DP) by default) only
  when the gradient reduce overlaps the backward, on the first chunk of pipeline rank 0.
* **Optimizer state** (`optimizer_state`): Adam's two moments (fp32) for every element the
  optimizer owns, plus, for bf16/fp16 parameters, an fp32 main copy of them. The non-distributed
  optimizer owns all of this rank's parameters; the distributed optimizer only its DP shard of
  each bucket (bucket/DP elements, intersected with each parameter's range — so shards of
  different DP ranks differ by the padding). For fp32 parameters the distributed optimizer's
  main "copy" is a view of the parameter buffer (no bytes). torch's AdamW (what megatron-core
  falls back to without Transformer Engine or Apex, e.g. on CPU) also keeps a 4-byte `step`
  tensor per optimizer parameter; TE/Apex FusedAdam keep the step in the param group.
* **LoRA** (`LoRAShape`): the adapters are parameters of the chunk's `lora` module (registered
  after the model's own, so last in `named_parameters()`), one `lora_A` [r, in] and `lora_B`
  [out, r] per adapted projection (`peft.lora`: column-parallel linears shard B's rows, row-parallel
  ones A's columns; the other matrix is replicated). The base parameters are frozen before DDP
  wraps the chunks, and megatron DDP and its optimizer skip parameters without `requires_grad`:
  gradient buffers, optimizer state and the distributed optimizer's shards hold the adapters
  only, and the frozen weights stay in their own tensors (outside the DDP param buffer).
  An MoE model takes adapters on its attention only (`peft.wiring`): its routed experts stay
  frozen in the param dtype, each rank holding its E/EP of them — no expert gradient buffer, no
  expert optimizer state. GPT-OSS's published MXFP4 experts are dequantised on load
  (`conversion.stacked.dequantize_mxfp4`, one expert at a time) into the run's param dtype, so they count at 2 (bf16) or 4 (fp32) bytes
  per element here, never at MXFP4's 4.25 bits.

Everything is in bytes of real tensors: `tests/test_memory_plan.py` builds the model and optimizer
through the trainer's own builders at TP/PP/VPP/DP × precision × optimizer and compares
(`tests/test_plan_moe.py` the same for MoE models at EP = 1 and 2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.config.pipeline_split import check_pipeline_split, chunk_layers
from megatron_kto.peft.targets import (
    check_moe_targets,
    projection_shape,
    resolve_targets,
    selected_layers,
)
from megatron_kto.planning.attention_shapes import attention_shapes, deltanet_shapes

#: Bytes per element of each precision's parameters.
PARAM_BYTES = {"32": 4, "bf16": 2, "16": 2}
FP32 = 4


@dataclass(frozen=True)
class ParallelDims:
    """The layout a plan is for (a subset of `builder.ParallelLayout`, plus DP)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int | None = None
    sequence_parallel: bool = False
    precision: str = "32"
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool | None = None
    """None: on with the distributed optimizer (`gpu_settings.ddp_overlap_settings`)."""
    bucket_size: int | None = None
    """DDP bucket size in elements; None: megatron-core's default."""
    ep: int = 1
    """Expert parallelism (`model.expert_model_parallel_size`): ranks each MoE layer's routed
    experts are spread over."""
    etp: int | None = None
    """Expert tensor parallelism (`model.expert_tensor_parallel_size`); None: TP."""
    first: int | None = None
    """Layers of the first pipeline stage (`model.num_layers_in_first_pipeline_stage`);
    None: megatron-core's even split."""
    last: int | None = None
    """Layers of the last pipeline stage (`model.num_layers_in_last_pipeline_stage`)."""

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """The expert-data-parallel size: megatron-core tiles the same world with
        ETP x EP x expert-DP x PP."""
        return self.world // (self.expert_tp * self.ep * self.pp)


@dataclass(frozen=True)
class Param:
    """One parameter of a chunk: its name (as in `GPTModel.named_parameters()`) and shape."""

    name: str
    numel: int
    shared_embedding: bool = False
    trainable: bool = True
    """False: frozen (LoRA's base model) — no gradient buffer, no optimizer state."""
    expert: bool = False
    """A routed expert's weight: in the DDP buffers and optimizer of the expert-data-parallel
    group (`training_setup.mark_experts_expert_parallel`), not the dense ones."""


@dataclass(frozen=True)
class LoRAShape:
    """The adapters of a LoRA run (`model.peft.lora_tuning.*`)."""

    rank: int
    targets: tuple[str, ...] = ("all",)
    """NeMo or Hugging Face target names (`peft.targets`)."""
    layers: tuple[int, ...] | None = None
    """1-based layer selection (None: every layer)."""


def _mlp_params(
    h: int, f: int, swiglu: bool, tp: int, prefix: str, expert: bool, bias: bool = False
) -> list[Param]:
    """A megatron MLP: fc1 [(2 if gated)·f/TP, h], fc2 [h, f/TP], and with `bias` their biases
    [(2 if gated)·f/TP] and [h]."""
    fc1_rows = (2 if swiglu else 1) * f // tp
    out = [Param(f"{prefix}linear_fc1.weight", fc1_rows * h, expert=expert)]
    if bias:
        out.append(Param(f"{prefix}linear_fc1.bias", fc1_rows, expert=expert))
    out.append(Param(f"{prefix}linear_fc2.weight", h * f // tp, expert=expert))
    if bias:
        out.append(Param(f"{prefix}linear_fc2.bias", h, expert=expert))
    return out


def _moe_params(arch: GPTArchitecture, dims: ParallelDims, prefix: str) -> list[Param]:
    """An MoE layer's MLP (`MoELayer` with the local `SequentialMLP` experts): the router
    [E, h] (replicated), this EP rank's E/EP experts split over ETP, then the shared expert's
    gate [1, h] (replicated) and its TP-split MLP."""
    bias = arch.add_bias_linear
    if bias and arch.moe_shared_expert_intermediate_size:
        raise ValueError("memory planning of a shared expert with linear biases")
    h, swiglu = arch.hidden_size, arch.gated_mlp
    experts = arch.num_moe_experts or 0
    if experts % dims.ep:
        raise ValueError(f"expert parallelism {dims.ep} does not divide the {experts} experts")
    out = [Param(f"{prefix}mlp.router.weight", experts * h)]
    if bias:  # GPT-OSS: a biased router and biased experts
        out.append(Param(f"{prefix}mlp.router.bias", experts))
    f = arch.moe_ffn_hidden_size or arch.ffn_hidden_size
    for e in range(experts // dims.ep):
        local = f"{prefix}mlp.experts.local_experts.{e}."
        out += _mlp_params(h, f, swiglu, dims.expert_tp, local, expert=True, bias=bias)
    shared = arch.moe_shared_expert_intermediate_size
    if shared:
        if arch.moe_shared_expert_gate:
            out.append(Param(f"{prefix}mlp.shared_experts.gate_weight", h))
        out += _mlp_params(h, shared, swiglu, dims.tp, f"{prefix}mlp.shared_experts.", False)
    return out


def _layer_params(
    arch: GPTArchitecture, dims: ParallelDims, prefix: str, layer: int = 0
) -> list[Param]:
    """Global layer `layer`'s parameters (its MLP dense or MoE by `arch.is_moe_layer`)."""
    tp = dims.tp
    h, f = arch.hidden_size, arch.ffn_hidden_size
    fc1_rows = (2 if arch.gated_mlp else 1) * f // tp
    norm_bias = arch.normalization == "LayerNorm"
    bias = arch.add_bias_linear
    out: list[Param] = [Param(f"{prefix}input_layernorm.weight", h)]
    if norm_bias:
        out.append(Param(f"{prefix}input_layernorm.bias", h))
    kind = deltanet_shapes if arch.is_linear_attention_layer(layer) else attention_shapes
    out += [Param(name, numel) for name, numel in kind(arch, tp, prefix)]
    out.append(Param(f"{prefix}pre_mlp_layernorm.weight", h))

    if norm_bias:
        out.append(Param(f"{prefix}pre_mlp_layernorm.bias", h))
    if arch.is_moe_layer(layer):
        return out + _moe_params(arch, dims, prefix)
    out.append(Param(f"{prefix}mlp.linear_fc1.weight", fc1_rows * h))
    if bias:
        out.append(Param(f"{prefix}mlp.linear_fc1.bias", fc1_rows))
    out.append(Param(f"{prefix}mlp.linear_fc2.weight", h * f // tp))
    if bias:
        out.append(Param(f"{prefix}mlp.linear_fc2.bias", h))
    if arch.post_norms:
        out.append(Param(f"{prefix}mlp.post_norm.weight", h))
    return out


def chunk_layer_range(
    arch: GPTArchitecture, dims: ParallelDims, pp_rank: int = 0, vp_stage: int = 0
) -> range:
    """Global indices of the chunk's layers: megatron-core's own offsets (`pipeline_split`)."""
    check_pipeline_split(arch.num_layers, dims.pp, dims.vpp, dims.first, dims.last)
    if dims.first is None and dims.last is None and arch.num_layers % (dims.pp * (dims.vpp or 1)):
        raise ValueError(
            f"{arch.num_layers} layers do not split into {dims.pp * (dims.vpp or 1)} pipeline "
            "chunks"
        )
    return chunk_layers(
        arch.num_layers, dims.pp, dims.vpp, pp_rank, vp_stage, dims.first, dims.last
    )


def layers_per_chunk(arch: GPTArchitecture, dims: ParallelDims, pp_rank: int = 0) -> int:
    """Transformer layers in each model chunk of pipeline rank `pp_rank` (its VPP chunks share
    them evenly, uneven first / last stages included)."""
    return len(chunk_layer_range(arch, dims, pp_rank))


def lora_parameters(
    arch: GPTArchitecture, dims: ParallelDims, lora: LoRAShape, layer_indices: range
) -> list[Param]:
    """The adapters of the given global layers, in `named_parameters()` order (`peft.wiring`)."""
    selected = set(
        selected_layers(None if lora.layers is None else list(lora.layers), arch.num_layers)
    )
    r, tp = lora.rank, dims.tp
    out: list[Param] = []
    for index in layer_indices:
        if index not in selected:
            continue
        for t in resolve_targets(list(lora.targets), arch, index):
            column = t.column
            key = t.linear.replace(".", "__")
            for proj in t.projections:
                fan_in, fan_out = projection_shape(proj, arch)
                prefix = f"lora.layers.{index}.{key}.adapters.{proj}."
                a = r * fan_in if column else r * fan_in // tp
                b = fan_out // tp * r if column else fan_out * r
                out += [Param(prefix + "lora_A", a), Param(prefix + "lora_B", b)]
    return out


def chunk_parameters(
    arch: GPTArchitecture,
    dims: ParallelDims,
    pp_rank: int,
    vp_stage: int = 0,
    lora: LoRAShape | None = None,
) -> list[Param]:
    """Parameters of one model chunk, in `named_parameters()` order (names without wrappers);
    under LoRA the base parameters (an MoE model's routed experts included, still split over EP)
    are frozen and the adapters follow them.

    Raises:
        ValueError: LoRA targets an MoE model's MLP (`peft.targets.check_moe_targets`).
    """
    if lora is not None:
        check_moe_targets(list(lora.targets), arch)
    vpp = dims.vpp or 1
    first = pp_rank == 0 and vp_stage == 0
    last = pp_rank == dims.pp - 1 and vp_stage == vpp - 1
    h = arch.hidden_size
    vocab = arch.padded_vocab(dims.tp) // dims.tp
    tied = arch.share_embeddings_and_output_weights
    out: list[Param] = []
    if first:
        out.append(Param("embedding.word_embeddings.weight", vocab * h, tied and dims.pp > 1))
        if arch.position_embedding_type == "learned_absolute":
            out.append(Param("embedding.position_embeddings.weight", arch.encoder_seq_length * h))
    layers = chunk_layer_range(arch, dims, pp_rank, vp_stage)
    for i, index in enumerate(layers):
        out.extend(_layer_params(arch, dims, f"decoder.layers.{i}.", index))
    if last:
        out.append(Param("decoder.final_layernorm.weight", h))
        if arch.normalization == "LayerNorm":
            out.append(Param("decoder.final_layernorm.bias", h))
        if not tied or dims.pp > 1:
            out.append(Param("output_layer.weight", vocab * h, tied))
    if lora is None:
        return out
    frozen = [replace(p, trainable=False) for p in out]
    return frozen + lora_parameters(arch, dims, lora, layers)


@dataclass(frozen=True)
class Buffer:
    """A chunk's DDP buffer: total elements (padding included) and each bucket's
    [start, end) and its parameters' [start, end) ranges, all in buffer elements."""

    numel: int
    buckets: tuple[tuple[int, int], ...]
    param_ranges: tuple[tuple[int, int, int], ...]
    """(start, end, bucket index) per parameter, in buffer order."""


def _bucket_size(dims: ParallelDims, pp_rank: int, chunk_index: int) -> int | None:
    overlap = (
        dims.distributed_optimizer if dims.overlap_grad_reduce is None else dims.overlap_grad_reduce
    )
    if not overlap or chunk_index > 0 or pp_rank > 0:
        return None
    return dims.bucket_size or max(40_000_000, 1_000_000 * dims.dp)


def ddp_buffer(
    params: list[Param],
    dims: ParallelDims,
    pp_rank: int,
    chunk_index: int,
    group: int | None = None,
) -> Buffer:
    """Lay out a chunk's trainable parameters as megatron DDP's `_ParamAndGradBuffer` does, for
    a data-parallel group of `group` ranks (None: DP; the experts' buffer: expert-DP)."""
    params = [p for p in params if p.trainable]
    dist = dims.distributed_optimizer
    bucket_size = _bucket_size(dims, pp_rank, chunk_index)
    divisor = math.lcm(dims.dp if group is None else group, 128)

    def pad_end(index: int) -> int:
        return -(-index // divisor) * divisor if dist else index

    buckets: list[tuple[int, int]] = []
    ranges: list[tuple[int, int, int]] = []
    start = bucket_start = 0
    in_bucket = 0
    for p in reversed(params):
        if dist:
            start = -(-start // 64) * 64
        own_bucket = p.shared_embedding and dist
        if own_bucket and in_bucket:
            start = pad_end(start)
            buckets.append((bucket_start, start))
            bucket_start, in_bucket = start, 0
        end = start + p.numel
        ranges.append((start, end, len(buckets)))
        in_bucket += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or own_bucket:
            start = pad_end(end)
            buckets.append((bucket_start, start))
            bucket_start, in_bucket = start, 0
        else:
            start = end
    if in_bucket:
        buckets.append((bucket_start, pad_end(end)))
    total = buckets[-1][1] if buckets else 0
    return Buffer(total, tuple(buckets), tuple(ranges))


def shard_elements(buffer: Buffer, dp: int, dp_rank: int) -> list[int]:
    """Elements of each parameter (buffer order) that DP rank `dp_rank` owns under the
    distributed optimizer (0 where it owns none of it)."""
    owned = []
    for start, end, bucket in buffer.param_ranges:
        b0, b1 = buffer.buckets[bucket]
        size = (b1 - b0) // dp
        lo, hi = b0 + dp_rank * size, b0 + (dp_rank + 1) * size
        owned.append(max(0, min(end, hi) - max(start, lo)))
    return owned


@dataclass(frozen=True)
class ModelState:
    """Bytes of one rank's model state (device memory unless said otherwise)."""

    parameters: int
    """Parameter count of this rank (all chunks, unpadded)."""
    weights: int
    """Parameter tensors (the DDP param buffer, padding included, under the distributed
    optimizer)."""
    gradients: int
    """fp32 DDP gradient buffers."""
    optimizer: int
    """Adam moments + fp32 main weights (+ torch AdamW's step tensors)."""


def chunk_buffers(
    params: list[Param], dims: ParallelDims, pp_rank: int, chunk_index: int
) -> list[tuple[Buffer, int]]:
    """A chunk's DDP buffers and the size of the group each is reduced (and, under the
    distributed optimizer, sharded) over: the dense parameters' over DP, and — megatron DDP
    builds a second set of buffers for parameters marked `allreduce=False` — the routed
    experts' over expert-DP (none for a dense chunk)."""
    dense = [p for p in params if not p.expert]
    experts = [p for p in params if p.expert]
    out = [(ddp_buffer(dense, dims, pp_rank, chunk_index), dims.dp)]
    if experts:
        expert_dp = dims.expert_dp
        out.append((ddp_buffer(experts, dims, pp_rank, chunk_index, expert_dp), expert_dp))
    return out


def rank_chunks(
    arch: GPTArchitecture, dims: ParallelDims, pp_rank: int, lora: LoRAShape | None = None
) -> list[list[Param]]:
    """The parameter lists of every chunk of pipeline rank `pp_rank`."""
    return [chunk_parameters(arch, dims, pp_rank, v, lora) for v in range(dims.vpp or 1)]


def model_state(
    arch: GPTArchitecture,
    dims: ParallelDims,
    pp_rank: int = 0,
    dp_rank: int = 0,
    torch_adam_steps: bool = False,
    lora: LoRAShape | None = None,
    expert_dp_rank: int | None = None,
) -> ModelState:
    """Weights, gradients and optimizer state of the rank at (`pp_rank`, `dp_rank`).

    Args:
        torch_adam_steps: count torch AdamW's per-parameter 4-byte `step` tensors (the optimizer
            megatron-core uses without Transformer Engine or Apex).
        lora: the adapters of a LoRA run (None: full fine-tuning).
        expert_dp_rank: the rank in the expert-data-parallel group (MoE under the distributed
            optimizer: which shard of the experts' buffers it owns); None: `dp_rank` modulo
            the expert-DP size.
    """
    pbytes = PARAM_BYTES[dims.precision]
    half = dims.precision != "32"
    if expert_dp_rank is None:
        expert_dp_rank = dp_rank % dims.expert_dp
    count = weights = grads = optim = 0
    for i, params in enumerate(rank_chunks(arch, dims, pp_rank, lora)):
        count += sum(p.numel for p in params)
        frozen = sum(p.numel for p in params if not p.trainable)
        owned: list[int] = []
        for j, (buffer, group) in enumerate(chunk_buffers(params, dims, pp_rank, i)):
            grads += FP32 * buffer.numel
            if dims.distributed_optimizer:
                rank = expert_dp_rank if j else dp_rank  # the dense buffer comes first
                owned += [n for n in shard_elements(buffer, group, rank) if n]
                weights += pbytes * buffer.numel
        if dims.distributed_optimizer:
            weights += pbytes * frozen
        else:
            weights += pbytes * sum(p.numel for p in params)
            owned = [p.numel for p in params if p.trainable]
        elements = sum(owned)
        optim += 2 * FP32 * elements + (FP32 * elements if half else 0)
        if torch_adam_steps:
            optim += FP32 * len(owned)
    return ModelState(parameters=count, weights=weights, gradients=grads, optimizer=optim)


def largest_bucket(
    arch: GPTArchitecture, dims: ParallelDims, pp_rank: int, lora: LoRAShape | None = None
) -> int:
    """Elements of the largest DDP bucket of pipeline rank `pp_rank` (padding included)."""
    return max(
        (
            (b1 - b0)
            for i, params in enumerate(rank_chunks(arch, dims, pp_rank, lora))
            for buffer, _ in chunk_buffers(params, dims, pp_rank, i)
            for b0, b1 in buffer.buckets
        ),
        default=0,
    )


def total_parameters(arch: GPTArchitecture) -> int:
    """Parameters of the whole model (TP = PP = 1)."""
    return sum(p.numel for p in chunk_parameters(arch, ParallelDims(), 0))
