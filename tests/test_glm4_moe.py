"""GLM-4.5 (`glm4_moe`) against `transformers`' Glm4MoeForCausalLM: sigmoid routing with the
expert-score correction bias, group-limited routing, routed scaling, an ungated shared expert,
a dense first layer, q/k/v biases, partial rotary and (one model) Q/K norms.

Tiny random models (fp32): `groups` — 8 experts, top-4, 4 groups of which 2 are eligible
(top-4 // 2 = Hugging Face's top-2 group ranking), routed_scaling_factor 2.5, 2 shared experts,
Q/K norms; `plain` — one group, top-2, no Q/K norms, 4 layers. Norms and biases are moved away
from 1 / 0, routers are decisive, and every correction bias is a non-zero random vector that
changes the routing (checked: zeroing it changes Hugging Face's logits). Shown here:

* import (conversion) and the direct Hugging Face load -> our log-probs equal `transformers`' at
  TP=1, and TP=2, EP=2 and PP=2 (one 2-rank run; PP=2 puts the dense and an MoE layer on
  different stages), within 1e-5 relative; at CP=2 (same run; padded and packed rows, the
  partial rotary applied to each rank's chunks) every row's summed log-probs too;
* every MoE layer chooses the same experts as Hugging Face for every token;
* packed rows (THD) give the padded rows' log-probs;
* export -> safetensors bit-identical to the source, `transformers` loads them with the same
  logits, and the config keeps the routing settings;
* the expert bias is restored from our checkpoint as the Hugging Face buffer had it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from multirank import run_multirank

VOCAB, SEQ, BATCH = 100, 24, 4
RELATIVE = 1e-5
MODELS = ("groups", "plain")
LAYOUTS = {"tp2": (2, 1, 1), "ep2": (1, 1, 2), "pp2": (1, 2, 1)}
LENGTHS = [SEQ, SEQ - 5, SEQ - 11, SEQ - 2]


def _hf_configs() -> dict[str, object]:
    from transformers import Glm4MoeConfig

    common = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=VOCAB,
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


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))


def _hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def _hf_run(model) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(logits [B, T, V], per MoE layer the chosen experts as a [T, B, E] bool map — megatron's
    sequence-major token order)."""
    choices = []

    def hook(module, args, output):
        _, _, indices = output
        chosen = torch.zeros(indices.shape[0], module.num_experts, dtype=torch.bool)
        chosen.scatter_(1, indices, True)
        choices.append(chosen.view(BATCH, SEQ, -1).transpose(0, 1))

    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    handles = [g.register_forward_hook(hook) for g in gates]
    with torch.no_grad():
        logits = model(_tokens()).logits.float()
    for h in handles:
        h.remove()
    return logits, choices


