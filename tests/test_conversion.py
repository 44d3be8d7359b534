"""Hugging Face <-> megatron_kto conversion, checked against `transformers` itself.

Tiny random `transformers` models — Llama with GQA and Llama-3 RoPE scaling, Mistral, Qwen2 with
qkv biases and tied embeddings; vocabulary 100, so the megatron embedding is padded — are saved
with `save_pretrained`, imported and exported. Shown here:

* the key map's fusions are exact inverses and put each head where megatron expects it;
* the converted model's logits (TP=1) and per-token log-probs (TP=1, TP=2, PP=2, through
  megatron-core's schedules) equal `transformers`' to 1e-4;
* HF -> megatron -> HF is bit-exact, and the export loads in `transformers`;
* the CLI turns bad input into one `error:` line and exit code 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from multirank import run_multirank

from megatron_kto.conversion.hf_config import (
    ConversionError,
    architecture_from_hf,
    hf_config_from_architecture,
)
from megatron_kto.conversion.keymap import fuse_fc1, fuse_qkv, split_fc1, split_qkv

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "convert_checkpoint.py"
VOCAB, SEQ, BATCH = 100, 24, 4
TOLERANCE = 1e-4


def _hf_models() -> dict[str, object]:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
    )
    return {
        "llama3": LlamaConfig(
            num_key_value_heads=2,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            **common,
        ),
        "mistral": MistralConfig(num_key_value_heads=1, sliding_window=None, **common),
        "qwen2": Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **common),
    }


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens, torch.arange(SEQ).expand(BATCH, SEQ).clone()


def _hf_logits(model_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, torch_dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    tokens, _ = _batch()
    with torch.no_grad():
        return model(tokens).logits.float()


def _token_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """log π(token_{t+1}) at every position t < T-1 (the same labels megatron's side uses)."""
    tokens, _ = _batch()
    logp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
    return logp.gather(-1, tokens[:, 1:, None])[..., 0].float()


# ------------------------------------------------------------------------------- pure key map


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
    g = groups - 1
    assert torch.equal(fused[g * block : g * block + per * d], q[g * per * d : (g + 1) * per * d])
    assert torch.equal(
        fused[g * block + per * d : g * block + (per + 1) * d], k[g * d : (g + 1) * d]
    )
    assert torch.equal(fused[(g + 1) * block - d : (g + 1) * block], v[g * d : (g + 1) * d])
    bias = fuse_qkv(q[:, 0], k[:, 0], v[:, 0], heads, groups)  # biases fuse the same way
    assert torch.equal(bias, fused[:, 0])


def test_fc1_fusion_is_gate_then_up():
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    fused = fuse_fc1(gate, up)
    assert torch.equal(fused[:6], gate)
    assert all(torch.equal(a, b) for a, b in zip(split_fc1(fused), (gate, up), strict=True))


@pytest.mark.parametrize("name", ["llama3", "mistral", "qwen2"])
def test_config_round_trip(name):
    config = _hf_models()[name].to_dict()
    arch = architecture_from_hf(config)
    back = hf_config_from_architecture(arch, config["model_type"], config)
    assert architecture_from_hf(back) == arch
    assert arch.add_qkv_bias == (name == "qwen2")
    assert arch.share_embeddings_and_output_weights == (name == "qwen2")
    assert arch.rope_scaling == (name == "llama3")


@pytest.mark.parametrize(
    "change,field",
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"num_attention_heads": "4"}, "num_attention_heads"),
    ],
)
def test_unsupported_configs_are_named(change, field):
    config = {**_hf_models()["llama3"].to_dict(), **change}
    config.pop("rope_parameters", None) if field == "rope_scaling" else None
    with pytest.raises(ConversionError, match=field):
        architecture_from_hf(config, "x/config.json")


# ------------------------------------------------------------------ conversion vs transformers


def _convert_worker(rank: int, world_size: int, root: str) -> dict:
    """Import every model, run the TP=1 model on the batch, export it again."""
    from megatron_kto.checkpointing.model_io import read_architecture
    from megatron_kto.checkpointing.pretrained import restore_pretrained
    from megatron_kto.conversion.convert import export_hf, import_hf
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks
    from megatron_kto.runtime import init_runtime, teardown

    out = {}
    tokens, positions = _batch()
    for name in _hf_models():
        base = Path(root) / name
        import_hf(base / "hf", base / "mcore")
        arch = read_architecture(base / "mcore")
        rt = init_runtime(1, 1, seed=9)  # a different init: only the checkpoint can match
        (model,) = build_gpt_chunks(arch, ParallelLayout(), rt.device)
        restore_pretrained(base / "mcore", [model])
        model.eval()
        with torch.no_grad():
            out[name] = {"logits": model(tokens, positions, None), "arch": arch.to_dict()}
        teardown()
        export_hf(base / "mcore", base / "export")
    return out


