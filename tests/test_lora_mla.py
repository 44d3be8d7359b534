"""LoRA on multi-latent attention (DeepSeek-V3) against `peft` on `transformers`'
DeepseekV3ForCausalLM.

The tiny random models of `test_deepseek_v3.py` — `qlora` (query bottleneck: q_a_proj, q_b_proj)
and `plain` (q_proj) — get a `peft` adapter on every attention projection by its Hugging Face
name, with a non-zero B (the adapter changes the log-probs by O(1)). Our model is loaded
straight from the Hugging Face directory and the adapter imported from the `peft` directory
(`hf_peft.load_adapter`; the `qlora` run names its targets `attention`, NeMo's name, the `plain`
run by their Hugging Face names). Shown here:

* log-probs equal `peft`'s within 1e-5 relative at TP=1 and at TP=2 with sequence parallelism
  (the adapter's B split like the base's output rows; `kv_a_proj_with_mqa`'s term added before
  `models/mla.py` gathers that linear's output over TP);
* every adapter gradient of a DPO-shaped loss at TP=2 x SP equals TP=1's within 1e-5 relative —
  the rotated key's gradient is summed over TP for the adapter's rows as for the base's;
* our exported adapter directory (TP=1, and gathered at TP=2) is the imported one bit for bit;
  merging it into the base weights (`merge_and_strip`) gives the adapter model's log-probs;
* the memory plan's adapter parameters are the built ones; a projection the model lacks
  (q_a_proj without q_lora_rank) is refused in one line naming the key.

The KTO trajectory with LoRA against TRL 1.16 + `peft`, and a run's `hf/` adapter and
`hf_merged/` output: `test_lora_mla_trl_parity.py`.
"""

from __future__ import annotations

from pathlib import Path

import family_parity as fp
import pytest
import torch
from multirank import run_multirank
from test_deepseek_v3 import MLA_RUN, MODELS, _grad_errors, _hf_configs, _loss_grads

RANK, ALPHA = 4, 8.0
#: Every attention projection of each model, by its Hugging Face name.
PROJECTIONS = {
    "qlora": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
    "plain": ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
}
#: What our runs name as targets: NeMo's name for one model, the Hugging Face names for the other.
RUN_TARGETS = {"qlora": ["attention"], "plain": PROJECTIONS["plain"]}


def _settings(name: str):
    from megatron_kto.peft.wiring import LoRASettings

    # A different init than the adapter's: only the import can match peft.
    return LoRASettings(rank=RANK, alpha=ALPHA, target_modules=RUN_TARGETS[name], init_b="normal")


def _with_adapter(root: Path, name: str, tp: int, rt) -> tuple:
    """The model of `name` straight from its HF directory, with the peft adapter imported."""
    from megatron_kto.peft import hf_peft
    from megatron_kto.peft.wiring import apply_lora

    base = root / name
    arch, chunks = fp.restore_and_run(base / "hf", fp.Layout(tp=tp, sp=tp > 1), rt)
    settings = _settings(name)
    apply_lora(chunks, arch, settings)
    config, tensors = hf_peft.read_adapter(base / "adapter")
    hf_peft.check_matches(config, settings, arch, "test")
    hf_peft.load_adapter(chunks, tensors, hf_peft.expected_keys(settings, arch), "test")
    return arch, chunks, settings


def _tp1_worker(rank: int, world_size: int, root: str) -> dict:
    from megatron_kto.peft import hf_peft
    from megatron_kto.runtime import init_runtime, teardown

    out = {}
    for name in MODELS:
        base = Path(root) / name
        rt = init_runtime(1, 1, seed=9)
        arch, chunks, settings = _with_adapter(Path(root), name, 1, rt)
        out["tp1", name] = fp.forward(arch, chunks)[0]
        hf_peft.write_adapter(base / "export_tp1", chunks, settings, arch, str(base / "hf"))
        torch.save(_loss_grads(arch, chunks[0]), base / "tp1_grads.pt")
        hf_peft.merge_and_strip(chunks, arch)
        out["merged", name] = fp.forward(arch, chunks)[0]
        teardown()
    return out