def _reference_logprobs(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
    return logp.gather(-1, _tokens()[:, 1:, None])[..., 0].float()


def _forward(arch, chunks):
    """(log-probs [B, T-1], per MoE layer of this rank the routing maps) through megatron-core's
    schedule, one micro-batch; log-probs None off the last pipeline stage."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_kto.models.forward import eval_mode, gpt_forward_step
    from megatron_kto.models.logprobs import token_logprobs
    from megatron_kto.models.schedule import run_schedule

    tokens = _tokens()
    labels = torch.cat([tokens[:, 1:], torch.full((BATCH, 1), -100)], dim=1)
    batch = {
        "tokens": tokens,
        "labels": labels,
        "position_ids": torch.arange(SEQ).expand(BATCH, SEQ).clone(),
    }
    maps = []
    routers = [m for c in chunks for m in c.modules() if isinstance(m, TopKRouter)]
    handles = [r.register_forward_hook(lambda m, a, out: maps.append(out[1])) for r in routers]
    with torch.no_grad(), eval_mode(chunks):
        results = run_schedule(
            chunks,
            [batch],
            gpt_forward_step(
                lambda b, logits: token_logprobs(logits, b["labels"], arch.vocab_size)[:, :-1]
            ),
            forward_only=True,
            collect_non_loss_data=True,
        )
    for h in handles:
        h.remove()
    maps = [m.reshape(SEQ, BATCH, -1) for m in maps]
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None, maps
    return results[0], maps


def _packed_vs_padded(arch, chunk) -> float:
    """max |Δ log-prob| between padded rows of different lengths and the same rows packed."""
    from megatron_kto.models.forward import eval_mode, model_call
    from megatron_kto.models.logprobs import token_logprobs
    from megatron_kto.models.packing import PACKED, pack_micro_batch

    tokens = _tokens().clone()
    labels = torch.full_like(tokens, -100)
    for i, n in enumerate(LENGTHS):
        tokens[i, n:] = 0
        labels[i, : n - 1] = tokens[i, 1:n]
    batch = {
        "tokens": tokens,
        "labels": labels,
        "position_ids": torch.arange(SEQ).expand(BATCH, SEQ).clone(),
    }
    with torch.no_grad(), eval_mode([chunk]):
        padded = token_logprobs(model_call(chunk, batch), labels, arch.vocab_size)
        packed_batch = pack_micro_batch(batch, [n - 1 for n in LENGTHS])
        assert packed_batch[PACKED].num_rows == BATCH
        packed = token_logprobs(model_call(chunk, packed_batch), packed_batch["labels"], VOCAB)
    want = torch.cat([padded[i, : n - 1] for i, n in enumerate(LENGTHS)])
    return (packed.reshape(-1)[: want.numel()] - want).abs().max().item()


def _build(arch, tp: int, pp: int, ep: int, rt, cp: int = 1, sequence_parallel: bool = False):
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks

    layout = ParallelLayout(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        context_parallel_size=cp,
        sequence_parallel=sequence_parallel,
        attention_backend="sdpa",
    )
    return build_gpt_chunks(arch, layout, rt.device)


def _restore_and_run(
    path: Path, tp: int, pp: int, ep: int, rt, cp: int = 1, sequence_parallel: bool = False
) -> tuple:
    from megatron_kto.checkpointing.model_io import read_architecture
    from megatron_kto.checkpointing.pretrained import restore_pretrained

    arch = read_architecture(path)
    chunks = _build(arch, tp, pp, ep, rt, cp, sequence_parallel)
    restore_pretrained(path, chunks)
    return arch, chunks


def _row_sums(arch, chunks, pack: bool) -> torch.Tensor:
    """Each row's summed log-probs (the KTO / DPO passes' statistic), through the schedule; under
    context parallelism every rank's share is reduced over the CP group."""
    from megatron_kto.models.forward import LOGP_SUM, eval_mode, forward_sequence_stats

    tokens = _tokens()
    labels = torch.cat([tokens[:, 1:], torch.full((BATCH, 1), -100)], dim=1)
    positions = torch.arange(SEQ).expand(BATCH, SEQ).clone()
    with eval_mode(chunks):
        stats = forward_sequence_stats(
            chunks, tokens, labels, positions, BATCH, arch.vocab_size, pack=pack
        )
    return stats[:, LOGP_SUM].clone()


def _single_worker(rank: int, world_size: int, root: str) -> dict:
    """Per model: import, TP=1 from the checkpoint (a different init) and from the HF directory
    directly, packed vs padded, the restored expert biases, export."""
    from megatron_kto.hf_writer.convert import export_hf, import_hf
    from megatron_kto.models.builder import named_weights, unwrap
    from megatron_kto.runtime import init_runtime, teardown

    out = {}
    for name in MODELS:
        base = Path(root) / name
        out["arch", name] = import_hf(base / "hf", base / "mcore").to_dict()
        rt = init_runtime(1, 1, seed=9)  # a different init: only the checkpoint can match
        arch, chunks = _restore_and_run(base / "mcore", 1, 1, 1, rt)
        out["tp1", name] = _forward(arch, chunks)
        out["packed", name] = _packed_vs_padded(arch, chunks[0])
        out["bias", name] = {
            k: v.clone()
            for k, v in named_weights(unwrap(chunks[0])).items()
            if k.endswith("expert_bias")
        }
        teardown()
        rt = init_runtime(1, 1, seed=9)
        out["hf_tp1", name] = _forward(*_restore_and_run(base / "hf", 1, 1, 1, rt))
        teardown()
        export_hf(base / "mcore", base / "export")
    return out


