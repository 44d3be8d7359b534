"""DeepSeek-V3 (`deepseek_v3`) against `transformers`' DeepseekV3ForCausalLM: multi-latent
attention (megatron-core's MLASelfAttention with our SDPA core attention) and the sigmoid-routed
MoE GLM-4.5 shares (`test_glm4_moe.py` covers the routing refusals).

Tiny random models (fp32): `qlora` — a query bottleneck (q_lora_rank 16), v_head_dim 12 != the
qk head dim 24, YaRN (factor 4 over 16 original positions, so the 24-token rows reach the
interpolated range) with mscale 0.9 / mscale_all_dim 0.7 (attention factor and softmax scale
both != 1), 8 experts top-4 in 4 groups of which 2 are eligible, routed scaling 2.5, 2 shared
experts, one dense first layer; `plain` — one query projection, plain RoPE, rms_norm_eps 1e-5
(the q_a / kv_a norms keep 1e-6, as transformers builds them), 4 layers, 4 experts top-2.
Norms are moved off 1, routers are decisive and every correction bias changes the routing.
Shown here:

* import (conversion) and the direct Hugging Face load -> our log-probs equal `transformers'`
  at TP=1, and at TP=2, EP=2 and PP=2 (one 2-rank run), within 1e-5 relative;
* every MoE layer chooses the same experts as Hugging Face for every token;
* packed rows (THD) give the padded rows' log-probs;
* export -> safetensors bit-identical to the source; `transformers` loads them with the same
  logits and the same MLA / YaRN settings;
* what is not built is refused in one line naming the key (config.json and run config).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from multirank import run_multirank
from test_glm4_moe import (
    _forward,
    _hf_model,
    _hf_run,
    _packed_vs_padded,
    _restore_and_run,
    _safetensors,
    _tokens,
    check_parallel,
    check_single_rank,
    merge_rank_outputs,
    sigmoid_moe_references,
)

VOCAB = 100  # test_glm4_moe's helpers read its VOCAB / SEQ / BATCH: the same here
MODELS = ("qlora", "plain")
LAYOUTS = {"tp2": (2, 1, 1), "ep2": (1, 1, 2), "pp2": (1, 2, 1)}
# TP=2 with SP (MoE at TP > 1 requires SP: config/validate.py)
GRAD_LAYOUTS = {"grads_tp2_sp": True}


def _hf_configs() -> dict[str, object]:
    from transformers import DeepseekV3Config

    common = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        first_k_dense_replace=1,
        tie_word_embeddings=False,
        num_nextn_predict_layers=0,
    )
    return {
        "qlora": DeepseekV3Config(
            num_hidden_layers=2,
            intermediate_size=96,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            n_shared_experts=2,
            routed_scaling_factor=2.5,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            rms_norm_eps=1e-6,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "mscale": 0.9,
                "mscale_all_dim": 0.7,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
            },
            **common,
        ),
        "plain": DeepseekV3Config(
            num_hidden_layers=4,
            intermediate_size=80,
            moe_intermediate_size=48,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            n_shared_experts=1,
            routed_scaling_factor=1.0,
            q_lora_rank=None,
            kv_lora_rank=24,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=16,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **common,
        ),
    }


def _single_worker(rank: int, world_size: int, root: str) -> dict:
    """Per model: import, TP=1 from the checkpoint (a different init) and from the HF directory
    directly, packed vs padded, export."""
    from megatron_kto.hf_writer.convert import export_hf, import_hf
    from megatron_kto.runtime import init_runtime, teardown

    out = {}
    for name in MODELS:
        base = Path(root) / name
        out["arch", name] = import_hf(base / "hf", base / "mcore").to_dict()
        rt = init_runtime(1, 1, seed=9)  # a different init: only the checkpoint can match
        arch, chunks = _restore_and_run(base / "mcore", 1, 1, 1, rt)
        out["tp1", name] = _forward(arch, chunks)
        out["plan", name, "tp1"] = _planned_vs_built(arch, chunks, 1, 1)
        out["packed", name] = _packed_vs_padded(arch, chunks[0])
        torch.save(_loss_grads(arch, chunks[0]), base / "tp1_grads.pt")
        teardown()
        rt = init_runtime(1, 1, seed=9)
        out["hf_tp1", name] = _forward(*_restore_and_run(base / "hf", 1, 1, 1, rt))
        teardown()
        export_hf(base / "mcore", base / "export")
    return out


def _layout_worker(rank: int, world_size: int, root: str, layouts: dict) -> dict:
    """TP=2, EP=2, PP=2 from our checkpoint; EP=2 also straight from the HF directory; the
    gradients' errors at TP=2 with and without SP against TP=1's."""
    from megatron_kto.runtime import init_runtime, teardown

    out = {}
    for layout, (tp, pp, ep) in layouts.items():
        rt = init_runtime(tp, pp, seed=9, expert_parallel_size=ep)
        for name in MODELS:
            arch, chunks = _restore_and_run(Path(root) / name / "mcore", tp, pp, ep, rt)
            out[layout, name] = _forward(arch, chunks)
            if layout == "tp2":
                out["plan", name, "tp2"] = _planned_vs_built(arch, chunks, tp, ep)
            if layout == "ep2":
                hf = _restore_and_run(Path(root) / name / "hf", tp, pp, ep, rt)
                out["hf_ep2", name] = _forward(*hf)
    for layout, sp in GRAD_LAYOUTS.items():
        rt = init_runtime(2, 1, seed=9)
        for name in MODELS:
            path = Path(root) / name
            arch, chunks = _restore_and_run(path / "mcore", 2, 1, 1, rt, sequence_parallel=sp)
            want = torch.load(path / "tp1_grads.pt", weights_only=True)
            out[layout, name] = _grad_errors(_loss_grads(arch, chunks[0]), want, arch, chunks[0])
    teardown()
    return out


def _loss_grads(arch, chunk) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of a DPO-shaped loss of the rows' summed log-probs (rows 0, 2
    chosen, 1, 3 rejected) after one backward through megatron-core DDP and
    `finalize_model_grads`, as training reduces them (the SP norms' and the experts' over TP)."""
    import torch.nn.functional as F
    from megatron.core.distributed import finalize_model_grads

    from megatron_kto.models.builder import unwrap
    from megatron_kto.models.forward import eval_mode, model_call
    from megatron_kto.models.logprobs import token_logprobs
    from megatron_kto.models.training_setup import wrap_ddp

    (ddp,) = wrap_ddp([chunk], use_distributed_optimizer=False)
    tokens = _tokens()
    labels = torch.cat([tokens[:, 1:], torch.full((tokens.shape[0], 1), -100)], dim=1)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens).clone()
    with eval_mode([ddp]):
        logits = model_call(ddp, {"tokens": tokens, "position_ids": positions})
    sums = token_logprobs(logits, labels, arch.vocab_size).sum(-1)
    F.logsigmoid(0.5 * (sums[0::2] - sums[1::2])).mean().neg().backward()
    finalize_model_grads([ddp])
    return {n: p.main_grad.detach().clone() for n, p in unwrap(chunk).named_parameters()}


