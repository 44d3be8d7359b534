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
  at TP=1, and at TP=2, EP=2, PP=2 and TP=2 x SP x EP=2 x ETP=1 (the TP ranks hold whole
  experts; one 2-rank run), within 1e-5 relative;
* every MoE layer chooses the same experts as Hugging Face for every token;
* packed rows (THD) give the padded rows' log-probs;
* export -> safetensors bit-identical to the source; `transformers` loads them with the same
  logits and the same MLA / YaRN settings;
* every parameter's gradient at TP=2 x SP equals TP=1's; the memory plan counts the built MLA
  parameters;
* what is not built is refused in one line naming the key (config.json and run config).

The runs and shared checks are `family_parity`'s; this file holds the configs (`_hf_configs`,
imported by other MLA tests) and DeepSeek's own checks.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import family_parity as fp
import pytest
import torch
from hf_tiny import tiny_sigmoid_routed_config

MODELS = ("qlora", "plain")
# TP=2 with SP (MoE at TP > 1 requires SP: config/validate.py)
GRAD_LAYOUTS = {"grads_tp2_sp": True}


#: Run-config overrides of a small MLA model without a query bottleneck.
MLA_RUN = [
    "model.multi_latent_attention=true",
    "model.kv_lora_rank=16",
    "model.qk_nope_head_dim=8",
    "model.qk_rope_head_dim=8",
    "model.v_head_dim=8",
    "model.kv_channels=16",
]


def _hf_configs() -> dict[str, object]:
    """`hf_tiny.TINY_DEEPSEEK_V3` changed into the two models of the module docstring."""
    common = dict(
        max_position_embeddings=64,
        tie_word_embeddings=False,
        initializer_range=0.02,
        bos_token_id=0,
        eos_token_id=1,
    )
    return {
        "qlora": tiny_sigmoid_routed_config(
            "deepseek_v3",
            fp.VOCAB,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            n_shared_experts=2,
            routed_scaling_factor=2.5,
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
        "plain": tiny_sigmoid_routed_config(
            "deepseek_v3",
            fp.VOCAB,
            num_hidden_layers=4,
            intermediate_size=80,
            routed_scaling_factor=1.0,
            q_lora_rank=None,
            kv_lora_rank=24,
            qk_nope_head_dim=8,
            v_head_dim=16,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **common,
        ),
    }


def _tp1_results(name: str, arch, chunks, base) -> dict:
    """The memory plan against the built TP=1 chunk; TP=1's gradients saved for the 2 ranks."""
    torch.save(_loss_grads(arch, chunks[0]), base / "tp1_grads.pt")
    return {("plan", name, "tp1"): _planned_vs_built(arch, chunks, 1, 1)}


def _tp2_plan(layout: str, name: str, arch, chunks, base) -> dict:
    """The memory plan against the built TP=2 chunk."""
    return {("plan", name, "tp2"): _planned_vs_built(arch, chunks, 2, 1)} if layout == "tp2" else {}


def _gradient_runs(root: str, models: tuple) -> dict:
    """The gradients' errors at TP=2 x SP against TP=1's."""
    from megatron_kto.runtime import init_runtime

    out = {}
    for layout, sp in GRAD_LAYOUTS.items():
        rt = init_runtime(2, 1, seed=9)
        for name in models:
            path = Path(root) / name
            arch, chunks = fp.restore_and_run(path / "mcore", fp.Layout(tp=2, sp=sp), rt)
            want = torch.load(path / "tp1_grads.pt", weights_only=True)
            out[layout, name] = _grad_errors(_loss_grads(arch, chunks[0]), want, arch, chunks[0])
    return out


def _loss_grads(arch, chunk) -> dict[str, torch.Tensor]:
    """Every trainable parameter's gradient of a DPO-shaped loss of the rows' summed log-probs (rows 0, 2
    chosen, 1, 3 rejected) after one backward through megatron-core DDP and
    `finalize_model_grads`, as training reduces them (the SP norms' and the experts' over TP)."""
    import torch.nn.functional as F
    from megatron.core.distributed import finalize_model_grads

    from megatron_kto.models.builder import unwrap
    from megatron_kto.models.forward import eval_mode, model_call
    from megatron_kto.models.logprobs import token_logprobs
    from megatron_kto.models.training_setup import wrap_ddp

    (ddp,) = wrap_ddp([chunk], use_distributed_optimizer=False)
    ids = fp.tokens()
    labels = torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), -100)], dim=1)
    positions = torch.arange(ids.shape[1]).expand_as(ids).clone()
    with eval_mode([ddp]):
        logits = model_call(ddp, {"tokens": ids, "position_ids": positions})
    sums = token_logprobs(logits, labels, arch.vocab_size).sum(-1)
    F.logsigmoid(0.5 * (sums[0::2] - sums[1::2])).mean().neg().backward()
    finalize_model_grads([ddp])
    params = unwrap(chunk).named_parameters()
    return {n: p.main_grad.detach().clone() for n, p in params if p.requires_grad}


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
    hooks = fp.FamilyHooks(single=_tp1_results, layout=_tp2_plan, runs=_gradient_runs)
    root = tmp_path_factory.mktemp("deepseek_v3")
    return fp.convert_and_run(root, _hf_configs(), hooks, whole=("plan", *GRAD_LAYOUTS))