def _layout_worker(rank: int, world_size: int, root: str, layouts: dict) -> dict:
    """TP=2, EP=2, PP=2 from our checkpoint; EP=2 also straight from the HF directory."""
    from megatron_kto.runtime import init_runtime, teardown

    out = {}
    for layout, (tp, pp, ep) in layouts.items():
        rt = init_runtime(tp, pp, seed=9, expert_parallel_size=ep)
        for name in MODELS:
            out[layout, name] = _forward(
                *_restore_and_run(Path(root) / name / "mcore", tp, pp, ep, rt)
            )
            if layout == "ep2":
                hf = _restore_and_run(Path(root) / name / "hf", tp, pp, ep, rt)
                out["hf_ep2", name] = _forward(*hf)
    # Context parallelism: each rank rotates its two chunks of every row (partial rotary).
    rt = init_runtime(1, 1, seed=9, context_parallel_size=2)
    for name in MODELS:
        arch, chunks = _restore_and_run(Path(root) / name / "mcore", 1, 1, 1, rt, cp=2)
        for pack in (False, True):
            out["cp2_sums", name, pack] = _row_sums(arch, chunks, pack)
    teardown()
    return out


def sigmoid_moe_references(root: Path, configs: dict) -> dict:
    """Save each tiny random model of `configs` (norms and biases off 1 / 0, decisive routers,
    non-zero correction biases) under `root / name / "hf"`; per model HF's logits, expert choices,
    logits without the correction bias, and the bias buffers as reloaded."""
    from transformers import AutoModelForCausalLM

    reference = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "norm" in pname or pname.endswith("bias"):  # away from 1 / 0: every one shows
                    p.add_(0.1 * torch.randn_like(p))
                elif pname.endswith("mlp.gate.weight"):  # routers: decisive, far from ties
                    p.normal_(0.0, 0.3)
            for bname, b in model.named_buffers():
                if bname.endswith("e_score_correction_bias"):
                    b.copy_(0.3 * torch.randn_like(b))
        model.save_pretrained(root / name / "hf")
        hf = _hf_model(root / name / "hf")
        logits, choices = _hf_run(hf)
        with torch.no_grad():  # the bias must matter for this test to mean anything
            for bname, b in hf.named_buffers():
                if bname.endswith("e_score_correction_bias"):
                    b.zero_()
        unbiased, _ = _hf_run(hf)
        buffers = {
            k: v.clone()
            for k, v in _hf_model(root / name / "hf").named_buffers()
            if k.endswith("e_score_correction_bias")
        }
        reference[name] = {
            "logits": logits,
            "choices": choices,
            "unbiased": unbiased,
            "buffers": buffers,
        }
    return reference


def merge_rank_outputs(results: dict, rank_outputs: list[dict], whole: tuple[str, ...]) -> dict:
    """Fold every rank's {key: (log-probs or None, routing maps)} into `results`: the last
    stage's log-probs (TP / EP ranks agree) and every rank's maps in rank order; keys starting
    with one of `whole` are taken as they are (from the first rank)."""
    for rank_out in rank_outputs:
        for key, value in rank_out.items():
            if key[0] in whole:
                results.setdefault(key, value)
                continue
            logprobs, maps = value
            entry = results.setdefault(key, (None, []))
            if logprobs is not None:
                entry = results[key] = (logprobs, entry[1])
            entry[1].append(maps)
    return results


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm4_moe")
    reference = sigmoid_moe_references(root, _hf_configs())
    results = run_multirank(_single_worker, 1, str(root), timeout=600)[0]
    ranks = run_multirank(_layout_worker, 2, str(root), LAYOUTS, timeout=600)
    return root, reference, merge_rank_outputs(results, ranks, ("cp2_sums",))


def _relative_error(logprobs: torch.Tensor, name: str, reference: dict) -> float:
    want = _reference_logprobs(reference[name]["logits"])
    return ((logprobs - want).abs() / want.abs().clamp(min=1.0)).max().item()


def test_the_correction_bias_changes_the_routing(converted):
    _, reference, _ = converted
    for name in MODELS:
        ref = reference[name]
        assert (ref["logits"] - ref["unbiased"]).abs().max() > 1e-3, name


CASES = [(layout, name) for layout in ("tp1", "hf_tp1") for name in MODELS]


