"""Hugging Face <-> megatron_kto conversion, checked against `transformers` itself.

Tiny random `transformers` models — Llama with GQA and Llama-3 RoPE scaling, Mistral (one KV
head, a sliding window of 8 in every layer), Qwen2 with qkv biases, tied embeddings and a
window of 6 in its second layer only (`layer_types`); rows of 24 tokens, longer than the
windows; Gemma 3 (`gemma3_text`: 4 layers alternating sliding window 6 / full attention, a
local and a global RoPE base with linear scaling on the global layers, head dim 32 != hidden /
heads, query_pre_attn_scalar 24, (1 + w) pre-, post- and Q/K norms, GeGLU, scaled tied
embeddings); vocabulary 100, so the megatron embedding is padded — are saved with `save_pretrained`, imported and exported. Shown here:

* the converted model's full logits (TP=1; TP=2 gathered; PP=2 from the last stage) and its
  per-token log-probs through megatron-core's schedule equal `transformers`' to 1e-4;
* HF -> megatron -> HF is bit-exact, also through a sharded (index) export, and the export loads
  in `transformers` with identical logits; tokenizer files travel both ways;
* bf16 import and export store exactly the bf16-rounded weights;
* a multimodal `gemma3` checkpoint (`Gemma3ForConditionalGeneration`, a tiny vision tower) is
  read as its language model (imported, or loaded straight from the directory): its logits equal
  `transformers`' on text, and it exports as a
  `gemma3_text` directory without the vision tower that loads with the same logits;
* the CLI turns bad input into one `error:` line and exit code 2.

Process spawns are grouped: one single-process conversion worker and one 2-rank worker that
runs both TP=2 and PP=2.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import family_parity as fp
import pytest
import torch
from hf_tiny import hf_tensors
from multirank import run_multirank

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "convert_checkpoint.py"
TOLERANCE = 1e-4
MODELS = ("llama3", "mistral", "qwen2", "gemma3")
MULTIMODAL = "gemma3_multimodal"
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}
#: Mistral is exported in shards of at most this many bytes: an index and several files.
SHARD_BYTES = 100_000


def _hf_configs() -> dict[str, object]:
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=fp.VOCAB,
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
            # above the scaling's original_max_position_embeddings, as in real Llama-3.1 configs
            **{**common, "max_position_embeddings": 16384},
        ),
        "mistral": MistralConfig(num_key_value_heads=1, sliding_window=8, **common),
        "qwen2": Qwen2Config(
            num_key_value_heads=2,
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=6,
            layer_types=["full_attention", "sliding_attention"],
            **common,
        ),
        "gemma3": Gemma3TextConfig(
            num_key_value_heads=2,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=1,
            **{**common, "num_hidden_layers": 4},
        ),
    }


def _convert_worker(rank: int, world_size: int, root: str) -> dict:
    """Import every model, run it at TP=1, export it again (plus the dtype/sharding variants)."""
    from megatron_kto.checkpointing.model_io import read_architecture
    from megatron_kto.checkpointing.pretrained import restore_pretrained
    from megatron_kto.hf_writer.convert import export_hf, import_hf
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks
    from megatron_kto.runtime import init_runtime, teardown

    out = {}
    for name in MODELS:
        base = Path(root) / name
        import_hf(base / "hf", base / "mcore")
        arch = read_architecture(base / "mcore")
        rt = init_runtime(1, 1, seed=9)  # a different init: only the checkpoint can match
        chunks = build_gpt_chunks(arch, ParallelLayout(), rt.device)
        restore_pretrained(base / "mcore", chunks)
        out[name] = fp.forward_logits(arch, chunks)
        teardown()
        shard = SHARD_BYTES if name == "mistral" else 5 * 1024**3
        export_hf(base / "mcore", base / "export", max_shard_bytes=shard)
    mm = Path(root) / MULTIMODAL
    import_hf(mm / "hf", mm / "mcore")
    arch = read_architecture(mm / "mcore")
    rt = init_runtime(1, 1, seed=9)
    out[MULTIMODAL] = fp.forward_logits(arch, build_and_restore(mm / "mcore", arch, rt))
    # ... and straight from the directory (each rank reads its slices; no conversion step)
    direct = read_architecture(mm / "hf")
    out[MULTIMODAL, "direct"] = fp.forward_logits(direct, build_and_restore(mm / "hf", direct, rt))
    teardown()
    export_hf(mm / "mcore", mm / "export")
    qwen = Path(root) / "qwen2"
    import_hf(qwen / "hf", qwen / "mcore_bf16", dtype="bfloat16")
    export_hf(qwen / "mcore_bf16", qwen / "export_from_bf16", dtype="float32")
    export_hf(qwen / "mcore", qwen / "export_bf16", dtype="bfloat16")
    return out


def build_and_restore(ckpt: Path, arch, rt):
    from megatron_kto.checkpointing.pretrained import restore_pretrained
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks

    chunks = build_gpt_chunks(arch, ParallelLayout(), rt.device)
    restore_pretrained(ckpt, chunks)
    return chunks


def _multimodal_config():
    """A tiny Gemma 3 with a vision tower; image token ids above the test batch's fp.tokens."""
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=128,
        max_position_embeddings=64,
        sliding_window=5,
        layer_types=["full_attention", "sliding_attention"],
    )
    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    return Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        boi_token_index=125,
        eoi_token_index=126,
        image_token_index=127,
    )


