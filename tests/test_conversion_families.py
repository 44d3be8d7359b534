"""Qwen3 (dense, tied and untied), Qwen3-MoE, Mixtral and Qwen2-MoE conversion, against `transformers`.

Tiny random `transformers` models built from a config (head dim 32 != hidden / heads, GQA,
vocabulary 100 so the embedding is padded; MoE: 4 experts, 2 routed per token; Qwen2-MoE with its
gated shared expert and qkv biases; Qwen3-MoE with
`norm_topk_prob=False` — softmax before top-k, no renormalisation — and Mixtral renormalised).
Norms are moved away from 1 and routers get large weights, so every tensor and every routing
decision matters. Shown here:

* import -> our full logits and per-token log-probs through megatron-core's schedule equal
  `transformers`' to 1e-4 at TP=1, TP=2, PP=2 and, for MoE, EP=2, EP=2 x TP=2 and with expert
  tensor parallelism apart from TP: TP=2 with whole experts (ETP=1), experts split over the
  data-parallel ranks (TP=1, ETP=2), and EP=2 x TP=2 x ETP=1 (EP spans the TP ranks);
* export -> the safetensors equal the source bit for bit, and `transformers` loads them with
  identical logits;
* the MoE router settings (top-k, softmax placement) follow the config;
* Qwen3-MoE / Qwen2-MoE with dense layers between MoE layers (`mlp_only_layers`,
  `decoder_sparse_step`) do all of the above (PP=2 puts a dense and an MoE layer on different
  stages), and their exported config.json makes the same layers dense.

Process spawns are grouped: one single-process worker (import, TP=1, export), one 2-rank worker
(TP=2, PP=2, EP=2, ETP) and one 4-rank worker (EP=2 x TP=2, ETP=1 or 2).
"""

from __future__ import annotations

from pathlib import Path

import family_parity as fp
import pytest
import torch
from multirank import run_multirank

TOLERANCE = 1e-4
MODELS = ("qwen3", "qwen3_tied", "qwen3_moe", "mixtral", "qwen2_moe", "qwen3_mixed", "qwen2_mixed")
MOE = ("qwen3_moe", "mixtral", "qwen2_moe", "qwen3_mixed", "qwen2_mixed")
#: The mixed models' layer kinds (1 MoE, 0 dense): under PP=2 each stage holds one of each kind.
MIXED = {"qwen3_mixed": [1, 0], "qwen2_mixed": [0, 1]}
#: layout name -> (TP, PP, EP, ETP (None: TP)), on 2 ranks; ETP != TP for MoE models only
LAYOUTS = {
    "tp2": (2, 1, 1, None),
    "pp2": (1, 2, 1, None),
    "ep2": (1, 1, 2, None),
    "tp2etp1": (2, 1, 1, 1),
    "etp2": (1, 1, 1, 2),
}
#: on 4 ranks
LAYOUTS4 = {"ep2tp2": (2, 1, 2, None), "ep2tp2etp1": (2, 1, 2, 1)}


def _hf_configs() -> dict[str, object]:
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=fp.VOCAB,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
    )
    return {
        "qwen3": Qwen3Config(
            intermediate_size=96, head_dim=32, tie_word_embeddings=False, **common
        ),
        "qwen3_tied": Qwen3Config(
            intermediate_size=96, head_dim=32, tie_word_embeddings=True, **common
        ),
        "qwen3_moe": Qwen3MoeConfig(
            intermediate_size=96,
            moe_intermediate_size=48,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            head_dim=32,
            tie_word_embeddings=False,
            **common,
        ),
        "qwen2_moe": Qwen2MoeConfig(
            intermediate_size=96,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            **common,
        ),
        # Dense and MoE layers mixed: Qwen3-MoE with layer 1 dense (`mlp_only_layers`), Qwen2-MoE
        # (shared expert) with every second layer MoE (`decoder_sparse_step`: layer 0 dense).
        "qwen3_mixed": Qwen3MoeConfig(
            intermediate_size=96,
            moe_intermediate_size=48,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            head_dim=32,
            tie_word_embeddings=False,
            router_aux_loss_coef=0.02,
            **common,
        ),
        "qwen2_mixed": Qwen2MoeConfig(
            intermediate_size=80,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=2,
            **common,
        ),
        "mixtral": MixtralConfig(
            intermediate_size=48,
            num_local_experts=4,
            num_experts_per_tok=2,
            head_dim=32,
            sliding_window=None,
            **common,
        ),
    }