@pytest.mark.parametrize("layout,name", CASES, ids=[f"{n}-{lay}" for lay, n in CASES])
def test_single_rank_logprobs_and_choices_equal_transformers(converted, layout, name):
    check_single_rank(converted, layout, name, _hf_configs()[name].num_hidden_layers - 1)


def check_single_rank(converted, layout: str, name: str, moe_layers: int) -> None:
    """One rank's log-probs within `RELATIVE` of HF's, and the same experts in every layer."""
    _, reference, results = converted
    logprobs, maps = results[layout, name]
    error = _relative_error(logprobs, name, reference)
    print(f"{name} {layout}: max relative |Δ logp| {error:.2e}")
    assert error <= RELATIVE
    choices = reference[name]["choices"]
    assert len(maps) == len(choices) == moe_layers
    for ours, theirs in zip(maps, choices, strict=True):
        assert torch.equal(ours, theirs)


LAYOUT_CASES = [(layout, name) for layout in (*LAYOUTS, "hf_ep2") for name in MODELS]


@pytest.mark.parametrize("layout,name", LAYOUT_CASES, ids=[f"{n}-{lay}" for lay, n in LAYOUT_CASES])
def test_parallel_logprobs_and_choices_equal_transformers(converted, layout, name):
    check_parallel(converted, layout, name)


def check_parallel(converted, layout: str, name: str) -> None:
    """Log-probs from the last stage; every rank's routing maps of the layers it holds (TP and
    EP ranks route the same tokens, PP stages their own layers) equal HF's choices."""
    _, reference, results = converted
    logprobs, per_rank = results[layout, name]
    error = _relative_error(logprobs, name, reference)
    print(f"{name} {layout}: max relative |Δ logp| {error:.2e}")
    assert error <= RELATIVE
    choices = reference[name]["choices"]
    if layout == "pp2":  # stage 0 holds the first MoE layers, stage 1 the others
        per_rank = [[m for maps in per_rank for m in maps]]
    for maps in per_rank:
        assert len(maps) == len(choices)
        for ours, theirs in zip(maps, choices, strict=True):
            assert torch.equal(ours, theirs)


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("name", MODELS)
def test_context_parallel_row_logprobs_equal_transformers(converted, name, pack):
    """CP=2 (padded and packed rows): every row's summed log-probs equal Hugging Face's."""
    _, reference, results = converted
    want = _reference_logprobs(reference[name]["logits"]).double().sum(1)
    got = results["cp2_sums", name, pack].double()
    error = ((got - want).abs() / want.abs()).max().item()
    print(f"{name} cp2 {'packed' if pack else 'padded'}: max relative |Δ row logp| {error:.2e}")
    assert error <= RELATIVE


@pytest.mark.parametrize("name", MODELS)
def test_packed_rows_equal_padded_rows(converted, name):
    _, _, results = converted
    assert results["packed", name] <= 1e-5


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


def _safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from megatron_kto.conversion.safetensors_io import HFWeights

    weights = HFWeights(model_dir)
    return {name: weights.get(name) for name in weights.names()}


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
    for key in ("n_group", "topk_group", "routed_scaling_factor", "n_shared_experts"):
        assert config[key] == getattr(source, key), key
    assert config["first_k_dense_replace"] == 1 and config["partial_rotary_factor"] == 0.5
    logits, choices = _hf_run(_hf_model(root / name / "export"))
    assert torch.equal(logits, reference[name]["logits"])


def _config(**changes) -> dict:
    config = _hf_configs()["groups"].to_dict()
    config.update(changes)
    return config


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
        ({"partial_rotary_factor": 0.3}, "partial_rotary_factor 0.3: must rotate an even"),
    ],
)
def test_configs_megatron_would_route_differently_are_refused(changes, message):
    """One line naming the key, for every combination where megatron-core's sigmoid top-k
    would differ from Hugging Face's (renormalisation, group ranking) or the model cannot be
    built."""
    from megatron_kto.conversion.hf_config import ConversionError, architecture_from_hf

    config = _config(**changes)
    if "partial_rotary_factor" in changes:
        config["rope_parameters"] = {**config["rope_parameters"], **changes}
    with pytest.raises(ConversionError) as info:
        architecture_from_hf(config, "cfg.json")
    text = str(info.value)
    assert text.startswith(f"cfg.json: {message}"), text
    assert "\n" not in text


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