def _layout_worker(rank: int, world_size: int, root: str) -> dict:
    """Every converted model restored under TP=2, then under PP=2 (same two processes)."""
    from megatron_kto.checkpointing.model_io import read_architecture
    from megatron_kto.checkpointing.pretrained import restore_pretrained
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks
    from megatron_kto.runtime import init_runtime, teardown

    out = {}
    for layout, (tp, pp) in LAYOUTS.items():
        # Re-initialising only megatron's groups (init_runtime keeps the default process group):
        # a teardown + init_process_group on the same MASTER_PORT can meet the old store and hang.
        rt = init_runtime(tp, pp, seed=9)
        for name in MODELS:
            ckpt = Path(root) / name / "mcore"
            arch = read_architecture(ckpt)
            parallel = ParallelLayout(
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
            )
            chunks = build_gpt_chunks(arch, parallel, rt.device)
            restore_pretrained(ckpt, chunks)
            out[layout, name] = fp.forward_logits(arch, chunks)
    teardown()
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("conversion")
    reference = {}
    for name, config in _hf_configs().items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        fp.perturb(model)  # norms away from 1 and non-zero biases: every tensor matters
        model.save_pretrained(root / name / "hf")
        (root / name / "hf" / "tokenizer_config.json").write_text(json.dumps({"name": name}))
        reference[name] = fp.hf_logits(root / name / "hf")
    from transformers import Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    multimodal = Gemma3ForConditionalGeneration(_multimodal_config()).float().eval()
    with torch.no_grad():
        for pname, p in multimodal.named_parameters():
            if "norm" in pname:
                p.add_(0.1 * torch.randn_like(p))
        reference[MULTIMODAL] = multimodal(input_ids=fp.tokens()).logits.float()
    multimodal.save_pretrained(root / MULTIMODAL / "hf")
    tp1 = run_multirank(_convert_worker, 1, str(root), timeout=300)[0]
    layouts = run_multirank(_layout_worker, 2, str(root), timeout=300)
    results = {("tp1", name): tp1[name] for name in (*MODELS, MULTIMODAL)}
    results["direct", MULTIMODAL] = tp1[MULTIMODAL, "direct"]
    for rank_out in layouts:
        for key, value in rank_out.items():
            if value is not None:  # one last-stage rank's result suffices (TP ranks agree)
                results.setdefault(key, value)
    return root, reference, results


@pytest.mark.parametrize("layout", ["tp1", *LAYOUTS])
@pytest.mark.parametrize("name", MODELS)
def test_logits_and_logprobs_equal_transformers(converted, layout, name):
    logits = fp.check_logits(converted, layout, name, TOLERANCE)
    assert not logits[..., fp.VOCAB :].any()  # padded rows were zero