def _layout_worker(rank: int, world_size: int, root: str, tp: int, pp: int) -> dict:
    """Per-token log-probs of each converted model under TP x PP, through megatron's schedule."""
    from megatron.core import parallel_state

    from megatron_kto.checkpointing.model_io import read_architecture
    from megatron_kto.checkpointing.pretrained import restore_pretrained
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks
    from megatron_kto.models.forward import eval_mode, gpt_forward_step
    from megatron_kto.models.logprobs import token_logprobs
    from megatron_kto.models.schedule import broadcast_from_last_stage, run_schedule
    from megatron_kto.runtime import init_runtime, teardown

    tokens, positions = _batch()
    labels = torch.cat([tokens[:, 1:], torch.full((BATCH, 1), -100)], dim=1)
    out = {}
    for name in ("llama3", "qwen2"):
        ckpt = Path(root) / name / "mcore"
        arch = read_architecture(ckpt)
        rt = init_runtime(tp, pp, seed=9)
        layout = ParallelLayout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        chunks = build_gpt_chunks(arch, layout, rt.device)
        restore_pretrained(ckpt, chunks)
        micro = [
            {
                "tokens": tokens[i : i + 2],
                "labels": labels[i : i + 2],
                "position_ids": positions[i : i + 2],
            }
            for i in range(0, BATCH, 2)
        ]
        step = gpt_forward_step(lambda b, o, v=arch.vocab_size: token_logprobs(o, b["labels"], v))
        with torch.no_grad(), eval_mode(chunks):
            results = run_schedule(
                chunks, micro, step, forward_only=True, collect_non_loss_data=True
            )
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        local = torch.cat(results) if last else None
        out[name] = broadcast_from_last_stage(local, (BATCH, SEQ), torch.float32, rt.device)[:, :-1]
    teardown()
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("conversion")
    from transformers import AutoModelForCausalLM

    reference = {}
    for name, config in _hf_models().items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
        with torch.no_grad():  # norms away from 1 and non-zero biases: every tensor matters
            for pname, p in model.named_parameters():
                if "norm" in pname or pname.endswith("bias"):
                    p.add_(0.1 * torch.randn_like(p))
        model.save_pretrained(root / name / "hf")
        (root / name / "hf" / "tokenizer_config.json").write_text("{}")  # copied both ways
        reference[name] = _hf_logits(root / name / "hf")
    megatron = run_multirank(_convert_worker, 1, str(root), timeout=300)[0]
    layouts = {
        "tp2": run_multirank(_layout_worker, 2, str(root), 2, 1, timeout=300),
        "pp2": run_multirank(_layout_worker, 2, str(root), 1, 2, timeout=300),
    }
    return root, reference, megatron, layouts


@pytest.mark.parametrize("name", ["llama3", "mistral", "qwen2"])
def test_tp1_logits_equal_transformers(converted, name):
    _, reference, megatron, _ = converted
    got = megatron[name]["logits"]
    assert got.shape[-1] >= VOCAB  # padded vocabulary
    assert (got[..., :VOCAB] - reference[name]).abs().max() <= TOLERANCE
    from megatron_kto.models.logprobs import token_logprobs
    from megatron_kto.runtime import init_runtime, teardown

    init_runtime(1, 1, seed=0)
    try:
        tokens, _ = _batch()
        labels = torch.cat([tokens[:, 1:], torch.full((BATCH, 1), -100)], dim=1)
        logp = token_logprobs(got.clone(), labels, VOCAB)[:, :-1]
    finally:
        teardown()
    assert (logp - _token_logprobs(reference[name])).abs().max() <= TOLERANCE


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
@pytest.mark.parametrize("name", ["llama3", "qwen2"])
def test_parallel_logprobs_equal_transformers(converted, layout, name):
    _, reference, _, layouts = converted
    want = _token_logprobs(reference[name])
    for rank_result in layouts[layout]:
        assert (rank_result[name] - want).abs().max() <= TOLERANCE


@pytest.mark.parametrize("name", ["llama3", "mistral", "qwen2"])
def test_round_trip_is_bit_exact_and_loads_in_transformers(converted, name):
    from safetensors.torch import load_file

    root, reference, _, _ = converted
    original = load_file(root / name / "hf" / "model.safetensors")
    exported = load_file(root / name / "export" / "model.safetensors")
    assert exported.keys() == original.keys()
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor), key
    config = json.loads((root / name / "export" / "config.json").read_text())
    assert config["model_type"] == _hf_models()[name].model_type
    assert (root / name / "export" / "tokenizer_config.json").is_file()
    assert torch.equal(_hf_logits(root / name / "export"), reference[name])


# ---------------------------------------------------------------------------------------- CLI


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=120, cwd=REPO
    )


def test_cli_bad_input_is_one_error_line(converted, tmp_path):
    root = converted[0]
    empty = tmp_path / "empty"
    empty.mkdir()
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text((root / "llama3" / "hf" / "config.json").read_text())
    data = (root / "llama3" / "hf" / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(data[: len(data) // 2])
    cases = {
        empty: "config.json: not found",
        gpt2: "model_type 'gpt2' is not supported",
        corrupt: "model.safetensors",
    }
    for src, expected in cases.items():
        proc = _cli("import", "--hf-dir", str(src), "--out", str(tmp_path / f"{src.name}_out"))
        lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert len(lines) == 1 and expected in lines[0], proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
        assert not (tmp_path / f"{src.name}_out").exists()
        assert not (tmp_path / f"{src.name}_out.tmp").exists()
