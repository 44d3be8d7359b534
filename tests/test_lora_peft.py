"""LoRA adapters against Hugging Face `peft` on the same weights.

Tiny random `transformers` models — Llama with grouped-query attention (4 query heads, 2 KV
heads) and Qwen2 (qkv biases, tied embeddings) — are imported with the conversion code. Adapters
on every projection (q/k/v inside the fused `linear_qkv`, gate/up inside `linear_fc1`, o, down)
get a non-zero B, so they change the logits by O(1). Shown here:

* our model with adapters equals `peft.PeftModel.from_pretrained` on the HF model loading the
  adapter directory we wrote (`hf_peft.write_adapter`), to 1e-5 in the logits — at TP=1, and at
  TP=2 with sequence parallelism, where the adapter was *imported* from that directory
  (`load_adapter` cuts the TP shards of the fused q/k/v and gate/up outputs);
* with the adapters off, the model is bit-identical to the same model built without LoRA, and
  equals `transformers`' base model;
* merging (`merge_and_strip`, fused with the conversion key map's `fuse_qkv` / `fuse_fc1`) gives
  the adapter model's logits;
* import -> export of an adapter directory is bit-exact;
* the same with adapters on some projections of the fused linears only (q, v, up, o);
* at TP=2+SP a frozen copy of the imported adapter (`freeze_starting_adapter_copy`) stays the
  reference (`reference_adapters`) after the trained adapter moves.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from multirank import run_multirank

pytestmark = pytest.mark.multirank

VOCAB, SEQ, BATCH = 100, 16, 2
MODELS = ("llama", "qwen2")
RANK, ALPHA = 4, 8.0
TOLERANCE = 1e-5


def _hf_config(name: str):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
    )
    if name == "qwen2":
        return Qwen2Config(tie_word_embeddings=True, **common)
    return LlamaConfig(**common)


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


#: Some projections of the fused linears only (the others' rows of the output get nothing).
PARTIAL = ["q_proj", "v_proj", "o_proj", "up_proj"]


def _settings(seed: int, targets: tuple[str, ...] = ("all",)):
    from megatron_kto.peft.wiring import LoRASettings

    return LoRASettings(
        rank=RANK,
        alpha=ALPHA,
        target_modules=list(targets),
        init_a="kaiming",
        init_b="normal",
        seed=seed,
    )


def _logits(chunks) -> torch.Tensor:
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_kto.models.builder import unwrap

    model = unwrap(chunks[0])
    model.eval()
    tokens = _tokens()
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    with torch.no_grad():
        logits = model(tokens, positions, None)
        return gather_from_tensor_model_parallel_region(logits)[..., :VOCAB].clone()


def _tp1_worker(rank: int, world_size: int, root: str) -> dict:
    from megatron_kto.checkpointing.model_io import read_architecture
    from megatron_kto.checkpointing.pretrained import restore_pretrained
    from megatron_kto.hf_writer.convert import import_hf
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks
    from megatron_kto.peft import hf_peft
    from megatron_kto.peft.wiring import adapters_disabled, apply_lora
    from megatron_kto.runtime import init_runtime, teardown

    out = {}
    for name in MODELS:
        base = Path(root) / name
        import_hf(base / "hf", base / "mcore")
        arch = read_architecture(base / "mcore")
        rt = init_runtime(1, 1, seed=5)
        plain = build_gpt_chunks(arch, ParallelLayout(), rt.device)
        restore_pretrained(base / "mcore", plain)
        chunks = build_gpt_chunks(arch, ParallelLayout(), rt.device)
        restore_pretrained(base / "mcore", chunks)
        apply_lora(chunks, arch, _settings(seed=7))
        result = {"plain": _logits(plain), "lora": _logits(chunks)}
        with adapters_disabled(chunks):
            result["off"] = _logits(chunks)
        hf_peft.write_adapter(base / "adapter", chunks, _settings(7), arch, str(base / "hf"))
        # Import into a differently initialised adapter, export again.
        other = build_gpt_chunks(arch, ParallelLayout(), rt.device)
        apply_lora(other, arch, _settings(seed=8))
        config, tensors = hf_peft.read_adapter(base / "adapter")
        hf_peft.check_matches(config, _settings(8), arch, "test")
        expected = hf_peft.expected_keys(_settings(8), arch)
        hf_peft.load_adapter(other, tensors, expected, "test")
        hf_peft.write_adapter(base / "adapter_again", other, _settings(8), arch, str(base / "hf"))
        hf_peft.merge_and_strip(chunks, arch)
        result["merged"] = _logits(chunks)
        partial = build_gpt_chunks(arch, ParallelLayout(), rt.device)
        restore_pretrained(base / "mcore", partial)
        apply_lora(partial, arch, _settings(7, PARTIAL))
        result["partial"] = _logits(partial)
        hf_peft.write_adapter(base / "adapter_partial", partial, _settings(7, PARTIAL), arch)
        out[name] = result
        teardown()
    return out


def _tp2_worker(rank: int, world_size: int, root: str) -> dict:
    from megatron_kto.checkpointing.model_io import read_architecture
    from megatron_kto.checkpointing.pretrained import restore_pretrained
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks, unwrap
    from megatron_kto.peft import hf_peft
    from megatron_kto.peft.wiring import (
        adapters_disabled,
        apply_lora,
        freeze_starting_adapter_copy,
        reference_adapters,
    )
    from megatron_kto.runtime import init_runtime, teardown

    out = {}
    rt = init_runtime(2, 1, seed=5)
    for name in MODELS:
        base = Path(root) / name
        arch = read_architecture(base / "mcore")
        layout = ParallelLayout(tensor_model_parallel_size=2, sequence_parallel=True)
        chunks = build_gpt_chunks(arch, layout, rt.device)
        restore_pretrained(base / "mcore", chunks)
        apply_lora(chunks, arch, _settings(seed=9))
        _, tensors = hf_peft.read_adapter(base / "adapter")
        hf_peft.load_adapter(chunks, tensors, hf_peft.expected_keys(_settings(9), arch), "test")
        out[name] = _logits(chunks)
        # Keep the imported adapter as the reference, then move the trained one: the reference
        # context must still compute base + the imported adapter, the adapters-off one the base.
        freeze_starting_adapter_copy(chunks)
        out[name, "ref_keys"] = {
            k: tuple(v.global_shape)
            for k, v in unwrap(chunks[0]).lora.sharded_state_dict().items()
            if ".ref_" in k or ".lora_" in k
        }
        gen = torch.Generator().manual_seed(11)  # same on both ranks: replicated stay equal
        with torch.no_grad():
            for p in unwrap(chunks[0]).lora.parameters():
                p.add_(0.5 * torch.randn(p.shape, generator=gen))
        out[name, "moved"] = _logits(chunks)
        with reference_adapters(chunks):
            out[name, "reference"] = _logits(chunks)
        with adapters_disabled(chunks):
            out[name, "off"] = _logits(chunks)
        out[name, "after"] = _logits(chunks)
        partial = build_gpt_chunks(arch, layout, rt.device)
        restore_pretrained(base / "mcore", partial)
        apply_lora(partial, arch, _settings(9, PARTIAL))
        _, tensors = hf_peft.read_adapter(base / "adapter_partial")
        expected = hf_peft.expected_keys(_settings(9, PARTIAL), arch)
        hf_peft.load_adapter(partial, tensors, expected, "test")
        out[name, "partial"] = _logits(partial)
    teardown()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora_peft")
    for name in MODELS:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_hf_config(name), dtype=torch.float32)
        with torch.no_grad():  # norms away from 1, non-zero biases
            for pname, p in model.named_parameters():
                if "norm" in pname or pname.endswith("bias"):
                    p.add_(0.1 * torch.randn_like(p))
        model.save_pretrained(root / name / "hf")
    tp1 = run_multirank(_tp1_worker, 1, str(root), timeout=300)[0]
    tp2 = run_multirank(_tp2_worker, 2, str(root), timeout=300)
    assert torch.equal(tp2[0]["llama"], tp2[1]["llama"])
    return root, tp1, tp2[0]


def _peft_logits(
    root: Path, name: str, adapter: str = "adapter"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(peft model logits, base model logits) from `transformers` + `peft`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(root / name / "hf", dtype=torch.float32)
    model = PeftModel.from_pretrained(base, root / name / adapter)
    model.eval()
    with torch.no_grad():
        adapted = model(_tokens()).logits
        with model.disable_adapter():
            plain = model(_tokens()).logits
    return adapted, plain


@pytest.mark.parametrize("name", MODELS)
def test_adapters_equal_peft(results, name):
    root, tp1, tp2 = results
    adapted, plain = _peft_logits(root, name)
    effect = (adapted - plain).abs().max().item()
    diffs = {
        "tp1": (tp1[name]["lora"] - adapted).abs().max().item(),
        "tp2_sp_imported": (tp2[name] - adapted).abs().max().item(),
        "merged": (tp1[name]["merged"] - adapted).abs().max().item(),
    }
    print(f"{name}: adapters move logits by {effect:.3f}; max|Δ| vs peft {diffs}")
    assert effect > 0.1  # the comparison is not vacuous
    assert all(d <= TOLERANCE for d in diffs.values()), diffs


@pytest.mark.parametrize("name", MODELS)
def test_partial_targets_equal_peft(results, name):
    """q and v of the fused qkv, up of the fused gate/up, and o: TP=1 and TP=2+SP."""
    root, tp1, tp2 = results
    adapted, plain = _peft_logits(root, name, "adapter_partial")
    diffs = [(x - adapted).abs().max().item() for x in (tp1[name]["partial"], tp2[name, "partial"])]
    print(f"{name} partial: effect {(adapted - plain).abs().max():.3f}, max|Δ| vs peft {diffs}")
    assert (adapted - plain).abs().max().item() > 0.1
    assert max(diffs) <= TOLERANCE
    config = json.loads((root / name / "adapter_partial" / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(PARTIAL)


@pytest.mark.parametrize("name", MODELS)
def test_adapters_off_is_the_base_model(results, name):
    root, tp1, _ = results
    _, plain = _peft_logits(root, name)
    assert torch.equal(tp1[name]["off"], tp1[name]["plain"])
    assert (tp1[name]["off"] - plain).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("name", MODELS)
def test_frozen_starting_adapter_is_the_reference_under_tp2_sp(results, name):
    """After the trained adapter moved, `reference_adapters` computes base + the imported
    adapter (peft's logits, and bit for bit our logits before the move); adapters off is still
    the base; the frozen copy is checkpointed with the trained pair's global shapes."""
    root, _, tp2 = results
    adapted, plain = _peft_logits(root, name)
    moved, reference = tp2[name, "moved"], tp2[name, "reference"]
    print(f"{name}: moved adapter shifts logits by {(moved - adapted).abs().max():.3f}")
    assert (moved - adapted).abs().max().item() > 0.1
    assert torch.equal(reference, tp2[name])
    assert (reference - adapted).abs().max().item() <= TOLERANCE
    assert (tp2[name, "off"] - plain).abs().max().item() <= TOLERANCE
    assert torch.equal(tp2[name, "after"], moved)  # the contexts restore the policy
    keys = tp2[name, "ref_keys"]
    trained = {k: v for k, v in keys.items() if ".lora_" in k}
    assert trained and len(keys) == 2 * len(trained)
    assert all(keys[k.replace(".lora_", ".ref_")] == v for k, v in trained.items())


@pytest.mark.parametrize("name", MODELS)
def test_import_then_export_is_bit_exact(results, name):
    from safetensors.torch import load_file

    root = results[0] / name
    first = load_file(str(root / "adapter" / "adapter_model.safetensors"))
    again = load_file(str(root / "adapter_again" / "adapter_model.safetensors"))
    assert first.keys() == again.keys() and len(first) == 2 * 7 * 2  # A, B x 7 projections x 2
    assert all(torch.equal(first[k], again[k]) for k in first)
    config = json.loads((root / "adapter" / "adapter_config.json").read_text())
    assert config == json.loads((root / "adapter_again" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (RANK, ALPHA)