@pytest.mark.parametrize("name", MODELS)
def test_round_trip_is_bit_exact_and_loads_in_transformers(converted, name):
    root, reference, _ = converted
    fp.check_bit_exact(root / name / "hf", root / name / "export")
    if name == "mistral":
        assert (root / name / "export" / "model.safetensors.index.json").is_file()
        assert len(list((root / name / "export").glob("model-*.safetensors"))) > 1
    config = json.loads((root / name / "export" / "config.json").read_text())
    assert config["model_type"] == _hf_configs()[name].model_type
    tokenizer = json.loads((root / name / "export" / "tokenizer_config.json").read_text())
    assert tokenizer == {"name": name}  # copied in by the import, out by the export
    assert torch.equal(fp.hf_logits(root / name / "export"), reference[name])


def test_multimodal_gemma3_is_read_and_exported_as_its_language_model(converted):
    root, reference, results = converted
    logits, logprobs = results["tp1", MULTIMODAL]
    want = reference[MULTIMODAL]
    logit_diff = (logits[..., :128] - want).abs().max().item()
    logp_diff = (logprobs - fp.reference_logprobs(want)).abs().max().item()
    print(f"{MULTIMODAL}: max|Δ logits| {logit_diff:.2e}, max|Δ logp| {logp_diff:.2e}")
    assert logit_diff <= TOLERANCE and logp_diff <= TOLERANCE
    direct_logits, _ = results["direct", MULTIMODAL]
    assert torch.equal(direct_logits, logits)  # the direct load reads the same weights
    export = root / MULTIMODAL / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and "vision_config" not in config
    assert not any("vision" in name for name in hf_tensors(export))
    assert torch.equal(fp.hf_logits(export), want)


def test_bf16_import_and_export_store_rounded_weights(converted):
    root = converted[0] / "qwen2"
    original = hf_tensors(root / "hf")
    from_bf16 = hf_tensors(root / "export_from_bf16")
    to_bf16 = hf_tensors(root / "export_bf16")
    assert json.loads((root / "export_bf16" / "config.json").read_text())["torch_dtype"] == (
        "bfloat16"
    )
    for key, tensor in original.items():
        rounded = tensor.to(torch.bfloat16)
        assert from_bf16[key].dtype == torch.float32 and to_bf16[key].dtype == torch.bfloat16
        assert torch.equal(from_bf16[key], rounded.float()), key
        assert torch.equal(to_bf16[key], rounded), key


# ---------------------------------------------------------------------------------------- CLI


def _cli_main():
    spec = importlib.util.spec_from_file_location("convert_checkpoint", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_cli_bad_input_is_one_error_line(converted, tmp_path, capsys):
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
        ("import", "--hf-dir", str(empty)): "config.json: not found",
        ("import", "--hf-dir", str(gpt2)): "model_type 'gpt2' is not supported",
        ("import", "--hf-dir", str(corrupt)): "model.safetensors",
        ("import", "--hf-dir", str(root / "qwen2" / "hf")): "not empty",
        ("export", "--ckpt", str(empty)): "no usable checkpoint",
    }
    main = _cli_main()  # in-process: the cases fail before megatron-core is needed
    for i, (args, expected) in enumerate(cases.items()):
        out = tmp_path / f"out{i}"
        if "not empty" in expected:
            out.mkdir()
            (out / "keep.txt").write_text("x")
        assert main([*args, "--out", str(out)]) == 2, args
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and expected in lines[0], lines
        assert not (tmp_path / f"out{i}.tmp").exists()  # nothing half-written is left behind
        assert not out.exists() or list(out.iterdir()) == [out / "keep.txt"]

    # One real process: the exit status, and no traceback on stderr.
    proc = subprocess.run(
        [
            sys.executable,
            str(TOOL),
            "import",
            "--hf-dir",
            str(corrupt),
            "--out",
            str(tmp_path / "x"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "model.safetensors" in lines[0]
    assert not (tmp_path / "x").exists()
