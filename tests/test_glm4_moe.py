"""GLM-4.5 (`glm4_moe`) against `transformers`' Glm4MoeForCausalLM: sigmoid routing with the
expert-score correction bias, group-limited routing, routed scaling, an ungated shared expert,
a dense first layer, q/k/v biases, partial rotary and (one model) Q/K norms.

Tiny random models (fp32): `groups` — 8 experts, top-4, 4 groups of which 2 are eligible
(top-4 // 2 = Hugging Face's top-2 group ranking), routed_scaling_factor 2.5, 2 shared experts,
Q/K norms; `plain` — one group, top-2, no Q/K norms, 4 layers. Norms and biases are moved away
from 1 / 0, routers are decisive, and every correction bias is a non-zero random vector that
changes the routing (checked: zeroing it changes Hugging Face's logits). Shown here:

* import (conversion) and the direct Hugging Face load -> our log-probs equal `transformers`' at
  TP=1, and TP=2, EP=2, PP=2 and TP=2 x SP x EP=2 x ETP=1 (one 2-rank run; PP=2 puts the dense
  and an MoE layer on different stages; ETP=1: the TP ranks hold whole experts), within 1e-5
  relative; at CP=2 (same run; padded and packed rows, the partial rotary applied to each rank's
  chunks) every row's summed log-probs too;
* every MoE layer chooses the same experts as Hugging Face for every token;
* packed rows (THD) give the padded rows' log-probs;
* export -> safetensors bit-identical to the source, `transformers` loads them with the same
  logits, and the config keeps the routing settings;
* the expert bias is restored from our checkpoint as the Hugging Face buffer had it.

The runs and checks are `family_parity`'s; this file holds the configs and GLM's own checks.
"""

from __future__ import annotations

from pathlib import Path

import family_parity as fp
import pytest
import torch

MODELS = ("groups", "plain")


def _hf_configs() -> dict[str, object]:
    from transformers import Glm4MoeConfig

    common = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=fp.VOCAB,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        attention_bias=True,
        first_k_dense_replace=1,
        tie_word_embeddings=False,
    )
    return {
        "groups": Glm4MoeConfig(
            num_hidden_layers=2,
            intermediate_size=96,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            n_shared_experts=2,
            routed_scaling_factor=2.5,
            use_qk_norm=True,
            **common,
        ),
        "plain": Glm4MoeConfig(
            num_hidden_layers=4,
            intermediate_size=80,
            moe_intermediate_size=48,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            use_qk_norm=False,
            **common,
        ),
    }


def _row_sums(arch, chunks, pack: bool) -> torch.Tensor:
    """Each row's summed log-probs (the KTO / DPO passes' statistic), through the schedule; under
    context parallelism every rank's share is reduced over the CP group."""
    from megatron_kto.models.forward import LOGP_SUM, eval_mode, forward_sequence_stats

    ids = fp.tokens()
    labels = torch.cat([ids[:, 1:], torch.full((fp.BATCH, 1), -100)], dim=1)
    positions = torch.arange(fp.SEQ).expand(fp.BATCH, fp.SEQ).clone()
    with eval_mode(chunks):
        stats = forward_sequence_stats(
            chunks, ids, labels, positions, fp.BATCH, arch.vocab_size, pack=pack
        )
    return stats[:, LOGP_SUM].clone()


def _restored_biases(name: str, arch, chunks, base) -> dict:
    """The expert biases restored at TP=1 from our checkpoint."""
    from megatron_kto.models.builder import named_weights, unwrap

    biases = named_weights(unwrap(chunks[0])).items()
    return {("bias", name): {k: v.clone() for k, v in biases if k.endswith("expert_bias")}}


def _context_parallel_runs(root: str, models: tuple) -> dict:
    """Context parallelism: each rank rotates its two chunks of every row (partial rotary)."""
    from megatron_kto.runtime import init_runtime

    out = {}
    rt = init_runtime(1, 1, seed=9, context_parallel_size=2)
    for name in models:
        arch, chunks = fp.restore_and_run(Path(root) / name / "mcore", fp.Layout(), rt, cp=2)
        for pack in (False, True):
            out["cp2_sums", name, pack] = _row_sums(arch, chunks, pack)
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    hooks = fp.FamilyHooks(single=_restored_biases, runs=_context_parallel_runs)
    root = tmp_path_factory.mktemp("glm4_moe")
    return fp.convert_and_run(root, _hf_configs(), hooks, whole=("cp2_sums",))


def test_the_correction_bias_changes_the_routing(converted):
    fp.check_correction_bias_matters(converted)


@pytest.mark.parametrize("layout,name", fp.cases(("tp1", "hf_tp1"), MODELS))
def test_single_rank_logprobs_and_choices_equal_transformers(converted, layout, name):
    fp.check_single_rank(converted, layout, name, _hf_configs()[name].num_hidden_layers - 1)