def test_the_correction_bias_changes_the_routing(converted):
    fp.check_correction_bias_matters(converted)


@pytest.mark.parametrize("layout,name", fp.cases(("tp1", "hf_tp1"), MODELS))
def test_single_rank_logprobs_and_choices_equal_transformers(converted, layout, name):
    fp.check_single_rank(converted, layout, name, _hf_configs()[name].num_hidden_layers - 1)


@pytest.mark.parametrize("layout,name", fp.cases(fp.PARALLEL, MODELS))
def test_parallel_logprobs_and_choices_equal_transformers(converted, layout, name):
    """TP=2, EP=2, PP=2, TP=2 x SP x EP=2 x ETP=1 (the last two also straight from the HF
    directory), checked as test_glm4_moe does."""
    fp.check_parallel(converted, layout, name)


@pytest.mark.parametrize("tp", ["tp1", "tp2"])
@pytest.mark.parametrize("name", MODELS)
def test_memory_plan_counts_the_built_mla_parameters(converted, name, tp):
    """The plan's parameters of a chunk (names, sizes, order) are the built model's."""
    _, _, results = converted
    planned, built = results["plan", name, tp]
    assert planned == built


@pytest.mark.parametrize("name", MODELS)
def test_packed_rows_equal_padded_rows(converted, name):
    fp.check_packed(converted, name)


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
    keys = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    config = fp.check_round_trip(converted, name, _hf_configs()[name], keys)
    assert config["first_k_dense_replace"] == 1


def _config(rope: dict | None = None, **changes) -> dict:
    return fp.config_with(_hf_configs()["qlora"], rope, **changes)


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
    fp.check_refused(_config(**changes), message)


def test_other_families_do_not_export_an_mla_model():
    from megatron_kto.conversion.hf_config import architecture_from_hf
    from megatron_kto.conversion.registry import expressing_types

    assert expressing_types(architecture_from_hf(_config())) == ["deepseek_v3"]


@pytest.mark.parametrize(
    "overrides,match",
    [
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
    mla = MLA_RUN
    compose_run_config("gpt_kto", mla, "kto", world_size=2)  # valid as it is, and at TP=2 x SP
    tp2 = ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"]
    compose_run_config("gpt_kto", mla + tp2, "kto", world_size=2)
    # and under CP (tests/test_mla_context_parallel.py), at TP=2 x SP too
    cp2 = ["model.context_parallel_size=2"]
    compose_run_config("gpt_kto", mla + cp2, "kto", world_size=2)
    compose_run_config("gpt_kto", mla + tp2 + cp2, "kto", world_size=4)
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
    flops = architecture_flops(dense_arch, fp.VOCAB)
    mlp = sum(p.numel() for p in dense.parameters())
    want = 2 * (attention + arch.num_layers * mlp + fp.VOCAB * arch.hidden_size)
    assert flops.per_token == want
    n, qh = arch.num_attention_heads, arch.qk_nope_head_dim + arch.qk_rope_head_dim
    assert flops.per_position == arch.num_layers * 2 * n * (qh + arch.v_head_dim)