def _grad_errors(grads: dict, want: dict, arch, chunk) -> dict[str, float]:
    """Per parameter: max |this rank's gradient - TP=1's matching shard| / max |TP=1's|."""
    from megatron.core import parallel_state

    from megatron_kto.models.builder import unwrap

    rank = parallel_state.get_tensor_model_parallel_rank()
    params = dict(unwrap(chunk).named_parameters())
    errors = {}
    for name, grad in grads.items():
        ref, p = want[name], params[name]
        if getattr(p, "tensor_model_parallel", False):
            dim, n = p.partition_dim, grad.shape[p.partition_dim]
            parts = (ref,)
            if name.endswith("linear_fc1.weight"):  # SwiGLU: each rank holds [gate_r; up_r]
                parts = ref.chunk(2, dim)
                n //= 2
            ref = torch.cat([q.narrow(dim, rank * n, n) for q in parts], dim)
        assert grad.shape == ref.shape, (name, grad.shape, ref.shape)
        errors[name] = ((grad - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()
    return errors


def _planned_vs_built(arch, chunks, tp: int, ep: int) -> tuple[list, list]:
    """(the memory plan's parameters, the built chunk's) as (name, elements) lists."""
    from megatron_kto.models.builder import unwrap
    from megatron_kto.planning.model_state import ParallelDims, chunk_parameters

    plan = chunk_parameters(arch, ParallelDims(tp=tp, dp=2 // tp, ep=ep), 0)
    built = [(n, p.numel()) for n, p in unwrap(chunks[0]).named_parameters()]
    return [(p.name, p.numel) for p in plan], built


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_v3")
    reference = sigmoid_moe_references(root, _hf_configs())
    results = run_multirank(_single_worker, 1, str(root), timeout=600)[0]
    ranks = run_multirank(_layout_worker, 2, str(root), LAYOUTS, timeout=600)
    return root, reference, merge_rank_outputs(results, ranks, ("plan", *GRAD_LAYOUTS))


def test_the_correction_bias_changes_the_routing(converted):
    _, reference, _ = converted
    for name in MODELS:
        ref = reference[name]
        assert (ref["logits"] - ref["unbiased"]).abs().max() > 1e-3, name


CASES = [(layout, name) for layout in ("tp1", "hf_tp1") for name in MODELS]


@pytest.mark.parametrize("layout,name", CASES, ids=[f"{n}-{lay}" for lay, n in CASES])
def test_single_rank_logprobs_and_choices_equal_transformers(converted, layout, name):
    check_single_rank(converted, layout, name, _hf_configs()[name].num_hidden_layers - 1)


LAYOUT_CASES = [(layout, name) for layout in (*LAYOUTS, "hf_ep2") for name in MODELS]


@pytest.mark.parametrize("layout,name", LAYOUT_CASES, ids=[f"{n}-{lay}" for lay, n in LAYOUT_CASES])
def test_parallel_logprobs_and_choices_equal_transformers(converted, layout, name):
    """TP2 / EP2 / PP2 (and EP2 straight from the HF directory), checked as test_glm4_moe does."""
    check_parallel(converted, layout, name)


@pytest.mark.parametrize("tp", ["tp1", "tp2"])
@pytest.mark.parametrize("name", MODELS)
def test_memory_plan_counts_the_built_mla_parameters(converted, name, tp):
    """The plan's parameters of a chunk (names, sizes, order) are the built model's."""
    _, _, results = converted
    planned, built = results["plan", name, tp]
    assert planned == built


@pytest.mark.parametrize("name", MODELS)
def test_packed_rows_equal_padded_rows(converted, name):
    _, _, results = converted
    assert results["packed", name] <= 1e-5


@pytest.mark.parametrize("layout", list(GRAD_LAYOUTS))
@pytest.mark.parametrize("name", MODELS)
def test_tensor_parallel_gradients_equal_tp1(converted, layout, name):
    """A DPO-shaped loss's gradient of every parameter at TP=2 x SP equals TP=1's: the shared
    rotated key's gradient is summed over TP."""
    _, _, results = converted
    errors = results[layout, name]
    assert len(errors) > 10 and any("linear_kv_down_proj" in n for n in errors)
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-5, (worst, errors[worst])


def test_mla_settings_follow_the_config(converted):
    _, _, results = converted
    qlora, plain = results["arch", "qlora"], results["arch", "plain"]
    assert qlora["multi_latent_attention"] and plain["multi_latent_attention"]
    assert (qlora["q_lora_rank"], qlora["kv_lora_rank"], qlora["v_head_dim"]) == (16, 16, 12)
    assert (qlora["qk_nope_head_dim"], qlora["qk_rope_head_dim"], qlora["kv_channels"]) == (
        16,
        8,
        24,
    )
    assert qlora["position_embedding_type"] == "yarn" and qlora["rope_scaling_factor"] == 4.0
    assert (qlora["yarn_mscale"], qlora["yarn_mscale_all_dim"]) == (0.9, 0.7)
    assert (qlora["moe_router_num_groups"], qlora["moe_router_group_topk"]) == (4, 2)
    assert qlora["moe_layer_freq"] == [0, 1]
    assert plain["q_lora_rank"] is None and plain["position_embedding_type"] == "rope"


@pytest.mark.parametrize("name", MODELS)
def test_round_trip_is_bit_exact_and_loads_in_transformers(converted, name):
    root, reference, _ = converted
    original = _safetensors(root / name / "hf")
    exported = _safetensors(root / name / "export")
    assert exported.keys() == original.keys()
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor), key
    config = json.loads((root / name / "export" / "config.json").read_text())
    source = _hf_configs()[name]
    for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim"):
        assert config[key] == getattr(source, key), key
    assert config["v_head_dim"] == source.v_head_dim and config["first_k_dense_replace"] == 1
    logits, _ = _hf_run(_hf_model(root / name / "export"))
    assert torch.equal(logits, reference[name]["logits"])


def _config(**changes) -> dict:
    config = _hf_configs()["qlora"].to_dict()
    config.update(changes)
    return config


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"rope_interleave": False}, "rope_interleave false: only interleaved rotary dims"),
        ({"attention_bias": True}, "attention_bias: biased MLA projections"),
        ({"num_key_value_heads": 2}, "num_key_value_heads 2: multi-latent attention has one"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim 7: must be even"),
        ({"rope": {"truncate": False}}, "rope_parameters: YaRN with truncate false"),
        ({"rope": {"mscale": None}}, "rope_parameters: YaRN with mscale_all_dim without mscale"),
        ({"rope": {"attention_factor": 1.2}}, "rope_parameters: YaRN with an explicit attention"),
        ({"rope": {"rope_type": "linear"}}, "rope_parameters {"),
    ],
)
def test_configs_that_would_compute_differently_are_refused(changes, message):
    """One line naming the key; the routing refusals are GLM-4.5's (`test_glm4_moe.py`)."""
    from megatron_kto.conversion.hf_config import ConversionError, architecture_from_hf

    rope = changes.pop("rope", None)
    config = _config(**changes)
    if rope is not None:
        config["rope_parameters"] = {**config["rope_parameters"], **rope}
    with pytest.raises(ConversionError) as info:
        architecture_from_hf(config, "cfg.json")
    text = str(info.value)
    assert text.startswith(f"cfg.json: {message}"), text
    assert "\n" not in text


