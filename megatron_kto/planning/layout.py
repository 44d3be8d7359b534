"""Recommend a layout for a model and a cluster: every valid layout, its memory per rank
(`memory.worst_rank`) and a roofline estimate of its KTO step time; the fastest that fits wins.

**Valid layouts.** TP divides the attention heads, the query groups and a fixed padded vocabulary
(`padded_vocab_size`, as a run on a Hugging Face model or a converted one has), TP ≤ GPUs per node
(tensor-parallel collectives need NVLink); PP divides the layers, or else the first and last
stages hold fewer layers than the others (`uneven_split`, shown as `PP (first/../last)`); DP = N / (TP·PP) and the global
batch divides into micro-batches × DP. Sequence parallelism is on whenever TP > 1 (same
communication volume, less activation memory), the distributed optimizer whenever DP > 1 (the
same bytes as an all-reduce: a reduce-scatter plus an all-gather). Micro-batch 1, 2, 4, 8;
recomputation none / selective / full (uniform, 1 layer); reference `separate`, `precomputed`,
`cpu_swap`. Every row of the global batch is `seq` tokens long (the worst case) and packed.
An MoE model adds every valid EP × ETP (`valid_expert_parallel`, the rules of
`config.validate`), with the distributed optimizer whenever DP or expert-DP > 1.

**Fits** when the worst rank's peak ≤ usable memory = 0.92 × GPU memory − 1.5 GiB (CUDA context,
NCCL and cuBLAS workspaces, allocator fragmentation: an assumption, not a measurement).

**Step time** (one KTO step of G rows; all terms per GPU, seconds):

* compute = model FLOPs / (peak FLOP/s × 0.6): `logging.throughput.architecture_flops` of the
  rows run — reference forward over samples + KL rows (2G; precomputed: the same FLOPs once per
  epoch, amortised), policy forward over the KL rows (G), forward + backward (3×) over the
  samples (G), + one more forward of the samples under full recomputation, + their attention
  scores again under selective — divided over the N GPUs; 0.6 is an achievable fraction of the
  datasheet peak for large GEMMs (assumption);
* weights read = every micro-batch pass reads this rank's weights (forward 1×, backward 2×) from
  HBM, and the optimizer step moves 16 bytes per owned parameter (Adam moments, main weights,
  gradients) over the HBM bandwidth — only what exceeds the compute of the same pass counts
  (roofline: a pass takes the larger of its compute and its memory time);
* TP = per layer and micro-batch, 2 all-reduces forward and 2 backward (or all-gather +
  reduce-scatter under SP, the same volume) of t·h·e bytes: 2·(TP − 1)/TP · bytes / link;
* PP = the 1F1B bubble, (PP − 1)/M of the pipelined passes' time, plus p2p sends of t·h·e;
* DP = reduce-scatter of fp32 gradients + all-gather of params: (DP − 1)/DP · P·(4 + e) / link
  (across nodes when TP·DP spans more than a node), half of it hidden behind the backward;
* `cpu_swap` = 3 copies of this rank's weights over PCIe per step;
* MoE: the FLOPs of k routed experts, the shared expert and the router replace the dense MLP's
  (`logging.throughput.moe_flops_per_token`); the routed experts' gradients go over expert-DP
  instead of DP; and
  per MoE layer and micro-batch pass the dispatch and combine all-to-alls move the t/sp·k token
  copies ((EP − 1)/EP of them, plus ETP − 1 times them for the ETP gather / reduce-scatter)
  over NVLink (the network when ETP·EP exceeds a node), forward passes and backward (2×).

**LoRA** (`lora`): the memory plan's LoRA terms (`model_state`, `activations`); the reference is
`adapters_off` (no weights) or `precomputed`; the backward computes input gradients only
(2 forward's FLOPs instead of 3 for forward+backward; the adapters' FLOPs are negligible), and
the optimizer step and the DP gradient traffic move the adapters only.

Bandwidths per GPU (datasheets; `GPU_TYPES`): HBM, NVLink (one direction) within a node and
the network between nodes (one 400 Gb/s NIC per GPU). FLOP/s: `throughput.datasheet_peak_flops`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.logging.throughput import architecture_flops, datasheet_peak_flops
from megatron_kto.planning.activations import ACT_BYTES, ActivationInputs
from megatron_kto.planning.memory import GiB, MemoryPlan, rank_states, worst_rank
from megatron_kto.planning.model_state import (
    LoRAShape,
    ModelState,
    ParallelDims,
    chunk_layer_range,
    model_state,
    rank_chunks,
)
from megatron_kto.runtime.precision import PRECISION_DTYPES

#: name -> (HBM bytes/s, intra-node link bytes/s per direction, device name for the FLOP/s table)
GPU_TYPES: dict[str, tuple[float, float, str]] = {
    "H100": (3.35e12, 450e9, "H100 SXM"),
    "H200": (4.8e12, 450e9, "H200"),
    "A100": (2.0e12, 300e9, "A100"),
    "L40S": (0.864e12, 32e9, "L40S"),
}
INTER_NODE = 50e9  # 400 Gb/s per GPU
PCIE = 25e9
ACHIEVABLE = 0.6
USABLE_FRACTION, RESERVED = 0.92, int(1.5 * GiB)
MICRO_BATCHES = (1, 2, 4, 8)
RECOMPUTE = (None, "selective", "full")
REFERENCES = ("separate", "precomputed", "cpu_swap")
LORA_REFERENCES = ("adapters_off", "precomputed")


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpu_memory: int
    """Bytes per GPU."""
    gpu_type: str = "H100"
    gpus_per_node: int = 8


@dataclass(frozen=True)
class Candidate:
    dims: ParallelDims
    micro_batch: int
    recompute: str | None
    reference: str
    plan: MemoryPlan
    step_time: float
    fits: bool
    mfu: float


def valid_parallel(
    arch: GPTArchitecture, cluster: Cluster
) -> list[tuple[int, int, int, tuple[int, int] | None]]:
    """(TP, PP, DP, uneven split) layouts that the model and the cluster allow; the split is
    None for an even one, else `uneven_split`'s (first, last) stage layer counts."""
    heads, groups = arch.num_attention_heads, arch.num_query_groups or arch.num_attention_heads
    out = []
    for tp in range(1, min(8, cluster.gpus_per_node, cluster.gpus) + 1):
        if heads % tp or groups % tp or cluster.gpus % tp:
            continue
        if arch.padded_vocab_size is not None and arch.padded_vocab_size % tp:
            continue  # the embedding rows must split over TP (config.layout refuses the run)
        for pp in range(1, arch.num_layers + 1):
            if cluster.gpus % (tp * pp):
                continue
            split = None if arch.num_layers % pp == 0 else uneven_split(arch.num_layers, pp)
            if arch.num_layers % pp == 0 or split is not None:
                out.append((tp, pp, cluster.gpus // (tp * pp), split))
    return out


def uneven_split(num_layers: int, pp: int) -> tuple[int, int] | None:
    """(first, last) stage layer counts for `num_layers` that PP does not divide, or None when
    there is none: every middle stage holds ceil(layers / PP), the first stage as many or what
    is left but one, the last stage (which also holds the output layer and loss) the rest; e.g.
    DeepSeek-V3's 61 layers at PP16: 4, 14 x 4, 1 (Megatron-LM's recipe)."""
    if pp < 2:
        return None
    per_stage = -(-num_layers // pp)
    ends = num_layers - per_stage * (pp - 2)
    first = min(per_stage, ends - 1)
    if first < 1:
        return None
    return first, ends - first


def valid_expert_parallel(
    arch: GPTArchitecture, cluster: Cluster, tp: int, pp: int, dp: int
) -> list[tuple[int, int | None]]:
    """(EP, ETP) pairs for a (TP, PP, DP) layout of an MoE model (ETP None: = TP), by the
    rules `config.validate` enforces for megatron-core 0.16.1: EP divides the experts; at
    ETP = TP, EP divides DP; ETP != TP needs EP > 1, divides the experts' hidden size, is at
    most a node, and ETP x EP divides TP x DP (the experts' grid ETP x EP x expert-DP x PP tiles
    the same world); biased experts (GPT-OSS) only at ETP 1. A dense model: [(1, None)]."""
    experts = arch.num_moe_experts
    if not experts:
        return [(1, None)]
    f = arch.moe_ffn_hidden_size or arch.ffn_hidden_size
    out: list[tuple[int, int | None]] = []
    for ep in range(1, experts + 1):
        if experts % ep:
            continue
        if dp % ep == 0:
            out.append((ep, None))
        for etp in (1, 2, 4, 8):
            if etp == tp or ep == 1 or f % etp or etp > cluster.gpus_per_node:
                continue
            if (tp * dp) % (etp * ep) == 0:
                out.append((ep, etp))
    if arch.add_bias_linear:  # megatron-core runs biased experts (GPT-OSS) at ETP 1 only
        out = [(ep, etp) for ep, etp in out if (tp if etp is None else etp) == 1]
    return out


def step_time(
    arch: GPTArchitecture,
    dims: ParallelDims,
    x: ActivationInputs,
    global_batch: int,
    seq: int,
    reference: str,
    cluster: Cluster,
    lora: LoRAShape | None = None,
    states: dict[tuple[int, int], ModelState] | None = None,
    experts: int | None = None,
) -> tuple[float, float]:
    """(seconds per KTO step, model FLOPs utilisation) by the roofline of the module docstring
    (`states`, `experts`: the ranks' model states and `expert_parameters`, if already
    computed)."""
    hbm, link, name = GPU_TYPES[cluster.gpu_type]
    peak = datasheet_peak_flops(name, PRECISION_DTYPES[dims.precision], tf32=True) or 1e15
    flops = architecture_flops(arch, arch.padded_vocab(dims.tp))  # MoE: the FLOPs a token uses
    row = flops.rows(torch.tensor([seq]))
    train = 2 if lora is not None else 3  # LoRA: no weight gradients of the frozen base
    model_flops = global_batch * row * (2 + 1 + train)
    extra = 0.0
    if x.recompute == "full":
        extra = global_batch * row
    elif x.recompute == "selective":
        extra = global_batch * flops.per_position * seq * seq
    compute = (model_flops + extra) / cluster.gpus / (peak * ACHIEVABLE)
    e = ACT_BYTES[dims.precision]
    if states is not None and lora is None:
        params_rank = max(states[(pp, 0)].parameters for pp in range(dims.pp))
    else:
        params_rank = sum_params(arch, dims)
    trained = sum_params(arch, dims, lora) - params_rank if lora is not None else params_rank
    passes = x.micro_batches * (2 + 1 + train)  # ref (2 passes' rows), KL, train fwd+bwd
    weights_io = passes * params_rank * e / hbm
    optim_io = 16 * trained / max(1, dims.dp if dims.distributed_optimizer else 1) / hbm
    memory = max(0.0, weights_io - compute) + optim_io
    stages = [chunk_layer_range(arch, dims, rank) for rank in range(dims.pp)]  # VPP: unplanned
    layers = max(len(stage) for stage in stages)
    t_bytes = x.tokens * arch.hidden_size * e
    tp_comm = 0.0
    if dims.tp > 1:
        per_pass = layers * 2 * 2 * (dims.tp - 1) / dims.tp * t_bytes / link
        tp_comm = x.micro_batches * per_pass * (1 + 1 + 2)  # fwd passes + backward (2 of them)
    pp_comm = 0.0
    bubble = 0.0
    if dims.pp > 1:
        pp_comm = x.micro_batches * 4 * t_bytes / link
        bubble = (dims.pp - 1) / x.micro_batches * (compute + tp_comm)
    ep_comm = 0.0
    moe_layers = max(sum(arch.is_moe_layer(i) for i in stage) for stage in stages)
    if moe_layers and dims.ep * dims.expert_tp > 1:
        # Dispatch and combine all-to-alls over EP of the t/sp·k token copies, gathered and
        # reduce-scattered over ETP; forward passes and the backward (twice).
        sp = dims.tp if dims.sequence_parallel else 1
        copies = x.tokens // sp * arch.moe_router_topk * arch.hidden_size * e
        volume = copies * ((dims.ep - 1) / dims.ep + dims.expert_tp - 1)
        bw = INTER_NODE if dims.ep * dims.expert_tp > cluster.gpus_per_node else link
        ep_comm = x.micro_batches * moe_layers * 2 * volume / bw * (1 + 1 + 2)
    dp_comm = 0.0
    if lora is not None:
        experts = 0
    elif experts is None:
        experts = expert_parameters(arch, dims)
    expert_dp = dims.expert_dp
    if dims.dp > 1 or expert_dp > 1:
        across = dims.tp * dims.dp > cluster.gpus_per_node
        bw = INTER_NODE if across else link
        dense_share = (dims.dp - 1) / dims.dp * (trained - experts)
        dp_comm = 0.5 * (dense_share + (expert_dp - 1) / expert_dp * experts) * (4 + e) / bw
    swap = 3 * params_rank * e / PCIE if reference == "cpu_swap" else 0.0
    total = compute + memory + tp_comm + ep_comm + pp_comm + bubble + dp_comm + swap
    mfu = global_batch * row * 6 / total / (cluster.gpus * peak)
    return total, mfu


def expert_parameters(arch: GPTArchitecture, dims: ParallelDims) -> int:
    """Routed-expert parameters of the first pipeline rank (0 for a dense model)."""
    if not arch.num_moe_experts:
        return 0
    return sum(p.numel for chunk in rank_chunks(arch, dims, 0) for p in chunk if p.expert)


def sum_params(arch: GPTArchitecture, dims: ParallelDims, lora: LoRAShape | None = None) -> int:
    """Parameters on the busiest pipeline rank (adapters included under LoRA)."""
    return max(model_state(arch, dims, pp, lora=lora).parameters for pp in range(dims.pp))


def candidates(
    arch: GPTArchitecture,
    cluster: Cluster,
    seq: int,
    global_batch: int,
    precision: str = "bf16",
    lora: LoRAShape | None = None,
) -> list[Candidate]:
    """Every valid layout × micro-batch × recomputation × reference, fastest first (those that
    fit before those that do not); of a LoRA run when `lora` is given."""
    usable = int(USABLE_FRACTION * cluster.gpu_memory) - RESERVED
    references = REFERENCES if lora is None else LORA_REFERENCES
    out = []
    layouts = [
        (tp, pp, dp, ep, etp, split)
        for tp, pp, dp, split in valid_parallel(arch, cluster)
        for ep, etp in valid_expert_parallel(arch, cluster, tp, pp, dp)
    ]
    states: dict[ParallelDims, dict[tuple[int, int], ModelState]] = {}
    experts: dict[ParallelDims, int] = {}
    for (tp, pp, dp, ep, etp, split), mbs, recompute, reference in itertools.product(
        layouts, MICRO_BATCHES, RECOMPUTE, references
    ):
        if global_batch % (mbs * dp):
            continue
        dims = ParallelDims(
            tp=tp,
            pp=pp,
            dp=dp,
            sequence_parallel=tp > 1,
            precision=precision,
            distributed_optimizer=dp > 1 or dp * tp // ((etp or tp) * ep) > 1,
            ep=ep,
            etp=etp,
            first=split and split[0],
            last=split and split[1],
        )
        if dims not in states:  # the same for every micro-batch, recomputation and reference
            states[dims] = rank_states(arch, dims, lora=lora)
            experts[dims] = expert_parameters(arch, dims) if lora is None else 0
        x = ActivationInputs(
            tokens=mbs * seq,
            seq_len=seq,
            scored=mbs * seq,
            micro_batches=global_batch // (mbs * dp),
            recompute=recompute,
            recompute_method="uniform" if recompute == "full" else None,
            recompute_num_layers=1 if recompute == "full" else None,
            native_gqa=precision != "32",
        )
        plan = worst_rank(arch, dims, x, reference, lora=lora, states=states[dims])
        seconds, mfu = step_time(
            arch, dims, x, global_batch, seq, reference, cluster, lora, states[dims], experts[dims]
        )
        out.append(
            Candidate(dims, mbs, recompute, reference, plan, seconds, plan.peak <= usable, mfu)
        )
    order = {r: i for i, r in enumerate(references)}
    return sorted(out, key=lambda c: (not c.fits, c.step_time, order[c.reference], c.plan.peak))


def format_candidates(
    found: list[Candidate], cluster: Cluster, top: int = 5, lora: LoRAShape | None = None
) -> list[str]:
    """The recommendation and the next best, or why nothing fits."""
    usable = (int(USABLE_FRACTION * cluster.gpu_memory) - RESERVED) / GiB
    lines = [
        f"{cluster.gpus} x {cluster.gpu_type}, {cluster.gpu_memory / 1e9:.0f} GB = "
        f"{cluster.gpu_memory / GiB:.1f} GiB each, {usable:.1f} GiB usable (0.92 x memory - "
        f"1.5 GiB)",
        "| TP | PP | DP | SP | micro-batch | recompute | reference | dist. optimizer | peak GiB "
        "| step s | MFU |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    moe = any(c.dims.ep > 1 or c.dims.etp is not None for c in found)
    if moe:  # the expert layout in columns of its own, after the dense table's
        lines[1] += " EP | ETP |"
        lines[2] += "---|---|"
    fitting = [c for c in found if c.fits]
    for c in (fitting or sorted(found, key=lambda c: c.plan.peak))[:top]:
        d = c.dims
        pp = f"{d.pp}" if d.first is None else f"{d.pp} ({d.first}/../{d.last})"
        lines.append(
            f"| {d.tp} | {pp} | {d.dp} | {'on' if d.sequence_parallel else 'off'} | "
            f"{c.micro_batch} | {c.recompute or 'none'} | {c.reference} | "
            f"{'on' if d.distributed_optimizer else 'off'} | {c.plan.peak / GiB:.1f} | "
            f"{c.step_time:.2f} | {c.mfu:.2f} |" + (f" {d.ep} | {d.expert_tp} |" if moe else "")
        )
    if not fitting:
        what = "LoRA" if lora else "full fine-tuning"
        if found:
            best = min(c.plan.peak for c in found) / GiB
            lines.append(
                f"does not fit: {what} needs at least {best:.1f} GiB per GPU (the smallest "
                f"above), {usable:.1f} GiB usable"
            )
        else:
            lines.append(
                f"does not fit: no valid {what} layout for this GPU count (the parallel sizes "
                "must divide the GPUs, layers, heads and experts)"
            )
    else:
        lines.append("recommended: the first row")
    return lines
