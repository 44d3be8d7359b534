"""Predicted vs measured memory per rank: the memory plan checked against real steps.

    python tools/bench_memory_plan.py                      # the layouts of docs/performance.md
    python tools/bench_memory_plan.py --layout tp2_dp2     # one of them

Each layout builds the bundled example's config (`conf/example/tiny_kto.yaml`) with a wider
model, launches its ranks on gloo (the tests' spawn helper), and on every rank:

1. builds the policy, its reference, DDP and the optimizer with the trainer's own functions
   (`run._build_policy`, `run._build_optimization`);
2. runs one KTO step (reference pass, KL pass, forward+backward, optimizer step) on a batch of
   full-length rows through the trainer's model API, so that Adam's state exists;
3. runs two more steps, each a measured window of `planning.measure.AllocationTrace` (which
   traces every allocation from before the model is built), and counts the model state's bytes
   of real tensors (`planning.measure.model_state_bytes`); the measured peak is the model
   state plus the smaller of the two steps' rises in live bytes (a rise is immune to the
   running total's drift when gloo's worker thread frees a staging copy the profiler cannot
   see; see `AllocationTrace`), and "other" (what else was live at the first window's start)
   is printed beside it;
4. evaluates the plan (`planning.memory.plan_rank`) for that rank and the batch's real
   micro-batch shape.

Prints one row per rank: predicted and measured model state (equal when the plan is right)
and peak (model state + the step's allocation peak), and their ratio.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

#: The model of every layout: wide enough that activations and state are both visible.
MODEL = [
    "model.num_layers=4",
    "model.hidden_size=256",
    "model.ffn_hidden_size=704",
    "model.num_attention_heads=8",
    "model.num_query_groups=4",
    "model.data.max_length=128",
    "model.encoder_seq_length=128",
    "model.vocab_size=4000",
    "model.global_batch_size=8",
    "model.micro_batch_size=2",
]

#: Why the distributed-optimizer layouts run with `model.optim.overlap_grad_sync=false`: gloo's
#: reduce-scatter stages a copy of its whole input (`planning.memory`), and an overlapped
#: (asynchronous) one's copy can outlive its step until gloo drops the finished work — seen on
#: one rank of four as a second 19 MiB copy alive at the next step's start. NCCL has no copy.
NO_OVERLAP_REASON = "gloo keeps an asynchronous reduce-scatter's staging copy alive"

#: A mixture-of-experts variant of the model: 4 experts of 96, top-2, Q/K norms, a gated shared
#: expert of 64 (Qwen2-MoE's parts and Qwen3-MoE's together).
MOE = [
    "model.num_moe_experts=4",
    "model.moe_ffn_hidden_size=96",
    "model.moe_router_topk=2",
    "model.qk_layernorm=true",
    "model.moe_shared_expert_intermediate_size=64",
    "model.moe_shared_expert_gate=true",
]

#: A Gemma 3 (`models.gemma_layers`): windows, local RoPE base, (1 + w) pre-, post- and Q/K norms.
GEMMA3 = [
    "model.activation=geglu",
    "model.post_norms=true",
    "model.zero_centered_norms=true",
    "model.qk_layernorm=true",
    "model.sliding_window=16",
    "model.window_layers=[1,0,1,0]",
    "model.rotary_base_local=10000",
    "model.embedding_multiplier=16.0",
    "model.softmax_scale=0.1",
]

#: The distributed optimizer in bf16 (overlap off: see NO_OVERLAP_REASON).
DISTOPT_BF16 = [
    "model.optim.name=distributed_fused_adam",
    "model.optim.overlap_grad_sync=false",
    "trainer.precision=bf16",
]

#: name -> (world size, overrides)
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "single": (1, []),
    "single_unpacked": (1, ["model.data.pack_sequences=false"]),
    "single_bf16_full_recompute": (
        1,
        ["trainer.precision=bf16", "model.activations_checkpoint_granularity=full"],
    ),
    "single_selective_separate": (
        1,
        [
            "model.activations_checkpoint_granularity=selective",
            "model.kto.reference_policy=separate",
        ],
    ),
    "tp2_sp": (2, ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"]),
    "dp2_distopt_bf16": (
        2,
        # Overlap off: see NO_OVERLAP_REASON.
        [
            "model.optim.name=distributed_fused_adam",
            "model.optim.overlap_grad_sync=false",
            "trainer.precision=bf16",
        ],
    ),
    "pp2": (2, ["model.pipeline_model_parallel_size=2"]),
    "pp2_unpacked_recompute": (
        2,
        [
            "model.pipeline_model_parallel_size=2",
            "model.data.pack_sequences=false",
            "model.activations_checkpoint_granularity=full",
            "model.activations_checkpoint_method=block",
            "model.activations_checkpoint_num_layers=1",
        ],
    ),
    "tp2": (2, ["model.tensor_model_parallel_size=2"]),
    "tp2_dp2": (4, ["model.tensor_model_parallel_size=2"]),
    "tp2_dp2_gemma3": (4, ["model.tensor_model_parallel_size=2", *GEMMA3]),
    "pp2_dp2_unpacked_block_recompute": (
        4,
        [
            "model.pipeline_model_parallel_size=2",
            "model.data.pack_sequences=false",
            "model.activations_checkpoint_granularity=full",
            "model.activations_checkpoint_method=block",
            "model.activations_checkpoint_num_layers=1",
        ],
    ),
    "dp4_distopt_bf16_uniform_recompute": (
        4,
        [
            "model.optim.name=distributed_fused_adam",
            "model.optim.overlap_grad_sync=false",
            "trainer.precision=bf16",
            "model.global_batch_size=16",
            "model.activations_checkpoint_granularity=full",
            "model.activations_checkpoint_num_layers=2",
        ],
    ),
    "tp2_pp2_selective_separate": (
        4,
        [
            "model.tensor_model_parallel_size=2",
            "model.pipeline_model_parallel_size=2",
            "model.activations_checkpoint_granularity=selective",
            "model.kto.reference_policy=separate",
        ],
    ),
    "pp2_vpp2_dp2": (
        4,
        ["model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2"],
    ),
    # LoRA (reference = adapters off): only the adapters have DDP buffers and optimizer state;
    # TP shards half of each adapter, the distributed optimizer shards and pads their buffer.
    "tp2_dp2_lora_distopt": (
        4,
        [
            "model.tensor_model_parallel_size=2",
            "model.peft.peft_scheme=lora",
            "model.peft.lora_tuning.adapter_dim=16",
            "model.optim.name=distributed_fused_adam",
            "model.optim.overlap_grad_sync=false",
        ],
    ),
    # Mixture of experts: the routed experts in DDP buffers and optimizer shards of their own
    # (expert-DP = world / (ETP x EP x PP)), at EP=1 (expert-DP = DP = 2), EP=2 with expert-DP
    # 2 of DP 4, TP=2 x ETP=1 x EP=2, and PP=2 x EP=2 with a dense layer.
    "moe_ep1_dp2_distopt_bf16": (2, [*MOE, *DISTOPT_BF16]),
    "moe_ep2_dp4_distopt_bf16": (
        4,
        [*MOE, *DISTOPT_BF16, "model.expert_model_parallel_size=2"],
    ),
    "moe_tp2_sp_etp1_ep2": (
        2,
        [
            *MOE,
            "model.tensor_model_parallel_size=2",
            "model.sequence_parallel=true",
            "model.expert_tensor_parallel_size=1",
            "model.expert_model_parallel_size=2",
        ],
    ),
    "moe_pp2_ep2_dense_layer": (
        4,
        [
            *MOE,
            "model.pipeline_model_parallel_size=2",
            "model.expert_model_parallel_size=2",
            "model.moe_layer_freq=[1,0,1,1]",
        ],
    ),
    "single_lora_bf16": (
        1,
        [
            "model.peft.peft_scheme=lora",
            "model.peft.lora_tuning.adapter_dim=8",
            "model.peft.lora_tuning.target_modules=[attention_qkv,mlp_fc2]",
            "trainer.precision=bf16",
        ],
    ),
}


def _batch(rows: int, length: int, vocab: int, seed: int):
    """A KTO batch of `rows` full-length rows (prompt a quarter, completion the rest)."""
    import torch

    from megatron_kto.data.collate import kto_custom_collate

    g = torch.Generator().manual_seed(seed)
    prompt = length // 4
    examples = [
        {
            "prompt_ids": [3 + i] + torch.randint(3, vocab, (prompt - 1,), generator=g).tolist(),
            "completion_ids": torch.randint(3, vocab, (length - prompt,), generator=g).tolist(),
            "label": i % 2 == 0,
        }
        for i in range(rows)
    ]
    return kto_custom_collate(examples, pad_id=0)


def measure_rank(rank: int, world: int, overrides: list[str]) -> dict:
    """Build and run a layout on this rank (see the module docstring); predicted vs measured."""
    from megatron.core import parallel_state
    from megatron.core.optimizer import USING_PYTORCH_OPTIMIZER

    from megatron_kto import run
    from megatron_kto.algorithms.reference_strategies import choose_reference
    from megatron_kto.entry import compose_run_config
    from megatron_kto.models.builder import unwrap
    from megatron_kto.models.reference import SeparateReference
    from megatron_kto.models.schedule import row_lengths, scored_per_row, to_device
    from megatron_kto.models.training_setup import zero_grads
    from megatron_kto.planning.measure import AllocationTrace, host_bytes, model_state_bytes
    from megatron_kto.planning.memory import plan_rank, run_inputs, with_tokens
    from megatron_kto.planning.model_state import rank_chunks
    from megatron_kto.runtime import init_runtime, teardown

    prepared = compose_run_config("gpt_kto", [*MODEL, *overrides], world_size=world)
    cfg, arch = prepared.cfg, prepared.architecture
    m = cfg.model
    with AllocationTrace() as trace:
        runtime = init_runtime(
            m.tensor_model_parallel_size,
            m.pipeline_model_parallel_size,
            m.virtual_pipeline_model_parallel_size,
            seed=m.seed,
            device="cpu",
            expert_parallel_size=m.expert_model_parallel_size,
            expert_tensor_parallel_size=m.expert_tensor_parallel_size,
        )
        layout = run._layout(cfg)
        reference = choose_reference(cfg, "kto")
        model = run._build_policy(cfg, "kto", arch, layout, runtime, reference)
        optimizer, _ = run._build_optimization(
            cfg, "kto", model.chunks, SimpleNamespace(max_steps=10), layout.precision
        )
        dp = parallel_state.get_data_parallel_world_size()
        dp_rank = parallel_state.get_data_parallel_rank()
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        rows = m.global_batch_size // dp
        host = _batch(rows, m.data.max_length, arch.vocab_size, seed=dp_rank)

        def step() -> None:
            batch = to_device(host, runtime.device)
            ref = model.get_ref_policy_logprobs(batch)
            batch["ref_policy_log_probs_samples"] = ref[:rows]
            batch["ref_policy_log_probs_kl"] = ref[rows : 2 * rows]
            for chunk in model.chunks:
                chunk.train()
            zero_grads(model.chunks, optimizer)
            model.get_loss_and_metric_sums(batch, forward_only=False)
            optimizer.step()

        step()
        for _ in range(2):  # the smallest rise of two steps: see AllocationTrace
            gc.collect()
            with trace.window():
                step()
    built = [[(name, p.numel()) for name, p in unwrap(c).named_parameters()] for c in model.chunks]
    separate = model.reference if isinstance(model.reference, SeparateReference) else None
    measured = model_state_bytes(model.chunks, optimizer, separate._ref if separate else None)
    # Host-resident on a GPU too: cpu_swap's copies (pinned host memory there) and the batch as
    # the data loader made it.
    host_only = host_bytes(model.reference, host)

    dims, x, strategy, lora = run_inputs(cfg, arch, world, runtime.device.type)
    mbs = m.micro_batch_size
    lengths = row_lengths(host, "sample_labels")
    scored = scored_per_row(host, "sample_labels")
    micro = [range(i, i + mbs) for i in range(0, rows, mbs)]
    sp = dims.tp if dims.sequence_parallel else 1
    if m.data.pack_sequences:
        tokens = max(-(-sum(lengths[i] for i in r) // sp) * sp for r in micro)
    else:
        tokens = mbs * (-(-host["samples"].shape[1] // sp) * sp)
    x = with_tokens(
        x, tokens, max(sum(scored[i] for i in r) for r in micro), host["samples"].shape[1]
    )
    plan = plan_rank(
        arch,
        dims,
        x,
        strategy,
        pp_rank,
        dp_rank,
        USING_PYTORCH_OPTIMIZER,
        lora,
        parallel_state.get_expert_data_parallel_rank(),
    )
    planned = [
        [(p.name, p.numel) for p in chunk] for chunk in rank_chunks(arch, dims, pp_rank, lora)
    ]
    teardown()
    return {
        "rank": rank,
        "parameters_match": planned == built,
        "pp_rank": pp_rank,
        "dp_rank": dp_rank,
        "predicted": {
            "weights": plan.weights,
            "gradients": plan.gradients,
            "optimizer": plan.optimizer,
            "reference": plan.reference,
            "activations": max(plan.activations, plan.forward_only, plan.collectives),
            "peak": plan.peak,
        },
        "measured": {
            "weights": measured.weights,
            "gradients": measured.gradients,
            "optimizer": measured.optimizer,
            "reference": measured.reference,
            "other": trace.at_start - host_only - measured.total,
            "activations": trace.smallest_rise,
            "peak": measured.total + trace.smallest_rise,
        },
    }


def measure_layout(name: str) -> list[dict]:
    """Run layout `name` on its world of gloo ranks; one result per rank."""
    from multirank import run_multirank

    world, overrides = LAYOUTS[name]
    return run_multirank(measure_rank, world, overrides, timeout=600)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def table(results: dict[str, list[dict]]) -> list[str]:
    """Markdown rows: layout, rank, model state predicted/measured, peak predicted/measured."""
    lines = [
        "| layout | rank (PP, DP) | model state MiB, predicted / measured | other live at step "
        "start MiB | step activations MiB, predicted / measured | peak MiB, predicted / measured "
        "| peak ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, ranks in results.items():
        for r in ranks:
            p, m = r["predicted"], r["measured"]
            state_p = p["weights"] + p["gradients"] + p["optimizer"] + p["reference"]
            state_m = m["weights"] + m["gradients"] + m["optimizer"] + m["reference"]
            lines.append(
                f"| {name} | {r['rank']} ({r['pp_rank']}, {r['dp_rank']}) | {_mib(state_p)} / "
                f"{_mib(state_m)} | {_mib(m['other'])} | {_mib(p['activations'])} / {_mib(m['activations'])} | "
                f"{_mib(p['peak'])} / {_mib(m['peak'])} | {p['peak'] / m['peak']:.3f} |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layout", action="append", choices=sorted(LAYOUTS))
    args = parser.parse_args()
    results = {name: measure_layout(name) for name in args.layout or LAYOUTS}
    print("\n".join(table(results)))


if __name__ == "__main__":
    main()