def test_other_families_do_not_export_an_mla_model():
    from megatron_kto.conversion.hf_config import architecture_from_hf
    from megatron_kto.conversion.registry import expressing_types

    assert expressing_types(architecture_from_hf(_config())) == ["deepseek_v3"]


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["model.context_parallel_size=2"], r"^model.context_parallel_size: 2: multi-latent"),
        (["model.peft.peft_scheme=lora"], r"^model.peft.peft_scheme: LoRA on multi-latent"),
        (
            ["model.attention_backend=local", "model.data.pack_sequences=false"],
            r"^model.attention_backend: 'local' cannot run multi-latent attention",
        ),
        # MLA runs on TE (tests/test_te_mla.py); this machine has none
        (["model.attention_backend=te"], r"^model.attention_backend: 'te' needs Transformer Eng"),
        (
            ["model.tensor_model_parallel_size=2"],
            r"^model.sequence_parallel: false: multi-latent attention \(DeepSeek-V3\) at tensor",
        ),
    ],
)
def test_run_config_refuses_what_mla_does_not_run(overrides, match):
    from megatron_kto.config.schema import register
    from megatron_kto.config.validate import ConfigError
    from megatron_kto.entry import compose_run_config

    register()
    mla = [
        "model.multi_latent_attention=true",
        "model.kv_lora_rank=16",
        "model.qk_nope_head_dim=8",
        "model.qk_rope_head_dim=8",
        "model.v_head_dim=8",
        "model.kv_channels=16",
    ]
    compose_run_config("gpt_kto", mla, "kto", world_size=2)  # valid as it is, and at TP=2 x SP
    tp2 = ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"]
    compose_run_config("gpt_kto", mla + tp2, "kto", world_size=2)
    with pytest.raises(ConfigError, match=match) as e:
        compose_run_config("gpt_kto", mla + overrides, "kto", world_size=2)
    assert "\n" not in str(e.value)


