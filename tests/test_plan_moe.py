"""The memory plan of mixture-of-experts models against independent references.

* Parameter counts: `transformers`' own Qwen3-MoE (Q/K norms, a dense layer), Mixtral and
  Qwen2-MoE (a gated shared expert, tied embeddings, a dense layer) built from tiny configs, and
  Qwen3-30B-A3B's real shape built on the meta device (30,532,122,624: the published "30.5B",
  "29.9B non-embedding"), not our formulas; every EP x ETP x TP rank's share adds up to the whole.
* Model-state bytes: the trainer's own builders on gloo ranks (`run._build_policy`,
  `run._build_optimization`) with routers, routed experts, a gated shared expert and a dense
  layer, at EP=1 (the experts still in buffers of their own, sharded over expert-DP = DP), at
  EP=2 with expert-DP=2 < DP=4, and at TP=2 x ETP=1 x EP=2: each chunk's parameters (names and
  sizes, in order) are the plan's, and weights, gradients and optimizer state are the plan's to
  the byte after an optimizer step (`planning.measure.model_state_bytes`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from multirank import run_multirank

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import bench_memory_plan  # noqa: E402

from megatron_kto.conversion.hf_config import architecture_from_hf  # noqa: E402
from megatron_kto.planning.model_state import (  # noqa: E402
    ParallelDims,
    chunk_parameters,
    total_parameters,
)

COMMON = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=1024,
    max_position_embeddings=256,
)

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}


def _tiny(family: str):
    import transformers

    if family == "qwen3_moe":
        extra = dict(moe_intermediate_size=32, num_experts=8, head_dim=16, mlp_only_layers=[1])
        return transformers.Qwen3MoeConfig(**COMMON, **extra), transformers.Qwen3MoeForCausalLM
    if family == "mixtral":
        config = transformers.MixtralConfig(**COMMON, num_local_experts=4)
        return config, transformers.MixtralForCausalLM
    extra = dict(
        moe_intermediate_size=32,
        shared_expert_intermediate_size=96,
        num_experts=8,
        tie_word_embeddings=True,
        mlp_only_layers=[2],
    )
    return transformers.Qwen2MoeConfig(**COMMON, **extra), transformers.Qwen2MoeForCausalLM


def _hf_count(config, model_cls) -> int:
    import torch

    with torch.device("meta"):
        model = model_cls(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_moe_parameter_count_equals_transformers(family):
    config, model_cls = _tiny(family)
    arch = architecture_from_hf(config.to_dict())
    arch.padded_vocab_size = arch.vocab_size  # compare the unpadded model
    expected = _hf_count(config, model_cls)
    assert total_parameters(arch) == expected
    # The ranks of one pipeline stage hold it all between them: routed experts split over
    # EP x ETP, the rest over TP (norms, routers and the shared expert's gate replicated).
    experts = arch.num_moe_experts
    replicated_names = ("layernorm", "router", "gate_weight")
    for tp, ep, etp in [(2, 1, 2), (1, 2, 1), (2, 2, 1), (2, 4, 2)]:
        dims = ParallelDims(tp=tp, dp=8, ep=ep, etp=etp)
        params = chunk_parameters(arch, dims, 0)
        routed = sum(p.numel for p in params if p.expert)
        replicated = sum(p.numel for p in params if any(n in p.name for n in replicated_names))
        rest = sum(p.numel for p in params) - routed - replicated
        tied = arch.share_embeddings_and_output_weights
        assert routed * ep * etp + rest * tp + replicated == expected, (tp, ep, etp)
        assert all(".local_experts." not in p.name or p.expert for p in params)
        assert len({p.name.split(".local_experts.")[1].split(".")[0] for p in params if p.expert})
        assert sum(".local_experts." in p.name for p in params) == 2 * (
            experts // ep * sum(arch.is_moe_layer(i) for i in range(arch.num_layers))
        )
        assert tied == (family == "qwen2_moe")


def test_qwen3_30b_a3b_parameter_count():
    import transformers

    fields = {k: v for k, v in QWEN3_30B_A3B.items() if k not in ("architectures", "model_type")}
    expected = _hf_count(transformers.Qwen3MoeConfig(**fields), transformers.Qwen3MoeForCausalLM)
    arch = architecture_from_hf(QWEN3_30B_A3B)
    assert arch.padded_vocab(1) == arch.vocab_size  # 151936 = 1187 x 128: no padding
    total = total_parameters(arch)
    assert total == expected
    embeddings = 2 * 151936 * 2048
    assert round(total / 1e9, 1) == 30.5 and round((total - embeddings) / 1e9, 1) == 29.9


#: A wider tiny model with every MoE part: 4 experts of 96, top-2, Q/K norms, a gated shared
#: expert of 64, layer 1 dense.
MOE = [
    "model.num_moe_experts=4",
    "model.moe_ffn_hidden_size=96",
    "model.moe_router_topk=2",
    "model.qk_layernorm=true",
    "model.moe_shared_expert_intermediate_size=64",
    "model.moe_shared_expert_gate=true",
    "model.moe_layer_freq=[1,0,1,1]",
]
DISTOPT = ["model.optim.name=distributed_fused_adam", "model.optim.overlap_grad_sync=false"]
#: name -> (world, overrides)
LAYOUTS = {
    "ep1_dp2_distopt_bf16": (2, [*DISTOPT, "trainer.precision=bf16"]),
    "ep2_dp4_distopt_bf16": (
        4,
        [*DISTOPT, "trainer.precision=bf16", "model.expert_model_parallel_size=2"],
    ),
    "tp2_sp_etp1_ep2": (
        2,
        [
            "model.tensor_model_parallel_size=2",
            "model.sequence_parallel=true",
            "model.expert_tensor_parallel_size=1",
            "model.expert_model_parallel_size=2",
        ],
    ),
}


def measure_state(rank: int, world: int, overrides: list[str]) -> dict:
    """Build a layout with the trainer's builders, take one KTO step (Adam's state exists after
    it), and return the plan's and the real tensors' model-state bytes of this rank."""
    from types import SimpleNamespace

    from megatron.core import parallel_state
    from megatron.core.optimizer import USING_PYTORCH_OPTIMIZER

    from megatron_kto import run
    from megatron_kto.config.entry import compose_run_config
    from megatron_kto.models.builder import unwrap
    from megatron_kto.models.schedule import to_device
    from megatron_kto.models.training_setup import zero_grads
    from megatron_kto.planning.measure import model_state_bytes
    from megatron_kto.planning.memory import run_inputs
    from megatron_kto.planning.model_state import model_state, rank_chunks
    from megatron_kto.runtime import init_runtime, teardown

    prepared = compose_run_config(
        "gpt_kto", [*bench_memory_plan.MODEL, *MOE, *overrides], world_size=world
    )
    cfg, arch = prepared.cfg, prepared.architecture
    m = cfg.model
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
    model = run._build_policy(cfg, "kto", arch, layout, runtime)
    optimizer, _ = run._build_optimization(
        cfg, "kto", model.chunks, SimpleNamespace(max_steps=10), layout.precision
    )
    dp_rank = parallel_state.get_data_parallel_rank()
    expert_dp_rank = parallel_state.get_expert_data_parallel_rank()
    expert_dp = parallel_state.get_expert_data_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    rows = m.global_batch_size // parallel_state.get_data_parallel_world_size()
    host = bench_memory_plan._batch(rows, m.data.max_length, arch.vocab_size, seed=dp_rank)
    batch = to_device(host, runtime.device)
    ref = model.get_ref_policy_logprobs(batch)
    batch["ref_policy_log_probs_samples"] = ref[:rows]
    batch["ref_policy_log_probs_kl"] = ref[rows : 2 * rows]
    zero_grads(model.chunks, optimizer)
    model.get_loss_and_metric_sums(batch, forward_only=False)
    optimizer.step()
    built = [[(name, p.numel()) for name, p in unwrap(c).named_parameters()] for c in model.chunks]
    measured = model_state_bytes(model.chunks, optimizer)
    dims, *_ = run_inputs(cfg, arch, world, runtime.device.type)
    state = model_state(
        arch,
        dims,
        pp_rank,
        dp_rank,
        USING_PYTORCH_OPTIMIZER,
        expert_dp_rank=expert_dp_rank,
    )
    planned = [[(p.name, p.numel) for p in chunk] for chunk in rank_chunks(arch, dims, pp_rank)]
    teardown()
    return {
        "rank": rank,
        "parameters_match": planned == built,
        "expert_dp": (dims.expert_dp, expert_dp),
        "predicted": (state.weights, state.gradients, state.optimizer),
        "measured": (measured.weights, measured.gradients, measured.optimizer),
    }


@pytest.mark.multirank
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_moe_model_state_is_exact(layout):
    world, overrides = LAYOUTS[layout]
    for r in run_multirank(measure_state, world, overrides, timeout=300):
        assert r["parameters_match"], f"rank {r['rank']}: parameter list differs from the plan"
        planned_edp, real_edp = r["expert_dp"]
        assert planned_edp == real_edp, (layout, r["rank"])
        assert r["predicted"] == r["measured"], (layout, r["rank"])
