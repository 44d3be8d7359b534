"""A new user's walk with a GLM-4.5-style model (`glm4_moe`): a tiny Hugging Face directory
(random weights, non-zero expert-score correction biases, a dense first layer, shared experts,
partial rotary, q/k/v biases) -> `python examples/train_gpt_kto.py
pretrained_checkpoint.restore_from_path=<hf dir> ... exp_manager.save_hf=true` -> `hf/` ->
`transformers` loads it and generates.

Runs of two steps: the default keeps the expert bias as the checkpoint has it (frozen: `hf/`
holds the source's biases bit for bit while the weights moved); `model.moe_router_bias_update_rate`
turns megatron-core's aux-loss-free update on (every bias moves by a multiple of the rate, at most
one rate per step). Both log the per-layer expert load (`load_imbalance/layer_<i>`, max / mean
tokens per expert, in [1, experts]) for the MoE layers only. A LoRA run on the attention
(Hugging Face target names, q/k/v with biases) writes a PEFT adapter that `peft` applies onto
the source model with the logits of our merged `hf_merged/`. The frozen run at EP=2 (2 ranks) and
at PP=2 x EP=2 (4 ranks: the dense layer on stage 0, the experts split over stage 1's data-parallel
ranks) trains the same steps and writes the same `hf/` as on one rank.
"""

from __future__ import annotations

import json

import pytest
import torch
from e2e_cli import KTO_SCRIPT, QUIET, REPO, read_metrics, run_script
from hf_tiny import hf_tensors, make_hf_sigmoid_routed, write_kto_rows

pytestmark = pytest.mark.e2e

EXPERTS, STEPS, RATE = 4, 2, 0.01
RUNS = {
    "frozen": [],
    "updated": [f"model.moe_router_bias_update_rate={RATE}"],
    "updated_precomputed": [
        f"model.moe_router_bias_update_rate={RATE}",
        "model.kto.reference_policy=precomputed",
    ],
    "lora": [
        "model.peft.peft_scheme=lora",
        "model.peft.lora_tuning.adapter_dim=4",
        "model.peft.lora_tuning.alpha=16",
        "model.peft.lora_tuning.target_modules=[q_proj,k_proj,v_proj,o_proj]",
        "exp_manager.save_hf_merged=true",
    ],
    # bf16 weights and compute; the sigmoid router in fp32 (`layer_options`).
    "bf16": ["trainer.precision=bf16"],
    # Two ranks, experts split over them (EP=2 x DP=2): hf/ gathers each rank's experts.
    "frozen_ep2": ["model.expert_model_parallel_size=2"],
    # Four ranks: the dense layer on stage 0, the MoE layer's experts split over stage 1's two
    # data-parallel ranks (PP=2 x EP=2 x DP=2).
    "frozen_pp2ep2": [
        "model.expert_model_parallel_size=2",
        "model.pipeline_model_parallel_size=2",
    ],
}
NPROC = {"frozen_ep2": 2, "frozen_pp2ep2": 4}
DPO_SCRIPT = REPO / "examples" / "train_gpt_dpo.py"
DPO_DATA = REPO / "examples" / "data" / "tiny_dpo" / "train.jsonl"