def _tp2_worker(rank: int, world_size: int, root: str) -> dict:
    from megatron_kto.models.builder import unwrap
    from megatron_kto.peft import hf_peft
    from megatron_kto.planning.model_state import LoRAShape, ParallelDims, chunk_parameters
    from megatron_kto.runtime import init_runtime, teardown

    out = {}
    rt = init_runtime(2, 1, seed=9)
    for name in MODELS:
        base = Path(root) / name
        arch, chunks, settings = _with_adapter(Path(root), name, 2, rt)
        out["tp2", name] = fp.forward(arch, chunks)[0]
        hf_peft.write_adapter(base / "export_tp2", chunks, settings, arch, str(base / "hf"))
        lora = LoRAShape(RANK, tuple(RUN_TARGETS[name]))
        plan = chunk_parameters(arch, ParallelDims(tp=2, dp=1, sequence_parallel=True), 0, 0, lora)
        built = unwrap(chunks[0]).named_parameters()
        out["plan", name] = (
            [(p.name, p.numel) for p in plan if p.name.startswith("lora.")],
            [(n, p.numel()) for n, p in built if n.startswith("lora.")],
        )
        want = torch.load(base / "tp1_grads.pt", weights_only=True)
        out["grads", name] = _grad_errors(_loss_grads(arch, chunks[0]), want, arch, chunks[0])
    teardown()
    return out


