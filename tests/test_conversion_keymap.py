"""The conversion's pure parts: key map, fusions, config mapping, safetensors streaming.

No megatron-core model is built here (the `test_conversion_models.py` tests do that against
`transformers`); these run in well under a second each.
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.conversion.addressing import LOCAL_NORMS, TE_NORMS, norm_names
from megatron_kto.conversion.hf_config import (
    ConversionError,
    architecture_from_hf,
    hf_config_from_architecture,
)
from megatron_kto.conversion.mappings import (
    fuse_fc1,
    fuse_qkv,
    split_fc1,
    split_qkv,
    to_hf,
    to_megatron,
)
from megatron_kto.conversion.safetensors_io import INDEX, SINGLE, HFWeights, write_sharded


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (8, 1)])
def test_qkv_fusion_is_an_exact_inverse_and_groups_heads(heads, groups):
    d, hidden = 3, 5
    q = torch.randn(heads * d, hidden)
    k = torch.randn(groups * d, hidden)
    v = torch.randn(groups * d, hidden)
    fused = fuse_qkv(q, k, v, heads, groups)
    assert fused.shape == ((heads + 2 * groups) * d, hidden)
    for got, want in zip(split_qkv(fused, heads, groups, d), (q, k, v), strict=True):
        assert torch.equal(got, want)
    per = heads // groups
    block = (per + 2) * d  # megatron: each group's query heads, then its key, then its value
    for g in range(groups):
        start = g * block
        assert torch.equal(fused[start : start + per * d], q[g * per * d : (g + 1) * per * d])
        assert torch.equal(fused[start + per * d : start + (per + 1) * d], k[g * d : (g + 1) * d])
        assert torch.equal(fused[start + (per + 1) * d : start + block], v[g * d : (g + 1) * d])
    bias = fuse_qkv(q[:, 0], k[:, 0], v[:, 0], heads, groups)  # biases fuse the same way
    assert torch.equal(bias, fused[:, 0])


def test_fc1_fusion_is_gate_then_up():
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    fused = fuse_fc1(gate, up)
    assert torch.equal(fused[:6], gate) and torch.equal(fused[6:], up)
    assert all(torch.equal(a, b) for a, b in zip(split_fc1(fused), (gate, up), strict=True))


def _arch(tied: bool) -> GPTArchitecture:
    return GPTArchitecture(
        num_layers=2,
        hidden_size=16,
        ffn_hidden_size=24,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=8,  # head dim != hidden / heads: megatron and HF both allow it
        vocab_size=10,
        padded_vocab_size=16,
        add_qkv_bias=True,
        share_embeddings_and_output_weights=tied,
    )


def _hf_state(arch: GPTArchitecture) -> dict[str, torch.Tensor]:
    h, f, d = arch.hidden_size, arch.ffn_hidden_size, arch.kv_channels
    q, kv = arch.num_attention_heads * d, arch.num_query_groups * d
    state = {"model.embed_tokens.weight": torch.randn(arch.vocab_size, h)}
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes = {
            "input_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (q, h),
            "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h),
            "self_attn.q_proj.bias": (q,),
            "self_attn.k_proj.bias": (kv,),
            "self_attn.v_proj.bias": (kv,),
            "self_attn.o_proj.weight": (h, q),
            "post_attention_layernorm.weight": (h,),
            "mlp.gate_proj.weight": (f, h),
            "mlp.up_proj.weight": (f, h),
            "mlp.down_proj.weight": (h, f),
        }
        state.update({p + name: torch.randn(shape) for name, shape in shapes.items()})
    state["model.norm.weight"] = torch.randn(h)
    if not arch.share_embeddings_and_output_weights:
        state["lm_head.weight"] = torch.randn(arch.vocab_size, h)
    return state


@pytest.mark.parametrize("norms", [LOCAL_NORMS, TE_NORMS], ids=["local", "te"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_to_megatron_then_to_hf_is_the_identity(norms, tied):
    arch = _arch(tied)
    hf = _hf_state(arch)
    megatron = dict(to_megatron(hf.__getitem__, arch, 16, norms))
    layer = {k.split(".", 3)[3] for k in megatron if k.startswith("decoder.layers.0.")}
    assert layer == {
        norms["attn_norm"],
        norms["mlp_norm"],
        "self_attention.linear_qkv.weight",
        "self_attention.linear_qkv.bias",
        "self_attention.linear_proj.weight",
        "mlp.linear_fc1.weight",
        "mlp.linear_fc2.weight",
    }
    assert ("output_layer.weight" in megatron) == (not tied)
    assert megatron["decoder.layers.1.self_attention.linear_qkv.weight"].shape == (8 * 8, 16)
    emb = megatron["embedding.word_embeddings.weight"]
    assert emb.shape == (16, 16) and not emb[10:].any()  # padded rows are zero
    back = dict(to_hf(megatron.__getitem__, arch, norms))
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_norm_names_follow_the_built_model():
    local = ["decoder.layers.0.input_layernorm.weight", "decoder.layers.0.mlp.linear_fc1.weight"]
    te = ["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"]
    assert norm_names(local) is LOCAL_NORMS
    assert norm_names(te) is TE_NORMS


def _config(model_type: str, **extra) -> dict:
    config = {
        "model_type": model_type,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
    }
    return {**config, **extra}


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    "config",
    [
        _config("llama", rope_scaling=LLAMA3_SCALING),
        _config("mistral", sliding_window=None),
        _config("qwen2", tie_word_embeddings=True),
        # transformers 5 spells RoPE settings as rope_parameters
        _config("llama", rope_parameters={"rope_theta": 500000.0, **LLAMA3_SCALING}),
    ],
    ids=["llama3", "mistral", "qwen2", "llama3-rope-parameters"],
)
def test_config_round_trip(config):
    arch = architecture_from_hf(config)
    assert arch.rotary_base == 500000
    assert arch.num_query_groups == 2 and arch.kv_channels == 16
    assert arch.add_qkv_bias == (config["model_type"] == "qwen2")
    assert arch.share_embeddings_and_output_weights == (config["model_type"] == "qwen2")
    assert arch.rope_scaling == (config["model_type"] == "llama")
    back = hf_config_from_architecture(arch, config["model_type"], config)
    assert architecture_from_hf(back) == arch


@pytest.mark.parametrize(
    "change,field",
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"rope_scaling": {**LLAMA3_SCALING, "high_freq_factor": 2.0}}, "rope_scaling"),
        ({"num_attention_heads": "4"}, "num_attention_heads"),
        ({"mlp_bias": True}, "mlp_bias"),
    ],
)
def test_unsupported_configs_are_named(change, field):
    with pytest.raises(ConversionError, match=field):
        architecture_from_hf({**_config("llama"), **change}, "x/config.json")


def test_export_config_needs_an_expressible_model():
    arch = architecture_from_hf(_config("qwen2"))
    with pytest.raises(ConversionError, match="qwen2"):
        hf_config_from_architecture(arch, "llama")


def test_sharded_safetensors_round_trip(tmp_path):
    tensors = {f"t{i}": torch.randn(64, 8) for i in range(5)}  # 2 KiB each
    files = write_sharded(tensors.items(), tmp_path, torch.float32, max_shard_bytes=5000)
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / INDEX).read_text())
    assert index["metadata"]["total_size"] == 5 * 64 * 8 * 4
    assert set(index["weight_map"].values()) == set(files)
    weights = HFWeights(tmp_path)
    assert weights.names() == set(tensors) and "t0" in weights and "x" not in weights
    for name, tensor in tensors.items():
        assert torch.equal(weights.get(name), tensor)

    single = tmp_path / "single"
    single.mkdir()
    assert write_sharded(tensors.items(), single, torch.bfloat16) == [SINGLE]
    assert torch.equal(HFWeights(single).get("t3"), tensors["t3"].to(torch.bfloat16))


def test_unreadable_weights_are_one_line_errors(tmp_path):
    with pytest.raises(ConversionError, match="no model.safetensors"):
        HFWeights(tmp_path)
    write_sharded([("w", torch.randn(100, 10))], tmp_path, torch.float32)
    data = (tmp_path / SINGLE).read_bytes()
    (tmp_path / SINGLE).write_bytes(data[: len(data) // 2])
    with pytest.raises(ConversionError, match="model.safetensors") as info:
        HFWeights(tmp_path).get("w")
    assert "\n" not in str(info.value)


def _moe_config(model_type: str, **extra) -> dict:
    experts = "num_local_experts" if model_type == "mixtral" else "num_experts"
    moe = {experts: 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48}
    return _config(model_type, **{**moe, **extra})


@pytest.mark.parametrize(
    "config,field",
    [
        (_config("phi3"), "qwen3_moe, mixtral, qwen2_moe, gemma3_text"),  # names the supported
        (_config("gemma3"), "text_config: missing"),
        (_moe_config("qwen2_moe"), "shared_expert_intermediate_size"),
        (_moe_config("qwen3_moe", decoder_sparse_step=0), "decoder_sparse_step"),
        (_moe_config("qwen3_moe", mlp_only_layers=[0, 1]), "no layer has experts"),
        (_moe_config("qwen3_moe", decoder_sparse_step=3), "no layer has experts"),
        (_moe_config("qwen3_moe", num_experts_per_tok=8), "num_experts_per_tok"),
        (_moe_config("mixtral", router_jitter_noise=0.1), "router_jitter_noise"),
        (_config("qwen3", attention_bias=True), "attention_bias"),
    ],
    ids=[
        "unsupported-type",
        "gemma3-without-text-config",
        "qwen2_moe-no-shared",
        "sparse-step-0",
        "all-dense",
        "sparse-step-past-the-layers",
        "topk",
        "jitter",
        "qwen3-bias",
    ],
)
def test_unsupported_families_and_moe_patterns_are_one_line(config, field):
    with pytest.raises(ConversionError, match=field) as info:
        architecture_from_hf(config, "x/config.json")
    assert "\n" not in str(info.value) and str(info.value).startswith("x/config.json")


@pytest.mark.parametrize(
    "config",
    [
        _config("qwen3"),
        _moe_config("qwen3_moe", norm_topk_prob=True),
        _moe_config("mixtral"),
        _moe_config("qwen2_moe", shared_expert_intermediate_size=64),
        _moe_config("qwen3_moe", norm_topk_prob=True, mlp_only_layers=[1]),
        _moe_config("qwen2_moe", shared_expert_intermediate_size=64, decoder_sparse_step=2),
    ],
    ids=["qwen3", "qwen3_moe", "mixtral", "qwen2_moe", "qwen3_moe-mixed", "qwen2_moe-mixed"],
)
def test_family_config_round_trip(config):
    arch = architecture_from_hf(config)
    assert arch.qk_layernorm == config["model_type"].startswith("qwen3")
    back = hf_config_from_architecture(arch, config["model_type"], config)
    assert architecture_from_hf(back) == arch
    others = {
        "qwen3": "llama",
        "qwen3_moe": "qwen3",
        "mixtral": "qwen3_moe",
        "qwen2_moe": "qwen3_moe",
    }
    with pytest.raises(ConversionError, match=f"not {others[config['model_type']]}"):
        hf_config_from_architecture(arch, others[config["model_type"]])


@pytest.mark.parametrize(
    "extra,pattern,written",
    [
        ({"mlp_only_layers": [1]}, [1, 0], (1, [1])),
        ({"decoder_sparse_step": 2}, [0, 1], (2, [])),
        ({"mlp_only_layers": [0], "decoder_sparse_step": 1}, [0, 1], (2, [])),
        ({"mlp_only_layers": [], "decoder_sparse_step": 1}, None, (1, [])),
    ],
)
def test_dense_layers_of_qwen_moe(extra, pattern, written):
    """`transformers`' rule (layer i is sparse unless listed in mlp_only_layers, and only when
    (i + 1) % decoder_sparse_step == 0) becomes moe_layer_freq; export writes a step when the
    pattern is one, else the dense layers; Mixtral cannot hold dense layers."""
    arch = architecture_from_hf(_moe_config("qwen3_moe", norm_topk_prob=True, **extra))
    assert arch.moe_layer_freq == pattern
    assert arch.ffn_hidden_size == 96 and arch.moe_ffn_hidden_size == 48
    config = hf_config_from_architecture(arch, "qwen3_moe")
    assert (config["decoder_sparse_step"], config["mlp_only_layers"]) == written
    if pattern is not None:
        import dataclasses

        mixtral_like = dataclasses.replace(arch, qk_layernorm=False)  # only the dense layers differ
        with pytest.raises(ConversionError, match="has dense layers between MoE layers"):
            hf_config_from_architecture(mixtral_like, "mixtral")