def _restore_and_run(root: str, name: str, tp: int, pp: int, ep: int, rt, etp: int | None = None):
    from megatron_kto.checkpointing.model_io import read_architecture
    from megatron_kto.checkpointing.pretrained import restore_pretrained
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks

    ckpt = Path(root) / name / "mcore"
    arch = read_architecture(ckpt)
    layout = ParallelLayout(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    chunks = build_gpt_chunks(arch, layout, rt.device)
    restore_pretrained(ckpt, chunks)
    return fp.forward_logits(arch, chunks)


def _convert_worker(rank: int, world_size: int, root: str) -> dict:
    """Import every model, run it at TP=1 from a different init, export it again."""
    from megatron_kto.hf_writer.convert import export_hf, import_hf
    from megatron_kto.runtime import init_runtime, teardown

    out = {}
    for name in MODELS:
        base = Path(root) / name
        arch = import_hf(base / "hf", base / "mcore")
        out["arch", name] = arch.to_dict()
        rt = init_runtime(1, 1, seed=9)  # a different init: only the checkpoint can match
        out["tp1", name] = _restore_and_run(root, name, 1, 1, 1, rt)
        teardown()
        export_hf(base / "mcore", base / "export")
    return out


def _layout_worker(rank: int, world_size: int, root: str, layouts: dict) -> dict:
    """Every converted model restored under each layout (MoE models only for EP > 1 or an
    expert TP of its own)."""
    from megatron_kto.runtime import init_runtime, teardown

    out = {}
    for layout, (tp, pp, ep, etp) in layouts.items():
        rt = init_runtime(tp, pp, seed=9, expert_parallel_size=ep, expert_tensor_parallel_size=etp)
        for name in MOE if ep > 1 or etp is not None else MODELS:
            out[layout, name] = _restore_and_run(root, name, tp, pp, ep, rt, etp)
    teardown()
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("families")
    reference = {}
    for name, config in _hf_configs().items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        fp.perturb(model, "gate.weight")  # the shared experts' gates too
        model.save_pretrained(root / name / "hf")
        reference[name] = fp.hf_logits(root / name / "hf")
    results = run_multirank(_convert_worker, 1, str(root), timeout=600)[0]
    for rank_out in run_multirank(_layout_worker, 2, str(root), LAYOUTS, timeout=600) + (
        run_multirank(_layout_worker, 4, str(root), LAYOUTS4, timeout=600)
    ):
        for key, value in rank_out.items():
            if value is not None:  # one last-stage rank's result suffices (TP/EP ranks agree)
                results.setdefault(key, value)
    return root, reference, results


CASES = [(layout, name) for layout in ("tp1", *LAYOUTS) for name in MODELS]
CASES = [c for c in CASES if c[0] in ("tp1", "tp2", "pp2") or c[1] in MOE]
CASES += [(layout, n) for layout in LAYOUTS4 for n in MOE]


@pytest.mark.parametrize("layout,name", CASES, ids=[f"{n}-{lay}" for lay, n in CASES])
def test_logits_and_logprobs_equal_transformers(converted, layout, name):
    fp.check_logits(converted, layout, name, TOLERANCE)


@pytest.mark.parametrize("name", MODELS)
def test_round_trip_is_bit_exact_and_loads_in_transformers(converted, name):
    import json

    root, reference, _ = converted
    fp.check_bit_exact(root / name / "hf", root / name / "export")
    config = json.loads((root / name / "export" / "config.json").read_text())
    assert config["model_type"] == _hf_configs()[name].model_type
    assert torch.equal(fp.hf_logits(root / name / "export"), reference[name])


def test_router_settings_follow_the_config(converted):
    _, _, results = converted
    qwen3_moe, mixtral = results["arch", "qwen3_moe"], results["arch", "mixtral"]
    assert (qwen3_moe["num_moe_experts"], qwen3_moe["moe_router_topk"]) == (4, 2)
    assert qwen3_moe["moe_ffn_hidden_size"] == 48 and qwen3_moe["qk_layernorm"]
    assert qwen3_moe["moe_router_pre_softmax"]  # norm_topk_prob=False: softmax, then top-k
    assert not mixtral["moe_router_pre_softmax"] and not mixtral["qk_layernorm"]
    assert mixtral["moe_aux_loss_coeff"] == pytest.approx(
        _hf_configs()["mixtral"].router_aux_loss_coef
    )
    assert results["arch", "qwen3"]["kv_channels"] == 32
    for name, pattern in MIXED.items():  # dense layers: the dense MLP of intermediate_size
        arch = results["arch", name]
        assert arch["moe_layer_freq"] == pattern
        assert arch["ffn_hidden_size"] == _hf_configs()[name].intermediate_size
        assert arch["moe_ffn_hidden_size"] == 48
    assert results["arch", "qwen3_moe"]["moe_layer_freq"] is None  # every layer MoE


def test_exported_config_has_the_same_dense_layers(converted):
    """config.json written on export makes `transformers` build the same layer kinds
    (`decoder_sparse_step` when the pattern is a step, else `mlp_only_layers`)."""
    import json

    root = converted[0]
    for name, pattern in MIXED.items():
        config = json.loads((root / name / "export" / "config.json").read_text())
        step, dense = config["decoder_sparse_step"], config["mlp_only_layers"]
        kinds = [int(i not in dense and (i + 1) % step == 0) for i in range(2)]
        assert kinds == pattern, (name, step, dense)
    plain = json.loads((root / "qwen3_moe" / "export" / "config.json").read_text())
    assert (plain["decoder_sparse_step"], plain["mlp_only_layers"]) == (1, [])


def _aux_gradient_worker(rank: int, world_size: int, root: str, name: str) -> dict:
    """Our model's load-balancing loss (router hooks) on padded rows, and its gradients."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_kto.checkpointing.model_io import read_architecture
    from megatron_kto.checkpointing.pretrained import restore_pretrained
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks
    from megatron_kto.models.forward import model_call
    from megatron_kto.models.router_stats import RouterStatistics, token_mask
    from megatron_kto.runtime import init_runtime, teardown

    ckpt = Path(root) / name / "mcore"
    arch = read_architecture(ckpt)
    rt = init_runtime(1, 1, seed=9)
    (chunk,) = build_gpt_chunks(arch, ParallelLayout(), rt.device)
    restore_pretrained(ckpt, [chunk])
    tokens, lengths = _aux_rows()
    labels = torch.full_like(tokens, -100)
    for i, n in enumerate(lengths):
        # Inputs are sequences without their final token, so the last input position is scored.
        labels[i, : n - 1] = tokens[i, 1:n]
        labels[i, n - 1] = 1
    batch = {
        "tokens": tokens,
        "labels": labels,
        "position_ids": torch.arange(fp.SEQ).expand(fp.BATCH, fp.SEQ),
    }
    stats = RouterStatistics([chunk], coeff=1.0)
    stats.begin(token_mask(batch))
    output = model_call(chunk, batch)
    stats.finish()
    loss = stats.step_values()[0]
    # The loss's gradient rides on the routers' outputs (megatron's MoEAuxLossAutoScaler, scale 1
    # here): a backward of the output with a zero gradient leaves exactly the loss's gradients.
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(()))
    (output * 0).sum().backward()
    grads = {n: p.grad.clone() for n, p in chunk.named_parameters() if n.endswith("router.weight")}
    grads["embedding"] = chunk.embedding.word_embeddings.weight.grad[: fp.VOCAB].clone()
    teardown()
    return {"loss": loss.item(), "grads": grads}


def _aux_rows() -> tuple[torch.Tensor, list[int]]:
    """Padded rows of different lengths (the padding must not count)."""
    lengths = [fp.SEQ, fp.SEQ - 5, fp.SEQ - 11, fp.SEQ - 2]
    tokens = fp.tokens().clone()
    for i, n in enumerate(lengths):
        tokens[i, n:] = 0
    return tokens, lengths


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "qwen3_mixed", "qwen2_mixed"])
def test_load_balancing_loss_and_gradients_equal_transformers(converted, name):
    """The router statistics hooked in our model give HF's `aux_loss` (attention-mask tokens,
    all MoE layers jointly: a dense layer has no router and counts no tokens) and the same
    gradients for the routers and the embedding (so the gradient reaches the hidden states as
    in HF)."""
    from transformers import AutoModelForCausalLM

    root = converted[0]
    ours = run_multirank(_aux_gradient_worker, 1, str(root), name, timeout=300)[0]
    model = AutoModelForCausalLM.from_pretrained(root / name / "hf", dtype=torch.float32)
    tokens, lengths = _aux_rows()
    mask = (torch.arange(fp.SEQ)[None, :] < torch.tensor(lengths)[:, None]).long()
    out = model(input_ids=tokens, attention_mask=mask, output_router_logits=True)
    out.aux_loss.backward()
    assert ours["loss"] == pytest.approx(out.aux_loss.item(), rel=1e-5)
    routers = {
        f"decoder.layers.{n.split('.')[2]}.mlp.router.weight": p
        for n, p in model.named_parameters()
        if n.endswith(".gate.weight") and "shared" not in n
    }
    assert routers.keys() == {k for k in ours["grads"] if k != "embedding"}
    for key, p in routers.items():
        torch.testing.assert_close(ours["grads"][key], p.grad, rtol=1e-4, atol=1e-7)
    hf_embedding = model.get_input_embeddings().weight.grad
    assert hf_embedding.abs().max() > 0
    scale = hf_embedding.abs().max().item()  # fp32 round-off relative to the largest entry
    torch.testing.assert_close(
        ours["grads"]["embedding"], hf_embedding, rtol=1e-4, atol=1e-5 * scale
    )