@pytest.fixture(scope="module")
def walk(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm_walk")
    # The model's own router init; correction biases ~N(0, 0.2).
    make_hf_sigmoid_routed(
        root / "hf_in",
        "glm4_moe",
        router_std=None,
        bias_std=0.2,
        n_routed_experts=EXPERTS,
        moe_intermediate_size=32,
    )
    write_kto_rows(root / "train.jsonl", 0, 32)
    for name, extra in RUNS.items():
        run_script(
            KTO_SCRIPT,
            [
                *QUIET,
                f"pretrained_checkpoint.restore_from_path={root / 'hf_in'}",
                f"model.data.data_prefix.train=[{root / 'train.jsonl'}]",
                "model.data.data_prefix.validation=[]",
                *(["trainer.precision=32"] if name != "bf16" else []),
                f"exp_manager.explicit_log_dir={root / name}",
                f"trainer.kto.max_steps={STEPS}",
                "model.global_batch_size=8",
                "model.micro_batch_size=4",
                "model.optim.lr=1e-2",
                "exp_manager.save_hf=true",
                *extra,
            ],
            nproc=NPROC.get(name, 1),
            timeout=600,
        )
    # DPO (pairs): the same model through the DPO trainer (the dpo loop's own keys).
    run_script(
        DPO_SCRIPT,
        [
            *QUIET,
            f"pretrained_checkpoint.restore_from_path={root / 'hf_in'}",
            f"model.data.data_prefix.train=[{DPO_DATA}]",
            "model.data.data_prefix.validation=[]",
            "trainer.precision=32",
            f"exp_manager.explicit_log_dir={root / 'dpo'}",
            f"trainer.dpo.max_steps={STEPS}",
            "model.global_batch_size=4",
            "model.micro_batch_size=2",
            "model.optim.lr=1e-2",
            "exp_manager.save_hf=true",
        ],
        timeout=600,
    )
    return root


def _biases(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in tensors.items() if k.endswith("e_score_correction_bias")}


def test_hf_output_keeps_a_frozen_bias_and_generates(walk):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, out = hf_tensors(walk / "hf_in"), hf_tensors(walk / "frozen" / "hf")
    assert out.keys() == source.keys()
    assert _biases(out) and all(torch.equal(v, source[k]) for k, v in _biases(out).items())
    moved = [k for k in out if not torch.equal(out[k], source[k])]
    assert any("experts" in k for k in moved) and any("self_attn" in k for k in moved)
    config = json.loads((walk / "frozen" / "hf" / "config.json").read_text())
    assert config["model_type"] == "glm4_moe" and config["first_k_dense_replace"] == 1
    model = AutoModelForCausalLM.from_pretrained(walk / "frozen" / "hf", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(walk / "frozen" / "hf")
    prompt = tokenizer("Hello there", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 5


def test_bias_update_rate_moves_the_bias_by_the_rate(walk):
    source, out = hf_tensors(walk / "hf_in"), hf_tensors(walk / "updated" / "hf")
    deltas = torch.cat([(v - source[k]).abs() for k, v in _biases(out).items()])
    assert deltas.max() > 0
    assert deltas.max() <= STEPS * RATE + 1e-6
    steps = deltas / RATE  # whole steps of the rate (fp32 round-off aside)
    assert torch.allclose(steps, steps.round(), atol=1e-3)


def test_the_swapped_reference_keeps_the_starting_bias(walk):
    """With the bias moving, the cpu_swap reference (the default) swaps the starting bias in
    with the starting weights: its run equals one whose reference log-probs were all computed
    before training (`precomputed`)."""
    swapped, precomputed = (
        read_metrics(walk / "updated"),
        read_metrics(walk / "updated_precomputed"),
    )
    for a, b in zip(swapped, precomputed, strict=True):
        for key in ("loss", "rewards/chosen", "rewards/rejected", "kl"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["step"], key)


@pytest.mark.parametrize("name", [*RUNS, "dpo"])
def test_load_imbalance_is_logged_for_the_moe_layers(walk, name):
    rows = read_metrics(walk / name)
    assert len(rows) == STEPS
    for row in rows:
        keys = sorted(k for k in row if k.startswith("load_imbalance/"))
        assert keys == ["load_imbalance/layer_1"]  # layer 0 is dense
        assert 1.0 <= row["load_imbalance/layer_1"] <= EXPERTS


def test_lora_adapter_applies_in_peft_as_our_merge(walk):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    base = AutoModelForCausalLM.from_pretrained(walk / "hf_in", dtype=torch.float32)
    with torch.no_grad():
        before = base(tokens).logits
        adapted = PeftModel.from_pretrained(base, walk / "lora" / "hf").eval()(tokens).logits
        merged = AutoModelForCausalLM.from_pretrained(
            walk / "lora" / "hf_merged", dtype=torch.float32
        )(tokens).logits
    assert (adapted - before).abs().max() > 1e-3  # the adapters trained
    torch.testing.assert_close(adapted, merged, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["frozen_ep2", "frozen_pp2ep2"])
def test_expert_parallel_runs_equal_one_rank(walk, name):
    """EP=2 and PP=2 x EP=2: every step's numbers and `hf/` equal the one-rank run's."""
    for a, b in zip(read_metrics(walk / name), read_metrics(walk / "frozen"), strict=True):
        for key in ("loss", "grad_norm", "kl", "logps/chosen", "rewards/rejected"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=5e-6), (a["step"], key)
    one, two = hf_tensors(walk / "frozen" / "hf"), hf_tensors(walk / name / "hf")
    assert one.keys() == two.keys()
    for key, value in one.items():
        if key.endswith("k_proj.bias"):
            # A key bias shifts every score of a query by the same amount: its true gradient is
            # 0, the computed one round-off that Adam scales up to lr-sized steps in any layout.
            continue
        torch.testing.assert_close(two[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert all(torch.equal(two[k], one[k]) for k in _biases(one))


def test_bf16_run_follows_fp32_and_keeps_the_bias(walk):
    bf16, fp32 = read_metrics(walk / "bf16"), read_metrics(walk / "frozen")
    for a, b in zip(bf16, fp32, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-2)
    source, out = hf_tensors(walk / "hf_in"), hf_tensors(walk / "bf16" / "hf")
    assert all(torch.equal(v.float(), source[k].float()) for k, v in _biases(out).items())


def test_dpo_run_trains_and_keeps_the_bias(walk):
    rows = read_metrics(walk / "dpo")
    assert rows[0]["loss"] == pytest.approx(0.6931472, rel=1e-5)  # policy = reference: log 2
    source, out = hf_tensors(walk / "hf_in"), hf_tensors(walk / "dpo" / "hf")
    assert all(torch.equal(v, source[k]) for k, v in _biases(out).items())
    assert any(not torch.equal(out[k], source[k]) for k in out if "experts" in k)