@pytest.mark.parametrize("layout,name", fp.cases(fp.PARALLEL, MODELS))
def test_parallel_logprobs_and_choices_equal_transformers(converted, layout, name):
    """TP=2, EP=2, PP=2, TP=2 x SP x EP=2 x ETP=1 (the last two also straight from the HF
    directory)."""
    fp.check_parallel(converted, layout, name)


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("name", MODELS)
def test_context_parallel_row_logprobs_equal_transformers(converted, name, pack):
    """CP=2 (padded and packed rows): every row's summed log-probs equal Hugging Face's."""
    _, reference, results = converted
    want = fp.reference_logprobs(reference[name]["logits"]).double().sum(1)
    got = results["cp2_sums", name, pack].double()
    error = ((got - want).abs() / want.abs()).max().item()
    print(f"{name} cp2 {'packed' if pack else 'padded'}: max relative |Δ row logp| {error:.2e}")
    assert error <= fp.RELATIVE


@pytest.mark.parametrize("name", MODELS)
def test_packed_rows_equal_padded_rows(converted, name):
    fp.check_packed(converted, name)


@pytest.mark.parametrize("name", MODELS)
def test_expert_bias_is_restored_from_the_checkpoint(converted, name):
    _, reference, results = converted
    ours = results["bias", name]
    theirs = reference[name]["buffers"]
    assert len(ours) == len(theirs) > 0
    for key, value in ours.items():
        layer = key.split(".")[2]
        assert torch.equal(value, theirs[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"])


def test_routing_settings_follow_the_config(converted):
    _, _, results = converted
    groups, plain = results["arch", "groups"], results["arch", "plain"]
    assert groups["moe_router_score_function"] == "sigmoid"
    assert groups["moe_router_enable_expert_bias"]
    assert (groups["moe_router_num_groups"], groups["moe_router_group_topk"]) == (4, 2)
    assert groups["moe_router_topk_scaling_factor"] == 2.5
    assert groups["moe_shared_expert_intermediate_size"] == 64
    assert not groups["moe_shared_expert_gate"]
    assert groups["moe_layer_freq"] == [0, 1] and groups["ffn_hidden_size"] == 96
    assert groups["rotary_percent"] == 0.5 and groups["qk_layernorm"] and groups["add_qkv_bias"]
    assert (
        plain["moe_router_num_groups"] is None and plain["moe_router_topk_scaling_factor"] is None
    )
    assert plain["moe_layer_freq"] == [0, 1, 1, 1] and not plain["qk_layernorm"]


@pytest.mark.parametrize("name", MODELS)
def test_round_trip_is_bit_exact_and_loads_in_transformers(converted, name):
    keys = ("n_group", "topk_group", "routed_scaling_factor", "n_shared_experts")
    config = fp.check_round_trip(converted, name, _hf_configs()[name], keys)
    assert config["first_k_dense_replace"] == 1 and config["partial_rotary_factor"] == 0.5


def _config(rope: dict | None = None, **changes) -> dict:
    return fp.config_with(_hf_configs()["groups"], rope, **changes)


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"norm_topk_prob": False}, "norm_topk_prob False with num_experts_per_tok 4: megatron"),
        ({"num_experts_per_tok": 1}, "norm_topk_prob True with num_experts_per_tok 1: megatron"),
        ({"topk_group": 1}, "topk_group 1: megatron-core ranks groups by their top-(num_experts"),
        ({"n_group": 3}, "n_group 3 / topk_group 2: the groups must divide the 8 experts"),
        ({"n_group": 8, "topk_group": 2}, "n_group 8 / topk_group 2: the groups must divide"),
        ({"first_k_dense_replace": 2}, "first_k_dense_replace 2: must leave at least one of"),
        ({"n_shared_experts": 0}, "n_shared_experts: 0 is not a positive integer"),
        (
            {"partial_rotary_factor": 0.3, "rope": {"partial_rotary_factor": 0.3}},
            "partial_rotary_factor 0.3: must rotate an even",
        ),
    ],
)
def test_configs_megatron_would_route_differently_are_refused(changes, message):
    """One line naming the key, for every combination where megatron-core's sigmoid top-k
    would differ from Hugging Face's (renormalisation, group ranking) or the model cannot be
    built."""
    fp.check_refused(_config(**changes), message)


def test_groups_that_limit_nothing_are_not_set_and_scaling_one_is_none():
    from megatron_kto.conversion.hf_config import architecture_from_hf

    arch = architecture_from_hf(_config(topk_group=4, routed_scaling_factor=1.0))
    assert arch.moe_router_num_groups is None and arch.moe_router_group_topk is None
    assert arch.moe_router_topk_scaling_factor is None


def test_mtp_tensors_are_skipped_only_when_the_config_has_them():
    from megatron_kto.conversion.hf_dir import skipped_hf_tensors

    names = ["model.layers.1.mlp.gate.weight", "model.layers.2.eh_proj.weight", "lm_head.weight"]
    config = _config(num_nextn_predict_layers=1)
    assert skipped_hf_tensors(config, names) == {"model.layers.2.eh_proj.weight"}
    assert skipped_hf_tensors(_config(num_nextn_predict_layers=0), names) == set()


def test_other_families_do_not_export_a_sigmoid_routed_model():
    from megatron_kto.conversion.hf_config import architecture_from_hf
    from megatron_kto.conversion.registry import expressing_types

    arch = architecture_from_hf(_config())
    assert expressing_types(arch) == ["glm4_moe"]