def test_model_flops_count_the_mla_projections():
    """Forward FLOPs per token = 2 x the matmul weights a token uses (`transformers`' own
    DeepseekV3 parameter count of the attention projections) + the output layer, and per
    position 2·n·(qh + v) per layer — not the dense QKV formula's."""
    from transformers import AutoModelForCausalLM

    from megatron_kto.conversion.hf_config import architecture_from_hf
    from megatron_kto.logging.throughput import architecture_flops

    config = _hf_configs()["qlora"]
    arch = architecture_from_hf(config.to_dict())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    attention = sum(
        p.numel() for n, p in model.named_parameters() if ".self_attn." in n and "norm" not in n
    )
    dense = model.model.layers[0].mlp
    # Every layer dense: the MoE FLOPs are `moe_flops_per_token`'s, tested with the MoE families.
    dense_arch = dataclasses.replace(arch, num_moe_experts=None, moe_layer_freq=None)
    flops = architecture_flops(dense_arch, VOCAB)
    mlp = sum(p.numel() for p in dense.parameters())
    want = 2 * (attention + arch.num_layers * mlp + VOCAB * arch.hidden_size)
    assert flops.per_token == want
    n, qh = arch.num_attention_heads, arch.qk_nope_head_dim + arch.qk_rope_head_dim
    assert flops.per_position == arch.num_layers * 2 * n * (qh + arch.v_head_dim)
