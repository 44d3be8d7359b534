"""LoRA on hybrid models (Qwen3-Next, Qwen3.5) against Hugging Face `peft` on the same weights.

Tiny random `qwen3_next` (MoE + one dense layer; DeltaNet `in_proj_qkvz` / `in_proj_ba`) and
`qwen3_5_text` (dense; `in_proj_qkv` / `in_proj_z` / `in_proj_b` / `in_proj_a`), both layer kinds
(`test_hybrid_families._hf_configs`), get adapters with a non-zero B on the DeltaNet projections
(`in_proj_*`, `out_proj`) and the gated full attention (`q_proj` = query + output gate per head,
`k_proj`, `v_proj`, `o_proj`), Qwen3.5 also on its MLP. In ONE 2-rank run (rank 0 first alone at
TP=1, then both at TP=2 with sequence parallelism), shown here:

* the adapter we write (`hf_peft.write_adapter`) loads in `peft` (`PeftModel.from_pretrained` on
  the `transformers` model), whose logits equal ours (≤ 1e-5 relative) — so the fused layouts
  (megatron's per-group [queries | gates | k | v], DeltaNet's [q | k | v | z | beta | alpha] per
  rank) put every adapter row where the base row is;
* merging (`merge_and_strip`) gives the same logits; adapters off give the base model's;
* adapters on some projections of the fused linears only (no `k_proj`, no `in_proj_a`) equal
  peft too;
* at TP=2 + SP the adapter directory is *imported* (`load_adapter` cuts each rank's rows) and the
  logits equal peft's, Qwen3.5's `in_proj_qkv` included (its q, k and v are three row blocks per
  rank: the forward gathers B and takes the rank's blocks); written again at TP=2 it equals the
  TP=1 export bit for bit. Qwen3.5's full adapter (every projection) built at TP=2 + SP from the
  same seed gives the TP=1 logits, the same export and the same gradient of `in_proj_qkv`'s B.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from multirank import run_multirank, solo_world
from test_hybrid_families import _hf_configs, _tokens
from test_lora_peft import ALPHA, RANK, _settings

pytestmark = pytest.mark.multirank

VOCAB = 100
TOLERANCE = 1e-5
#: name -> (targets at TP=1, targets of the partial adapter, also loaded at TP=2)
TARGETS = {
    "qwen3_next": (("attention",), ("q_proj", "v_proj", "in_proj_ba", "out_proj")),
    "qwen3_5_text": (
        ("all",),
        ("q_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "out_proj")
        + ("up_proj",),
    ),
}


def _logits(chunks) -> torch.Tensor:
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_kto.models.builder import unwrap

    model = unwrap(chunks[0])
    model.eval()
    tokens = _tokens()
    positions = torch.arange(tokens.shape[1]).expand(*tokens.shape)
    with torch.no_grad():
        logits = model(tokens, positions, None)
        return gather_from_tensor_model_parallel_region(logits)[..., :VOCAB].clone()


def _qkv_b_grads(chunks) -> dict[str, torch.Tensor]:
    """The gradient of every `in_proj_qkv` B (whole) of a fixed random projection of the logits."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_kto.models.builder import unwrap
    from megatron_kto.peft.hf_peft import full_pair
    from megatron_kto.peft.wiring import adapters_of

    model = unwrap(chunks[0])
    model.eval()
    tokens = _tokens()
    positions = torch.arange(tokens.shape[1]).expand(*tokens.shape)
    logits = gather_from_tensor_model_parallel_region(model(tokens, positions, None))[..., :VOCAB]
    weight = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3))
    (logits * weight).sum().backward()
    out = {}
    for adapter in adapters_of(chunks):
        if "in_proj_qkv" in adapter.names:
            b = adapter.adapters["in_proj_qkv"].lora_B
            b.data, b.grad = b.grad, None  # gathered as B would be
            out[adapter.key] = full_pair(adapter, "in_proj_qkv")[1].clone()
    return out