def _peft_adapter(root: Path, name: str) -> torch.Tensor:
    """A peft adapter with a non-zero B on every attention projection of `root/name/hf`, saved to
    `root/name/adapter`; returns the peft model's log-probs of `fp.tokens()`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(root / name / "hf", dtype=torch.float32)
    config = LoraConfig(
        r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=PROJECTIONS[name]
    )
    model = get_peft_model(base, config).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "lora_B" in pname:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
        logits = model(fp.tokens()).logits.float()
    model.save_pretrained(root / name / "adapter")
    return fp.reference_logprobs(logits)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("lora_mla")
    reference = fp.sigmoid_moe_references(root, _hf_configs())
    peft = {name: _peft_adapter(root, name) for name in MODELS}
    out = run_multirank(_tp1_worker, 1, str(root), timeout=300)[0]
    ranks = run_multirank(_tp2_worker, 2, str(root), timeout=300)
    out.update(ranks[0])
    out["grads_rank1"] = {name: ranks[1]["grads", name] for name in MODELS}
    base = {name: fp.reference_logprobs(reference[name]["logits"]) for name in MODELS}
    return root, peft, base, out


def _relative(ours: torch.Tensor, want: torch.Tensor) -> float:
    return ((ours - want).abs() / want.abs().clamp(min=1.0)).max().item()


@pytest.mark.parametrize("layout", ["tp1", "tp2", "merged"])
@pytest.mark.parametrize("name", MODELS)
def test_logprobs_with_the_adapter_equal_peft(results, name, layout):
    _, peft, base, out = results
    assert (peft[name] - base[name]).abs().max() > 0.1  # the adapter matters
    error = _relative(out[layout, name], peft[name])
    print(f"\n{name} {layout}: relative error vs peft {error:.1e}")
    assert error <= fp.RELATIVE


@pytest.mark.parametrize("name", MODELS)
def test_tensor_parallel_adapter_gradients_equal_tp1(results, name):
    """Every adapter gradient at TP=2 x SP (both ranks' shards) equals TP=1's."""
    _, _, _, out = results
    for errors in (out["grads", name], out["grads_rank1"][name]):
        assert errors and all(".lora_" in n for n in errors)
        assert any("kv_a_proj_with_mqa.lora_B" in n for n in errors)
        worst = max(errors, key=errors.get)
        print(f"\n{name}: worst adapter gradient error {errors[worst]:.1e} ({worst})")
        assert errors[worst] < fp.RELATIVE, (worst, errors[worst])


@pytest.mark.parametrize("layout", ["export_tp1", "export_tp2"])
@pytest.mark.parametrize("name", MODELS)
def test_exported_adapter_is_the_imported_one(results, name, layout):
    from megatron_kto.peft.hf_peft import read_adapter

    root = results[0]
    config, ours = read_adapter(root / name / layout)
    _, source = read_adapter(root / name / "adapter")
    assert sorted(config["target_modules"]) == sorted(PROJECTIONS[name])
    layers = _hf_configs()[name].num_hidden_layers
    assert ours.keys() == source.keys() and len(ours) == 2 * len(PROJECTIONS[name]) * layers
    assert all(torch.equal(ours[k], source[k]) for k in source)


@pytest.mark.parametrize("name", MODELS)
def test_memory_plan_counts_the_built_adapters(results, name):
    planned, built = results[3]["plan", name]
    assert planned == built and planned


def test_a_projection_the_model_lacks_is_refused_in_one_line():
    from megatron_kto.config.schema import register
    from megatron_kto.config.validate import ConfigError
    from megatron_kto.entry import compose_run_config

    register()
    plain = [*MLA_RUN, "model.peft.peft_scheme=lora"]
    targets = "model.peft.lora_tuning.target_modules"
    compose_run_config(
        "gpt_kto", [*plain, f"{targets}=[q_proj,kv_b_proj,o_proj]"], "kto", world_size=1
    )
    with pytest.raises(ConfigError) as e:
        compose_run_config("gpt_kto", [*plain, f"{targets}=[q_a_proj]"], "kto", world_size=1)
    text = str(e.value)
    assert text.startswith(f"{targets}: 'q_a_proj': this architecture has no such projection")
    assert "q_lora_rank None" in text and "\n" not in text


def test_targets_resolve_to_the_mla_linears():
    from megatron_kto.conversion.hf_config import architecture_from_hf
    from megatron_kto.peft.targets import resolve_targets

    qlora = architecture_from_hf(_hf_configs()["qlora"].to_dict())
    plain = architecture_from_hf(_hf_configs()["plain"].to_dict())
    attention = [(t.linear, t.projections, t.column) for t in resolve_targets(["attention"], qlora)]
    assert attention == [
        ("self_attention.linear_q_down_proj", ("q_a_proj",), True),
        ("self_attention.linear_q_up_proj", ("q_b_proj",), True),
        ("self_attention.linear_kv_down_proj", ("kv_a_proj_with_mqa",), True),
        ("self_attention.linear_kv_up_proj", ("kv_b_proj",), True),
        ("self_attention.linear_proj", ("o_proj",), False),
    ]
    qkv = [t.projections[0] for t in resolve_targets(["attention_qkv"], plain)]
    assert qkv == ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj"]
    dense = [t.linear for t in resolve_targets(["attention_dense"], plain)]
    assert dense == ["self_attention.linear_proj"]


def test_all_adapts_the_dense_mlp_and_refuses_the_experts():
    """`all` on an MLA model: its attention projections plus a dense MLP's; on a model with
    routed experts the MLP part is refused (as for every MoE family), naming its projections."""
    import dataclasses

    from megatron_kto.conversion.hf_config import architecture_from_hf
    from megatron_kto.peft.targets import check_moe_targets, resolve_targets

    moe = architecture_from_hf(_hf_configs()["plain"].to_dict())
    dense = dataclasses.replace(moe, num_moe_experts=None, moe_layer_freq=None)
    everything = [p for t in resolve_targets(["all"], dense) for p in t.projections]
    assert everything == [*PROJECTIONS["plain"], "gate_proj", "up_proj", "down_proj"]
    check_moe_targets(["all"], dense)
    check_moe_targets(["attention"], moe)
    with pytest.raises(ValueError, match=r"or q_proj/kv_a_proj_with_mqa/kv_b_proj/o_proj\)$"):
        check_moe_targets(["all"], moe)
