"""The memory plan of mixture-of-experts models against independent references.

* Parameter counts: `transformers`' own Qwen3-MoE (Q/K norms, a dense layer), Mixtral,
  Qwen2-MoE (a gated shared expert, tied embeddings, a dense layer) and GLM-4.5 (ungated shared
  experts, a dense first layer, q/k/v biases, Q/K norms) built from tiny configs, and
  Qwen3-30B-A3B's real shape built on the meta device (30,532,122,624: the published "30.5B",
  "29.9B non-embedding"), not our formulas; every EP x ETP x TP rank's share adds up to the whole.
* Model state and peak (`tools/bench_memory_plan.py`: the trainer's own builders on gloo ranks,
  KTO steps measured with `planning.measure`) with routers, routed experts, a gated shared
  expert and Q/K norms, bf16 with the distributed optimizer, at EP=1 (the experts still in
  buffers of their own, sharded over expert-DP = DP = 2) and at EP=2 with expert-DP 2 < DP 4:
  each chunk's parameters (names and sizes, in order) are the plan's, weights, gradients and
  optimizer state are the plan's to the byte, and the peak is within 15% of the measured one.
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


#: The architecture fields of moonshotai/Moonlight-16B-A3B's and deepseek-ai/DeepSeek-V3's
#: published config.json (DeepSeek-V3's MTP layer is skipped on load, so not counted).
MOONLIGHT_16B_A3B = {
    "model_type": "deepseek_v3",
    "vocab_size": 163840,
    "hidden_size": 2048,
    "intermediate_size": 11264,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_shared_experts": 2,
    "n_routed_experts": 64,
    "routed_scaling_factor": 2.446,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "rope_theta": 50000.0,
    "tie_word_embeddings": False,
}
DEEPSEEK_V3 = {
    **MOONLIGHT_16B_A3B,
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "q_lora_rank": 1536,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}


def _tiny(family: str):
    import transformers

    if family == "qwen3_moe":
        extra = dict(moe_intermediate_size=32, num_experts=8, head_dim=16, mlp_only_layers=[1])
        return transformers.Qwen3MoeConfig(**COMMON, **extra), transformers.Qwen3MoeForCausalLM
    if family == "glm4_moe":  # ungated shared experts, a dense first layer, biases, Q/K norms
        extra = dict(
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_shared_experts=2,
            head_dim=16,
            first_k_dense_replace=1,
            attention_bias=True,
            use_qk_norm=True,
        )
        return transformers.Glm4MoeConfig(**COMMON, **extra), transformers.Glm4MoeForCausalLM
    if family == "deepseek_v3":  # multi-latent attention (q-LoRA), GLM-4.5's experts
        extra = dict(
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_shared_experts=2,
            first_k_dense_replace=1,
            num_key_value_heads=8,
            q_lora_rank=16,
            kv_lora_rank=24,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            n_group=1,
            topk_group=1,
        )
        config = transformers.DeepseekV3Config(**{**COMMON, **extra})
        return config, transformers.DeepseekV3ForCausalLM
    if family == "mixtral":
        config = transformers.MixtralConfig(**COMMON, num_local_experts=4)
        return config, transformers.MixtralForCausalLM
    if family == "gpt_oss":
        config = transformers.GptOssConfig(
            **{**COMMON, "intermediate_size": 32}, num_local_experts=4, head_dim=16
        )
        return config, transformers.GptOssForCausalLM
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


@pytest.mark.parametrize(
    "family", ["qwen3_moe", "mixtral", "qwen2_moe", "gpt_oss", "glm4_moe", "deepseek_v3"]
)
def test_moe_parameter_count_equals_transformers(family):
    config, model_cls = _tiny(family)
    arch = architecture_from_hf(config.to_dict())
    arch.padded_vocab_size = arch.vocab_size  # compare the unpadded model
    expected = _hf_count(config, model_cls)
    assert total_parameters(arch) == expected
    # The ranks of one pipeline stage hold it all between them: routed experts split over
    # EP x ETP, the rest over TP (norms, routers and the shared expert's gate replicated).
    experts = arch.num_moe_experts
    replicated_names = ("layernorm", "router", "gate_weight", "linear_proj.bias")
    layouts = [(2, 1, 2), (1, 2, 1), (2, 2, 1), (2, 4, 2)]
    if arch.add_bias_linear:  # biased experts (GPT-OSS) run at ETP 1 only
        layouts = [(2, 1, 1), (1, 2, 1), (2, 2, 1), (2, 4, 1)]
    for tp, ep, etp in layouts:
        dims = ParallelDims(tp=tp, dp=8, ep=ep, etp=etp)
        params = chunk_parameters(arch, dims, 0)
        routed = sum(p.numel for p in params if p.expert)
        replicated = sum(p.numel for p in params if any(n in p.name for n in replicated_names))
        rest = sum(p.numel for p in params) - routed - replicated
        assert routed * ep * etp + rest * tp + replicated == expected, (tp, ep, etp)
        # Only routed experts are marked: E/EP of them per MoE layer, fc1 and fc2 each.
        moe_layers = sum(arch.is_moe_layer(i) for i in range(arch.num_layers))
        assert all((".local_experts." in p.name) == p.expert for p in params)
        per_expert = 4 if arch.add_bias_linear else 2  # fc1 and fc2 (and their biases)
        assert sum(p.expert for p in params) == per_expert * experts // ep * moe_layers


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


@pytest.mark.parametrize(
    ("config", "billions"),
    [(MOONLIGHT_16B_A3B, 15.96), (DEEPSEEK_V3, 671.03)],
    ids=["moonlight", "v3"],
)
def test_deepseek_v3_family_parameter_counts(config, billions):
    """The planner's count of Moonlight-16B-A3B (15,960,108,544) and DeepSeek-V3 without its MTP
    layer (671,026,404,352) equals `transformers`' (built on the meta device)."""
    import transformers

    fields = {k: v for k, v in config.items() if k != "model_type"}
    hf = transformers.DeepseekV3Config(**fields)
    expected = _hf_count(hf, transformers.DeepseekV3ForCausalLM)
    arch = architecture_from_hf(config)
    arch.padded_vocab_size = arch.vocab_size
    assert total_parameters(arch) == expected
    assert round(expected / 1e9, 2) == billions