def _model(base: Path, layout, rt):
    from megatron_kto.checkpointing.model_io import read_architecture
    from megatron_kto.checkpointing.pretrained import restore_pretrained
    from megatron_kto.models.builder import build_gpt_chunks

    arch = read_architecture(base / "mcore")
    chunks = build_gpt_chunks(arch, layout, rt.device)
    restore_pretrained(base / "mcore", chunks)
    return arch, chunks


def _tp1(root: Path) -> dict:
    from megatron_kto.models.builder import ParallelLayout
    from megatron_kto.peft import hf_peft
    from megatron_kto.peft.wiring import adapters_disabled, apply_lora
    from megatron_kto.runtime import init_runtime, teardown

    out = {}
    rt = init_runtime(1, 1, seed=5)
    for name, (full, partial) in TARGETS.items():
        base = root / name
        arch, plain = _model(base, ParallelLayout(), rt)
        out[name, "plain"] = _logits(plain)
        for label, targets in (("full", full), ("partial", partial)):
            arch, chunks = _model(base, ParallelLayout(), rt)
            apply_lora(chunks, arch, _settings(7, targets))
            out[name, label] = _logits(chunks)
            hf_peft.write_adapter(base / label, chunks, _settings(7, targets), arch, str(base))
            if label == "full":
                if name == "qwen3_5_text":
                    _, again = _model(base, ParallelLayout(), rt)
                    apply_lora(again, arch, _settings(7, targets))
                    out[name, "qkv_grads"] = _qkv_b_grads(again)
                with adapters_disabled(chunks):
                    out[name, "off"] = _logits(chunks)
                hf_peft.merge_and_strip(chunks, arch)
                out[name, "merged"] = _logits(chunks)
    teardown()
    return out


def _worker(rank: int, world_size: int, root: str) -> dict:
    from megatron_kto.models.builder import ParallelLayout
    from megatron_kto.peft import hf_peft
    from megatron_kto.peft.wiring import apply_lora
    from megatron_kto.runtime import init_runtime, teardown

    out = {}
    if rank == 0:  # TP=1 alone, before the 2-rank world (rank 1 waits in its rendezvous)
        with solo_world():
            out = _tp1(Path(root))
    rt = init_runtime(2, 1, seed=5)
    layout = ParallelLayout(tensor_model_parallel_size=2, sequence_parallel=True)
    for name, (full, partial) in TARGETS.items():
        base = Path(root) / name
        arch, chunks = _model(base, layout, rt)
        settings = _settings(9, partial)
        apply_lora(chunks, arch, settings)
        config, tensors = hf_peft.read_adapter(base / "partial")
        hf_peft.check_matches(config, settings, arch, "test")
        hf_peft.load_adapter(chunks, tensors, hf_peft.expected_keys(settings, arch), "test")
        out[name, "tp2sp"] = _logits(chunks)
        hf_peft.write_adapter(base / "partial_tp2", chunks, settings, arch, str(base))
        if name == "qwen3_5_text":
            _, again = _model(base, layout, rt)
            apply_lora(again, arch, _settings(7, full))
            out[name, "full_tp2sp"] = _logits(again)
            hf_peft.write_adapter(base / "full_tp2", again, _settings(7, full), arch, str(base))
            out[name, "qkv_grads_tp2sp"] = _qkv_b_grads(again)
    teardown()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from megatron_kto.hf_writer.convert import import_hf

    root = tmp_path_factory.mktemp("hybrid_lora")
    configs = _hf_configs()
    for name in TARGETS:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(configs[name], dtype=torch.float32)
        with torch.no_grad():  # norms away from their init, decisive routers
            for pname, p in model.named_parameters():
                if "norm" in pname or pname.endswith("dt_bias"):
                    p.add_(0.1 * torch.randn_like(p))
                elif pname.endswith("gate.weight"):
                    p.normal_(0.0, 1.0)
        model.save_pretrained(root / name)
        import_hf(root / name, root / name / "mcore")
    ranks = run_multirank(_worker, 2, str(root), timeout=600)
    assert torch.equal(ranks[0]["qwen3_5_text", "tp2sp"], ranks[1]["qwen3_5_text", "tp2sp"])
    return root, ranks[0]


