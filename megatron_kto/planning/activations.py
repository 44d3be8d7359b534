"""Activation memory of a training step: what the layers keep for their backward, how many
micro-batches keep it at once, and the transient tensors on top.

Per transformer layer and micro-batch of t tokens (t = rows × padded length, or the packed
length), e = bytes of the compute dtype (2 for bf16/fp16, 4 for fp32), TP = T, sp = T under
sequence parallelism (else 1), n heads, g query groups, d head dim, h hidden, f ffn hidden.
These are the tensors autograd saves in megatron-core's local layer spec with our norms and
`SDPAttention` (found with `torch.autograd.graph.saved_tensors_hooks` and checked by
`tests/test_memory_plan.py` against a measured step):

| tensor | bytes |
|---|---|
| two norms: input, normalised input, output (the next linear's input) each; fp32 1/rms | t/sp · (6·h·e + 2·4) |
| QKV projection output (alive through v, a view of it) | t · (n + 2g)·d/T · e |
| q and k after RoPE | t · (n + g)·d/T · e |
| RoPE cos/sin of q and k | 4 · d_rot · e per position (s positions padded, t packed) |
| attention output, fp32 log-sum-exp | t · n·d/T · e + t · n/T · 4 |
| packed: the rows' outputs concatenated | t · n·d/T · e |
| SwiGLU MLP: fc1 output, silu output, its product, and one more [t, f/T] | t · 5·f/T · e (GeLU: 2·f/T) |
| dropout masks (hidden_dropout > 0) | 2 · t/sp · h |
| Gemma: (1 + w) pre-norms (fp32 input copy + normalised), their Q/K norms, two post-norms | t/sp·2·h·(8 − e) + t·(n + g)·d/T·(8 − e) + 2·t/sp·(8·h + 4) (`gemma_norm_bytes`) |

**MoE layers** (`moe_mlp_bytes`; megatron-core's all-to-all dispatcher and `SequentialMLP`
experts, found the same way), with t_l = t/sp local tokens, k experts per token, E experts,
f_e = f_moe/ETP, and R = t_l·k·ETP routed token copies this rank's experts compute (balanced
routing: as many arrive over EP as leave; gathered over ETP), replacing the MLP row:

| tensor | bytes |
|---|---|
| top-k indices (int64) and probabilities (fp32), the permutation's sort indices (int64) | t_l·k·20 |
| routing map (bool) and probabilities over all experts | t_l·E·(1 + e) |
| experts: their input copies, fc1 output (2·f_e), four [R, f_e] of SwiGLU × probability, the permuted probabilities | R·(h + 6·f_e + 1)·e |
| shared expert: as a dense MLP of its width S; its gate's output and the expert output it scales | t·5·S/T·e + t_l·(h + 1)·e |

A model with dense layers (`moe_layer_freq`) plans every layer as the larger kind. The layer
backward's transient of an MoE layer (`moe_transient_bytes`) is the gradients of the routed
copies and their exchange (3·R·h·e) plus R·4·f_e·e, and its largest weight gradient the larger
of an expert's and the shared expert's fc1. Not modelled: routing imbalance (a rank whose
experts receive more than their share keeps proportionally more) and, on CPU, gloo's staging
copies of the all-to-alls (measured: up to a few MiB more at EP = 2, `tests/test_plan_moe.py`).

Without grouped KV support in the kernel (CUDA fp32, or a mask), k and v are expanded to n
heads: q + 2·n·d/T instead of (n + 2g)·d/T + (n + g)·d/T. Selective recomputation of core
attention drops the attention output's log-sum-exp (the rest is still saved by its neighbours).

Per stage and micro-batch: the first keeps the token ids (8·t); the last keeps the final norm
(t/sp·(2·h·e + 4)) and, for the chunked output layer, the N scored positions' hidden states
(N·h·e) and their indices, targets and log-sum-exp (N·20).

**In flight.** PP = 1 runs each micro-batch's backward right after its forward: one micro-batch.
1F1B keeps min(PP − r, M) micro-batches on pipeline rank r (M micro-batches per step); the
interleaved schedule keeps min(M·v, 2·(PP − r − 1) + (v − 1)·PP + 1) chunk-micro-batches of
L/(PP·v) layers each. On CPU megatron also keeps each non-last stage's output [t/sp, h] until its
backward (it frees them on CUDA only).

**Recomputation.** full/uniform with k layers per block: each block keeps its input
(t/sp·h·e), and one block's k layers are live again during its backward; full/block: the first
k layers of each chunk keep only their inputs; each is recomputed alone after the chunk's
later layers freed theirs (so no extra, unless all layers of the chunk are recomputed).

**Transients** (the largest wins): a layer's backward — max(t·4·f/T·e of MLP gradients,
t·2·f/T·e plus its largest weight's gradient in the compute dtype, and an fp32 copy of it for
the addition to the fp32 buffer when the dtypes differ; measured on one layer's backward over
h, f, s and dtype) — and the chunked output layer's backward (the [V/T, h] weight gradient, a
chunk's c·V/T fp32 softmax plus its compute-dtype copy, N·h·e for the hidden-state gradient).
Without chunking (logprob_chunk_size 0) the full [t, V/T] logits are kept: t·V/T·(e + 8).
Under sequence parallelism megatron's global buffer for all-gathered sequences stays allocated
(longest micro-batch · h · e).

**LoRA** (`lora_layer_bytes`, `peft.lora.LoRALinear.forward`). A frozen linear runs megatron's
`LinearWithFrozenWeight`, which saves only its weight, and a norm with a frozen weight does not
save its normalised input: of the table's norm tensors only the inputs (and 1/rms) remain, and a
linear's input (norm output, packed attention output, the SwiGLU product) is kept only when an
adapter of that linear saves it (x for A's gradient). Per adapted linear with k adapted
projections the adapter adds its r-wide activation u = x·Aᵀ·scaling, saved by the B matmul
(t·k·r·e; row-parallel under SP: t/sp·r·e), the concatenated A it multiplied by (k·r·in/T·e, a
copy per forward) and, for fused linears (q/k/v, gate/up), the block-structured fused B
(out/T·k·r·e). No base weight gradient exists: the layer backward's and the output layer's
weight-gradient transients drop out, and the frozen embedding keeps no token ids. Every layer
is planned like a middle one (the first layer's input norm saves nothing: an over-estimate), a
layer selection as if every layer were adapted.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.peft.targets import projection_shape, resolve_targets
from megatron_kto.planning.mla import mla_largest_weight, mla_saved_bytes
from megatron_kto.planning.model_state import (
    LoRAShape,
    ParallelDims,
    layers_per_chunk,
)

ACT_BYTES = {"32": 4, "bf16": 2, "16": 2}
#: The linears that read the attention's input norm output: full attention's QKV, multi-latent
#: attention's query / key-value input projections.
_NORMED_INPUT_LINEARS = {"linear_qkv", "linear_q_proj", "linear_q_down_proj", "linear_kv_down_proj"}
#: Chunk length of the delta rule's scan (`models.delta_rule.DEFAULT_CHUNK_SIZE`; not imported:
#: planning runs before torch is needed).
DELTA_RULE_CHUNK = 64


@dataclass(frozen=True)
class ActivationInputs:
    """What the step runs, beyond the architecture and layout."""

    tokens: int
    """Tokens per training micro-batch (rows × padded length, or the packed length)."""
    seq_len: int
    """Padded row length (RoPE tables of an unpacked micro-batch are per position)."""
    scored: int
    """Scored (completion) positions per micro-batch: what the chunked output layer runs on."""
    micro_batches: int
    """Training micro-batches per step on each DP rank (M)."""
    packed: bool = True
    recompute: str | None = None
    """None, 'full' or 'selective'."""
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    chunk_size: int = 1024
    """`model.logprob_chunk_size` (0: full logits)."""
    forward_tokens: int = 0
    """Tokens per forward-only micro-batch (reference and KL passes); 0: `tokens`."""
    native_gqa: bool = True
    """The attention kernel takes grouped KV as is (CPU; CUDA bf16/fp16 flash)."""
    keep_pipeline_outputs: bool = False
    """megatron keeps stage outputs until their backward (on CPU; CUDA frees them)."""
    gloo: bool = False
    """Collectives run on gloo (CPU), whose reduce-scatter and all-gather stage a full-size
    copy of their input / output (NCCL's run in place)."""


@dataclass(frozen=True)
class Activations:
    """Activation bytes of one rank at its peak."""

    saved: int
    """Kept for the backward by all micro-batches in flight."""
    transient: int
    """The largest short-lived working set on top of `saved`."""
    layer: int
    """One layer's saved bytes for one micro-batch (for the table)."""
    in_flight: int
    """Micro-batches (chunk-micro-batches when interleaved) whose activations are kept."""

    @property
    def total(self) -> int:
        return self.saved + self.transient


def _dims(arch: GPTArchitecture) -> tuple[int, int, int, int, int]:
    heads = arch.num_attention_heads
    return (
        arch.hidden_size,
        arch.ffn_hidden_size,
        heads,
        arch.num_query_groups or heads,
        arch.kv_channels or arch.hidden_size // heads,
    )


def _adapted_linears(arch: GPTArchitecture, lora: LoRAShape | None) -> set[str] | None:
    if lora is None:
        return None
    return {t.linear.rsplit(".", 1)[-1] for t in resolve_targets(list(lora.targets), arch)}


def layer_bytes(
    arch: GPTArchitecture,
    dims: ParallelDims,
    x: ActivationInputs,
    lora: LoRAShape | None = None,
    moe: bool = False,
    linear: bool = False,
) -> int:
    """One transformer layer's saved tensors for one micro-batch (the table above; a LoRA
    layer's base part when `lora` is given — the adapters' own: `lora_layer_bytes`; an MoE
    layer's when `moe`; a gated DeltaNet layer's when `linear`, `deltanet_bytes`)."""
    h, f, n, g, d = _dims(arch)
    e, T, t = ACT_BYTES[dims.precision], dims.tp, x.tokens
    sp = T if dims.sequence_parallel else 1
    adapted = _adapted_linears(arch, lora)
    if adapted is None:
        total = t // sp * (6 * h * e + 2 * 4)
    else:  # norm inputs and 1/rms; a norm output only as an adapted linear's input
        qkv = {"in_proj"} if linear else _NORMED_INPUT_LINEARS
        inputs = 2 + bool(qkv & adapted) + ("linear_fc1" in adapted)
        total = t // sp * (inputs * h * e + 2 * 4)
    if linear:
        total += deltanet_bytes(arch, dims, x)
    else:
        total += _attention_bytes(arch, dims, x, adapted)
    if moe:
        total += moe_mlp_bytes(arch, dims, x)
    else:
        mlp = 5 if arch.gated_mlp else 2
        if adapted is not None and "linear_fc2" not in adapted:
            mlp -= 1  # fc2's input, saved only by an fc2 adapter
        total += t * mlp * f // T * e
    if arch.hidden_dropout > 0:
        total += 2 * t // sp * h
    return total + gemma_norm_bytes(arch, dims, x, linear)


def _attention_bytes(
    arch: GPTArchitecture, dims: ParallelDims, x: ActivationInputs, adapted: set[str] | None
) -> int:
    """A full-attention layer's attention half (the QKV … packed rows of the table)."""
    _, _, n, g, d = _dims(arch)
    e, T, t = ACT_BYTES[dims.precision], dims.tp, x.tokens
    if arch.multi_latent_attention:
        total = mla_saved_bytes(arch, T, t, e)
        total += 4 * arch.qk_rope_head_dim * e * (t if x.packed else x.seq_len)
    else:
        if x.native_gqa or g == n:
            total = t * ((n + 2 * g) + (n + g)) * d // T * e
        else:
            total = t * 3 * n * d // T * e
        if arch.position_embedding_type == "rope":
            rot = int(d * arch.rotary_percent)
            total += 4 * rot * e * (t if x.packed else x.seq_len)
        total += t * n * d // T * e
    if x.recompute != "selective":
        total += t * n // T * 4
    if x.packed and (adapted is None or "linear_proj" in adapted):
        total += t * n * d // T * e
    if arch.attention_output_gate:  # the gates beside the queries, sigmoid(gate), the product
        total += 3 * t * n * d // T * e
    return total


def deltanet_bytes(arch: GPTArchitecture, dims: ParallelDims, x: ActivationInputs) -> int:
    """What a gated DeltaNet layer's attention half (`models.gated_delta_net`, our chunked delta
    rule) saves for one micro-batch: its in_proj output, the convolution's input window and
    output (the Hk·dk and Hv·dv terms), the repeated, normalised q/k per value head (Hv·dk), each
    chunk's [C, C] decay / attention / triangular-solve matrices (Hv·C per token) and the
    recurrent state entering every chunk (Hv·dk·dv per C tokens), all in fp32 (the rule computes
    in fp32). Coefficients measured with `saved_tensors_hooks` over head counts and dims, tokens
    rounded up to whole chunks of C = 64: within 2% of a measured layer on whole chunks, up to 8%
    over with a partial last chunk (`tests/test_plan_hybrid.py`)."""
    T = dims.tp
    hk, hv = arch.linear_num_key_heads // T, arch.linear_num_value_heads // T
    dk, dv, c = arch.linear_key_head_dim, arch.linear_value_head_dim, DELTA_RULE_CHUNK
    tokens = -(-x.tokens // c) * c
    per_token = 12 * hk * dk + 14 * hv * dv + 6 * hv * c + 9 * hv * dk + 6 * hv * dk * dv // (5 * c)
    return tokens * per_token * 4


def gemma_norm_bytes(
    arch: GPTArchitecture, dims: ParallelDims, x: ActivationInputs, linear: bool = False
) -> int:
    """What Gemma's norms (`models.gemma_layers`, `models.norms`) save beyond the table's two
    norms, per layer and micro-batch: a (1 + w) norm of N elements keeps an fp32 copy of its input
    instead of the e-byte input and the fp32 normalised tensor ((8 − e)·N more: pre-norms and
    Q/K norms); each post-norm keeps its input and 1/rms (fp32 input + normalised, 8·N, when
    zero-centered)."""
    h, _, n, g, d = _dims(arch)
    e, T, t = ACT_BYTES[dims.precision], dims.tp, x.tokens
    sp = T if dims.sequence_parallel else 1
    total = 0
    if arch.zero_centered_norms:
        total += t // sp * 2 * h * (8 - e)
        if arch.qk_layernorm and not linear:
            total += t * (n + g) * d // T * (8 - e)
    if arch.post_norms:
        per = 8 if arch.zero_centered_norms else e
        total += 2 * t // sp * (h * per + 4)
    return total


def routed_tokens(arch: GPTArchitecture, dims: ParallelDims, x: ActivationInputs) -> int:
    """Token copies one rank's experts compute per micro-batch: its t/sp tokens, k copies each,
    exchanged over EP (balanced routing: as many arrive as leave) and gathered over ETP."""
    sp = dims.tp if dims.sequence_parallel else 1
    return x.tokens // sp * arch.moe_router_topk * dims.expert_tp


def moe_mlp_bytes(arch: GPTArchitecture, dims: ParallelDims, x: ActivationInputs) -> int:
    """What an MoE layer's MLP saves for its backward for one micro-batch, beyond its input (the
    MoE table of the module docstring)."""
    if not arch.gated_mlp:
        raise ValueError("memory planning of mixture-of-experts layers without a gated MLP")
    e, T = ACT_BYTES[dims.precision], dims.tp
    sp = T if dims.sequence_parallel else 1
    local, k, experts = x.tokens // sp, arch.moe_router_topk, arch.num_moe_experts or 0
    f = (arch.moe_ffn_hidden_size or arch.ffn_hidden_size) // dims.expert_tp
    routed = routed_tokens(arch, dims, x)
    total = local * k * (8 + 4 + 8) + local * experts * (1 + e)
    total += routed * (arch.hidden_size + 6 * f + 1) * e
    if arch.activation_clamp is not None:
        # GPT-OSS's unfused clamped GLU keeps the two clamped halves too (an estimate: not
        # measured against a run, unlike the SwiGLU count above).
        total += routed * 2 * f * e
    shared = arch.moe_shared_expert_intermediate_size
    if shared:
        total += x.tokens * 5 * shared // T * e
        if arch.moe_shared_expert_gate:
            total += local * (arch.hidden_size + 1) * e
    return total


def lora_layer_bytes(
    arch: GPTArchitecture,
    dims: ParallelDims,
    x: ActivationInputs,
    lora: LoRAShape,
    linear: bool = False,
) -> int:
    """What one layer's adapters save for their backward for one micro-batch (module docstring);
    in a hybrid model, of a gated DeltaNet layer (`linear`) or a full-attention one."""
    e, T, t, r = ACT_BYTES[dims.precision], dims.tp, x.tokens, lora.rank
    sp = T if dims.sequence_parallel else 1
    total = 0
    kinds = list(arch.linear_attention_freq or [0])
    layer = kinds.index(int(linear)) if int(linear) in kinds else None
    for target in resolve_targets(list(lora.targets), arch, layer):
        k = len(target.projections)
        fan_in = projection_shape(target.projections[0], arch)[0]
        if target.column:
            total += t * k * r * e + k * r * fan_in * e
            if len(target.all_projections) > 1:
                out = sum(projection_shape(p, arch)[1] for p in target.all_projections)
                total += out // T * k * r * e
        else:
            total += t // sp * r * e + r * fan_in // T * e
    return total


def _in_flight(dims: ParallelDims, pp_rank: int, micro_batches: int) -> int:
    pp, v = dims.pp, dims.vpp or 1
    if pp == 1:
        return 1
    if v == 1:
        return min(pp - pp_rank, micro_batches)
    return min(micro_batches * v, 2 * (pp - pp_rank - 1) + (v - 1) * pp + 1)


def _kept_per_chunk(arch, dims, x: ActivationInputs, layer: int, pp_rank: int) -> tuple[int, int]:
    """(bytes a chunk of `pp_rank` keeps per micro-batch, layers live again during a recomputed
    backward)."""
    layers = layers_per_chunk(arch, dims, pp_rank)
    sp = dims.tp if dims.sequence_parallel else 1
    checkpoint_input = x.tokens // sp * arch.hidden_size * ACT_BYTES[dims.precision]
    if x.recompute != "full":
        return layers * layer, 0
    k = x.recompute_num_layers or 1
    if (x.recompute_method or "uniform") == "uniform":
        return -(-layers // k) * checkpoint_input, min(k, layers)
    k = min(k, layers)
    # Each of the k layers is recomputed alone, after the chunk's other layers have freed theirs.
    return k * checkpoint_input + (layers - k) * layer, 1 if k == layers else 0


def head_bytes(arch: GPTArchitecture, dims: ParallelDims, x: ActivationInputs) -> tuple[int, int]:
    """(saved, backward transient) of the last stage's final norm and output layer."""
    h, e, T = arch.hidden_size, ACT_BYTES[dims.precision], dims.tp
    sp = T if dims.sequence_parallel else 1
    vocab = arch.padded_vocab(T) // T
    norm = x.tokens // sp * (2 * h * e + 4)
    if arch.zero_centered_norms:  # the fp32 input copy and normalised tensor (`gemma_norm_bytes`)
        norm += x.tokens // sp * h * (8 - e)
    if x.chunk_size == 0:
        return norm + x.tokens * vocab * (e + 8), vocab * h * e
    chunk = min(x.chunk_size, x.scored)
    saved = norm + x.scored * (h * e + 20)
    transient = vocab * h * e + chunk * vocab * (4 + (e if e != 4 else 0)) + x.scored * h * e
    return saved, transient


def activation_bytes(
    arch: GPTArchitecture,
    dims: ParallelDims,
    x: ActivationInputs,
    pp_rank: int = 0,
    lora: LoRAShape | None = None,
) -> Activations:
    """Peak activation bytes of pipeline rank `pp_rank` during a training step (of LoRA
    adapters when `lora` is given).

    An MoE model's layers are all planned as its larger kind (MoE or, with `moe_layer_freq`,
    dense), whichever layers the stage holds.
    """
    h, f, *_ = _dims(arch)
    e, T = ACT_BYTES[dims.precision], dims.tp
    sp = T if dims.sequence_parallel else 1
    vpp = dims.vpp or 1
    first, last = pp_rank == 0, pp_rank == dims.pp - 1
    kinds = _layer_kinds(arch)
    layer = max(
        layer_bytes(arch, dims, x, lora, moe, linear)
        + (0 if lora is None else lora_layer_bytes(arch, dims, x, lora, linear))
        for moe in kinds
        for linear in _attention_kinds(arch)
    )
    per_chunk, recomputed = _kept_per_chunk(arch, dims, x, layer, pp_rank)
    in_flight = _in_flight(dims, pp_rank, x.micro_batches)
    saved = in_flight * per_chunk
    if x.keep_pipeline_outputs and not (last and vpp == 1):
        saved += in_flight * x.tokens // sp * h * e
    if first and lora is None:
        saved += min(in_flight, vpp) * 8 * x.tokens
    if dims.sequence_parallel:
        # megatron's global "mpu" buffer for the all-gathered sequence: allocated by the first
        # gather, kept for the run, as large as the longest micro-batch gathered.
        saved += max(x.tokens, x.forward_tokens) * h * e
    head_transient = 0
    if last:
        head_saved, head_transient = head_bytes(arch, dims, x)
        saved += head_saved
        if lora is not None:  # no gradient of the frozen output layer
            head_transient -= arch.padded_vocab(T) // T * h * e
    mlp_weight = 0
    if False in kinds:
        mlp_weight = (2 if arch.gated_mlp else 1) * f * h // T
    if True in kinds:
        moe_f = arch.moe_ffn_hidden_size or f
        shared = arch.moe_shared_expert_intermediate_size or 0
        mlp_weight = max(mlp_weight, 2 * moe_f * h // dims.expert_tp, 2 * shared * h // T)
    in_proj = 0
    if True in _attention_kinds(arch):  # a DeltaNet in_proj: [2·Hk·dk + 2·Hv·dv + 2·Hv, h] / T
        qk = arch.linear_num_key_heads * arch.linear_key_head_dim
        hv = arch.linear_num_value_heads
        in_proj = (2 * qk + 2 * hv * arch.linear_value_head_dim + 2 * hv) * h // T
    attention_weight = (
        mla_largest_weight(arch, T)
        if arch.multi_latent_attention
        else (arch.num_attention_heads + 2 * (arch.num_query_groups or arch.num_attention_heads))
        * (arch.kv_channels or h // arch.num_attention_heads)
        * h
        // T
    )
    largest_weight = max(mlp_weight, in_proj, attention_weight)
    # A weight's gradient exists in the compute dtype before megatron adds it to the fp32
    # buffer (plus an fp32 copy of it for the addition when the dtypes differ).
    weight_grad = 0 if lora is not None else largest_weight * (e + (4 if e != 4 else 0))
    layer_transient = 0
    if False in kinds:
        layer_transient = max(4 * f // T * x.tokens * e, 2 * f // T * x.tokens * e + weight_grad)
    if True in kinds:
        layer_transient = max(layer_transient, moe_transient_bytes(arch, dims, x) + weight_grad)
    transient = max(layer_transient + recomputed * layer, head_transient)
    return Activations(saved=saved, transient=transient, layer=layer, in_flight=in_flight)


def _attention_kinds(arch: GPTArchitecture) -> set[bool]:
    """{False} without DeltaNet layers; True for gated DeltaNet layers, False for full attention
    (a hybrid model plans every layer as its larger kind, as an MoE model does)."""
    return {bool(k) for k in arch.linear_attention_freq or [0]}


def _layer_kinds(arch: GPTArchitecture) -> set[bool]:
    """{False} for a dense model; {True} (MoE layers), plus False with dense layers."""
    if not arch.num_moe_experts:
        return {False}
    return {True, False} if arch.has_dense_layers() else {True}


def moe_transient_bytes(arch: GPTArchitecture, dims: ParallelDims, x: ActivationInputs) -> int:
    """The largest short-lived working set of an MoE layer's backward (besides a weight's
    gradient): the gradients of the routed token copies — the experts' output and input
    gradients and their exchange over EP and ETP — R·h·e each, and one expert's fc1 gradient."""
    e = ACT_BYTES[dims.precision]
    routed = routed_tokens(arch, dims, x)
    f = (arch.moe_ffn_hidden_size or arch.ffn_hidden_size) // dims.expert_tp
    return 3 * routed * arch.hidden_size * e + routed * 4 * f * e


def forward_only_bytes(arch: GPTArchitecture, dims: ParallelDims, x: ActivationInputs) -> int:
    """Peak working set of a forward-only pass (reference, KL rows), nothing kept across layers:
    the hidden stream (t·h·e) plus the larger of a layer's live tensors (t·e·(2·h/sp + 4·f/T +
    2·(n + 2g)·d/T)) and the output layer's chunk (c·V/T·(4 + e) + N·h·e).

    An MoE layer's MLP part is its backward transient's routed token copies at `t` tokens
    (`moe_transient_bytes`) in place of the 4·f/T.
    """
    h, f, n, g, d = _dims(arch)
    e, T = ACT_BYTES[dims.precision], dims.tp
    sp = T if dims.sequence_parallel else 1
    t = x.forward_tokens or x.tokens
    scored = min(x.scored * t // max(1, x.tokens), t)
    vocab = arch.padded_vocab(T) // T
    mlp = 0
    kinds = _layer_kinds(arch)
    if False in kinds:
        mlp = t * 4 * f // T * e
    if True in kinds:
        mlp = max(mlp, moe_transient_bytes(arch, dims, replace(x, tokens=t)))
    layer = t * e * (2 * h // sp + 2 * (n + 2 * g) * d // T) + mlp
    chunk = min(x.chunk_size or t, scored)
    head = chunk * vocab * (4 + e) + scored * h * e
    return t // sp * h * e + max(layer, head)