#: `tools/bench_memory_plan.py` layouts (its model with 4 experts of 96, top-2, Q/K norms, a
#: gated shared expert of 64). Its `moe_tp2_sp_etp1_ep2` and `moe_pp2_ep2_dense_layer` are left
#: to the tool (time; ETP != TP shapes are checked above).
LAYOUTS = ["moe_ep1_dp2_distopt_bf16", "moe_ep2_dp4_distopt_bf16"]
TOLERANCE = 0.15


@pytest.mark.multirank
@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_model_state_is_exact_and_peak_close(layout):
    world, overrides = bench_memory_plan.LAYOUTS[layout]
    results = run_multirank(bench_memory_plan.measure_rank, world, overrides, timeout=600)
    for r in results:
        assert r["parameters_match"], f"rank {r['rank']}: parameter list differs from the plan"
        for key in ("weights", "gradients", "optimizer"):
            assert r["predicted"][key] == r["measured"][key], (layout, r["rank"], key)
        ratio = r["predicted"]["peak"] / r["measured"]["peak"]
        assert abs(ratio - 1) <= TOLERANCE, (layout, r["rank"], ratio)


#: GPT-OSS-20B / 120B config.json fields (the published shapes).
GPT_OSS = dict(
    model_type="gpt_oss",
    hidden_size=2880,
    intermediate_size=2880,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_experts_per_tok=4,
    vocab_size=201088,
    max_position_embeddings=131072,
    sliding_window=128,
    rope_theta=150000.0,
    rope_scaling={
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    tie_word_embeddings=False,
)


@pytest.mark.parametrize("layers,experts,billions", [(24, 32, 20.9), (36, 128, 116.8)])
def test_gpt_oss_parameter_counts(layers, experts, billions):
    """GPT-OSS-20B and -120B on the meta device: `transformers`' count (20.9B, 116.8B: the
    published "21B" and "117B") is the plan's."""
    import transformers

    fields = {k: v for k, v in GPT_OSS.items() if k not in ("model_type", "rope_scaling")}
    config = transformers.GptOssConfig(
        **fields, num_hidden_layers=layers, num_local_experts=experts
    )
    expected = _hf_count(config, transformers.GptOssForCausalLM)
    arch = architecture_from_hf(
        {**GPT_OSS, "num_hidden_layers": layers, "num_local_experts": experts}
    )
    arch.padded_vocab_size = arch.vocab_size
    assert total_parameters(arch) == expected
    assert round(expected / 1e9, 1) == billions


def _gpt_oss_layer(experts: int, local: int) -> int:
    """One GPT-OSS layer from the published shapes (h 2880, 64 query heads and 8 KV heads of 64,
    experts of 2880) on a rank holding `local` of its `experts`: q [4096, 2880] + 4096, k and v
    [512, 2880] + 512 each, o [2880, 4096] + 2880, 64 sinks, two norms of 2880, the router
    [E, 2880] + E (every expert's row on every rank), and per local expert gate/up [5760, 2880]
    + 5760 and down [2880, 2880] + 2880."""
    h = 2880
    attention = (h * 4096 + 4096) + 2 * (h * 512 + 512) + (4096 * h + h) + 64
    expert = (h * 5760 + 5760) + (2880 * h + h)
    return attention + 2 * h + (experts * h + experts) + local * expert


#: LoRA rank 16 on q/k/v/o of one GPT-OSS layer: r·(in + out) per projection.
GPT_OSS_ADAPTERS = 16 * ((2880 + 4096) + 2 * (2880 + 512) + (4096 + 2880))
EMBEDDING = 201088 * 2880


def _gpt_oss_arch(layers: int, experts: int):
    arch = architecture_from_hf(
        {**GPT_OSS, "num_hidden_layers": layers, "num_local_experts": experts}
    )
    arch.padded_vocab_size = arch.vocab_size
    return arch


def test_gpt_oss_20b_lora_model_state_by_hand():
    """GPT-OSS-20B, LoRA rank 16 on the attention (an MoE model's experts take no adapters), bf16,
    one rank: every base weight frozen at 2 bytes (the MXFP4 experts dequantised to bf16 — 20.9B x
    2 = 41.8 GB, not MXFP4's ~13 GB), only the adapters get an fp32 gradient (4 bytes) and Adam
    state with an fp32 main copy (12 bytes). Figures from the published shapes, not the plan's
    formulas."""
    from megatron_kto.planning.model_state import LoRAShape, model_state

    base = 24 * _gpt_oss_layer(32, 32) + 2 * EMBEDDING + 2880  # untied embedding/output, final norm
    adapters = 24 * GPT_OSS_ADAPTERS
    assert (round(base / 1e9, 1), adapters) == (20.9, 7_962_624)
    lora = LoRAShape(16, ("attention",))
    state = model_state(_gpt_oss_arch(24, 32), ParallelDims(precision="bf16"), lora=lora)
    assert state.parameters == base + adapters
    assert (state.weights, state.gradients, state.optimizer) == (
        2 * (base + adapters),
        4 * adapters,
        12 * adapters,
    )
    with pytest.raises(ValueError, match="experts take no adapters"):
        model_state(_gpt_oss_arch(24, 32), ParallelDims(), lora=LoRAShape(16, ("all",)))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_gpt_oss_120b_rank_state_over_ep_by_hand(lora):
    """GPT-OSS-120B at PP 4 x DP 2 with EP 2, bf16, no distributed optimizer: pipeline rank 0
    holds the embedding and 9 layers, each with 64 of the 128 experts (EP halves them; nothing
    else is split). Full fine-tuning: 2 + 4 + 12 bytes per parameter (bf16 weight, fp32 gradient,
    Adam moments and fp32 main copy). LoRA rank 16 on the attention: 2 bytes per frozen
    parameter, 2 + 4 + 12 per adapter."""
    from megatron_kto.planning.model_state import LoRAShape, model_state

    base = EMBEDDING + 9 * _gpt_oss_layer(128, 64)
    adapters = 9 * GPT_OSS_ADAPTERS if lora else 0
    dims = ParallelDims(pp=4, dp=2, ep=2, precision="bf16")
    shape = LoRAShape(16, ("attention",)) if lora else None
    state = model_state(_gpt_oss_arch(36, 128), dims, pp_rank=0, lora=shape)
    trained = adapters if lora else base
    assert state.parameters == base + adapters
    assert (state.weights, state.gradients, state.optimizer) == (
        2 * (base + adapters),
        4 * trained,
        12 * trained,
    )