def _peft_logits(root: Path, name: str, adapter: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(peft model logits, base model logits) from `transformers` + `peft`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(root / name, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, root / name / adapter).eval()
    with torch.no_grad():
        adapted = model(_tokens()).logits
        with model.disable_adapter():
            plain = model(_tokens()).logits
    return adapted, plain


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("name", TARGETS)
def test_adapters_equal_peft(results, name):
    root, out = results
    adapted, plain = _peft_logits(root, name, "full")
    effect = (adapted - plain).abs().max().item()
    diffs = {
        "tp1": _rel(out[name, "full"], adapted),
        "merged": _rel(out[name, "merged"], adapted),
        "off_vs_base": _rel(out[name, "off"], plain),
        "log_probs_tp1": _rel(out[name, "full"].log_softmax(-1), adapted.float().log_softmax(-1)),
    }
    print(f"{name}: adapters move logits by {effect:.3f}; relative |Δ| vs peft {diffs}")
    assert effect > 0.1  # the comparison is not vacuous
    assert all(d <= TOLERANCE for d in diffs.values()), diffs
    assert torch.equal(out[name, "off"], out[name, "plain"])
    from safetensors.torch import load_file

    config = json.loads((root / name / "full" / "adapter_config.json").read_text())
    keys = load_file(str(root / name / "full" / "adapter_model.safetensors"))
    assert all(any(kind in key for key in keys) for kind in ("linear_attn.", "self_attn."))
    assert (config["r"], config["lora_alpha"]) == (RANK, ALPHA)


@pytest.mark.parametrize("name", TARGETS)
def test_partial_targets_and_tp2_import_equal_peft(results, name):
    root, out = results
    adapted, plain = _peft_logits(root, name, "partial")
    diffs = {"tp1": _rel(out[name, "partial"], adapted), "tp2sp": _rel(out[name, "tp2sp"], adapted)}
    print(f"{name} partial: effect {(adapted - plain).abs().max():.3f}, relative |Δ| {diffs}")
    assert (adapted - plain).abs().max().item() > 0.1
    assert max(diffs.values()) <= TOLERANCE, diffs
    config = json.loads((root / name / "partial" / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(TARGETS[name][1])


def _adapter_files(directory: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    config = json.loads((directory / "adapter_config.json").read_text())
    return config, load_file(str(directory / "adapter_model.safetensors"))


@pytest.mark.parametrize("name", TARGETS)
def test_tp2_export_equals_tp1_export(results, name):
    root, _ = results
    labels = (("partial", "partial_tp2"), ("full", "full_tp2"))
    for tp1, tp2 in labels if name == "qwen3_5_text" else labels[:1]:
        (config, ref), (config2, tensors) = (
            _adapter_files(root / name / tp1),
            _adapter_files(root / name / tp2),
        )
        assert config2 == config and tensors.keys() == ref.keys()
        assert all(torch.equal(tensors[k], ref[k]) for k in ref), tp2
        if name == "qwen3_5_text":
            assert any("in_proj_qkv.lora_B" in k and ref[k].abs().max() > 0 for k in ref)


def test_in_proj_qkv_full_adapter_at_tp2_equals_tp1(results):
    root, out = results
    adapted, _ = _peft_logits(root, "qwen3_5_text", "full")
    diffs = {
        "tp2sp_vs_tp1": _rel(out["qwen3_5_text", "full_tp2sp"], out["qwen3_5_text", "full"]),
        "tp2sp_vs_peft": _rel(out["qwen3_5_text", "full_tp2sp"], adapted),
    }
    grads, grads_tp2 = out["qwen3_5_text", "qkv_grads"], out["qwen3_5_text", "qkv_grads_tp2sp"]
    assert grads and grads.keys() == grads_tp2.keys()
    diffs["grad_B"] = max(_rel(grads_tp2[k], grads[k]) for k in grads)
    print(f"qwen3_5_text full adapter at TP2+SP: relative |Δ| {diffs}")
    assert all(g.abs().max() > 0 for g in grads.values())
    assert max(diffs.values()) <= TOLERANCE, diffs
