"""FP8 block-scaled checkpoints (DeepSeek-V3/R1, Qwen3 "-FP8"): every linear weight stored as
float8_e4m3fn with a `weight_scale_inv` [⌈rows/128⌉, ⌈cols/128⌉] fp32 next to it, and
config.json's `quantization_config` {quant_method fp8, fmt e4m3, weight_block_size [128, 128],
activation_scheme dynamic}, as published.

Shown on a tiny Llama and a tiny Qwen3 (hidden 128, MLP 384: 1 and 3 blocks, key/value
projections of 64 rows: one partial block) quantised here block by block:
* the direct load (`pretrained_checkpoint.restore_from_path`) fills an fp32 and a bf16 model with
  exactly the values `transformers` dequantises when it loads the checkpoint on a CPU (no
  accelerator: `Fp8Dequantize`, fp32 product then one cast), and log-probs equal its model's;
* at TP=2 each rank reads only its rows (or columns) of each weight and the scales of the blocks
  they touch — rank 1's gate/up rows start mid-block — and log-probs still equal;
* import -> export of the Qwen3 writes the dequantised weights as the source's torch_dtype
  (bfloat16, as published) without quantization_config, and `transformers` loads it; its fp8
  multi-token-prediction layer is skipped on load and not written (config.json and the log say
  so);
* partial edge blocks anywhere (dims not multiples of 128, slices starting mid-block) follow the
  block-indexed formula of `transformers`' `_dequantize_fp8_weight` (its load path instead
  derives the block from the scale grid and reads such tensors with other blocks, so the model
  tests keep to grids it reads right);
* an unsupported `quantization_config`, a missing scale, a mis-shaped scale: one line naming the
  key or tensor.

Spawns: one single-process worker (TP=1 loads, import/export) and one 2-rank worker (TP=2).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from hf_tiny import hf_row_logp_sums
from multirank import run_multirank

VOCAB, BLOCK = 128, (128, 128)
LENGTHS = [20, 13, 9]
SEQ = max(LENGTHS)
QUANT = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": list(BLOCK),
}


def quantize(weight: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, scale_inv) as DeepSeek's tools quantise: per block, scale = amax / 448."""
    rows, cols = weight.shape
    bm, bn = block
    scale = torch.empty(-(-rows // bm), -(-cols // bn))
    out = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = weight[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn]
            scale[i, j] = part.abs().max().clamp(min=1e-12) / 448.0
            out[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn] = (part / scale[i, j]).to(out.dtype)
    return out, scale


def _configs():
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    shape = dict(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True)
    return {
        "llama": LlamaConfig(**shape),
        "qwen3": Qwen3Config(**shape),
        "qwen3_moe": Qwen3MoeConfig(**shape, **moe),
    }


def _write_fp8(src: Path, dst: Path, dtype: str, mtp: bool = False) -> None:
    """`src` with every `*_proj.weight` quantised, config.json as published (torch_dtype); with
    `mtp` a multi-token-prediction layer after the decoder layers, as DeepSeek-V3 stores one
    (`model.layers.{num_hidden_layers}.*`, fp8 like the rest; `num_nextn_predict_layers` 1)."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    tensors = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        if name.endswith("proj.weight"):
            tensors[name], tensors[name + "_scale_inv"] = quantize(tensor)
        else:
            tensors[name] = tensor
    config = json.loads((src / "config.json").read_text())
    if mtp:
        layer = f"model.layers.{config['num_hidden_layers']}."
        tensors[layer + "eh_proj.weight"], tensors[layer + "eh_proj.weight_scale_inv"] = quantize(
            torch.randn(128, 256)
        )
        tensors[layer + "enorm.weight"] = torch.ones(128)
        config["num_nextn_predict_layers"] = 1
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config.update(quantization_config=QUANT, torch_dtype=dtype)
    (dst / "config.json").write_text(json.dumps(config))


def _batch():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (len(LENGTHS), SEQ), generator=g)
    labels = torch.full_like(tokens, -100)
    for i, n in enumerate(LENGTHS):
        labels[i, : n - 1] = tokens[i, 1:n]
    return tokens, labels, torch.arange(SEQ).expand(len(LENGTHS), SEQ).clone()


def _hf_logp_sums(model) -> torch.Tensor:
    return hf_row_logp_sums(model, _batch()[0], LENGTHS)


def _load(hf_dir: Path, tp: int, rt, precision: str = "32", ep: int = 1):
    from megatron_kto.checkpointing.hf_source import load_hf_model
    from megatron_kto.conversion.hf_dir import read_hf_architecture
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks

    _, arch = read_hf_architecture(hf_dir)
    layout = ParallelLayout(
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
        precision=precision,
    )
    chunks = build_gpt_chunks(arch, layout, rt.device)
    load_hf_model(hf_dir, chunks)
    return arch, chunks


def _logp_sums(arch, chunks) -> torch.Tensor:
    from megatron_kto.models.forward import forward_sequence_stats

    tokens, labels, positions = _batch()
    stats = forward_sequence_stats(chunks, tokens, labels, positions, 1, arch.vocab_size)
    return stats[:, 0].double()


def _as_hf(arch, chunks, model_type: str) -> dict[str, torch.Tensor]:
    """A TP=1 model's weights under their Hugging Face names (the conversion table)."""
    from megatron_kto.conversion.addressing import norm_names
    from megatron_kto.conversion.mappings import to_hf
    from megatron_kto.models.builder import unwrap

    state = {k: v for k, v in unwrap(chunks[0]).state_dict().items() if torch.is_tensor(v)}
    return {n: t.clone() for n, t in to_hf(state.__getitem__, arch, norm_names(state), model_type)}


def _single_worker(rank: int, world_size: int, root: str) -> dict:
    from megatron_kto.hf_writer.convert import export_hf, import_hf
    from megatron_kto.runtime import init_runtime, teardown

    base, out = Path(root), {}
    rt = init_runtime(1, 1, seed=0)
    for family in ("llama", "qwen3"):
        arch, chunks = _load(base / f"{family}_fp8", 1, rt)
        out[family, "32"] = _as_hf(arch, chunks, family)
        out[family, "logp"] = _logp_sums(arch, chunks)
    arch, chunks = _load(base / "llama_fp8", 1, rt, precision="bf16")
    out["llama", "bf16"] = _as_hf(arch, chunks, "llama")
    teardown()
    import_hf(base / "qwen3_fp8", base / "mcore")
    notes = []
    handler = logging.Handler()
    handler.emit = lambda record: notes.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("megatron_kto.hf_writer.convert").addHandler(handler)
    export_hf(base / "mcore", base / "export")
    out["export_notes"] = notes
    return out


def _two_rank_worker(rank: int, world_size: int, root: str) -> dict:
    from megatron_kto.conversion import safetensors_io
    from megatron_kto.runtime import init_runtime, teardown

    reads = []
    original = safetensors_io.HFWeights._read

    def recording(self, name, axis=None, start=0, stop=0, fp8=False):
        reads.append((name, axis, start, stop))
        return original(self, name, axis, start, stop, fp8)

    safetensors_io.HFWeights._read = recording
    rt = init_runtime(2, 1, seed=0)
    arch, chunks = _load(Path(root) / "llama_fp8", 2, rt)
    out = {"reads": list(reads), "logp": _logp_sums(arch, chunks)}
    reads.clear()
    rt = init_runtime(1, 1, seed=0, expert_parallel_size=2, expert_tensor_parallel_size=1)
    arch, chunks = _load(Path(root) / "qwen3_moe_fp8", 1, rt, ep=2)
    out.update(moe_reads=list(reads), moe_logp=_logp_sums(arch, chunks))
    teardown()  # once: init_runtime re-initialises megatron's groups in the same world
    return out


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("fp8")
    expected = {}
    for family, config in _configs().items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(root / family)
        _write_fp8(root / family, root / f"{family}_fp8", "bfloat16", mtp=family == "qwen3")
        for dtype in (torch.float32, torch.bfloat16):  # on a CPU: dequantised on load
            ref = AutoModelForCausalLM.from_pretrained(root / f"{family}_fp8", dtype=dtype)
            expected[family, dtype] = {k: v.detach().clone() for k, v in ref.state_dict().items()}
            if dtype == torch.float32:
                expected[family, "logp"] = _hf_logp_sums(ref.eval())
            else:
                expected[family, "bf16_logp"] = _hf_logp_sums(ref.eval())
    results = run_multirank(_single_worker, 1, str(root), timeout=600)[0]
    results["2 ranks"] = run_multirank(_two_rank_worker, 2, str(root), timeout=600)
    return root, expected, results


@pytest.mark.parametrize("family,precision", [("llama", "32"), ("qwen3", "32"), ("llama", "bf16")])
def test_direct_load_equals_transformers_dequantisation(fp8, family, precision):
    _, expected, results = fp8
    want = expected[family, torch.float32 if precision == "32" else torch.bfloat16]
    got = results[family, precision]
    assert sorted(got) == sorted(want)
    for name, value in got.items():
        assert value.dtype == want[name].dtype and torch.equal(value, want[name]), name


def test_ep2_each_rank_reads_only_its_experts(fp8):
    """Qwen3-MoE with fp8 experts (one tensor per expert projection, as DeepSeek-V3 and the
    Qwen3-MoE "-FP8" store them): at EP=2 rank r reads experts 2r, 2r + 1 and their scales only,
    and log-probs equal `transformers`' on its own dequantised load."""
    _, expected, results = fp8
    want = expected["qwen3_moe", "logp"]
    for rank, out in enumerate(results["2 ranks"]):
        got = out["moe_logp"]
        assert ((got - want).abs() / want.abs()).max().item() <= 1e-5
        experts = [n for n, *_ in out["moe_reads"] if ".mlp.experts." in n]
        assert {int(n.split(".mlp.experts.")[1].split(".")[0]) for n in experts} == {
            2 * rank,
            2 * rank + 1,
        }
        assert sum(n.endswith("_scale_inv") for n in experts) == len(experts) // 2 == 2 * 2 * 3


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_logprobs_equal_transformers(fp8, family):
    _, expected, results = fp8
    got, want = results[family, "logp"], expected[family, "logp"]
    assert ((got - want).abs() / want.abs()).max().item() <= 1e-5


def test_tp2_each_rank_reads_its_slices_and_their_blocks(fp8):
    _, expected, results = fp8
    for rank, out in enumerate(results["2 ranks"]):
        want = expected["llama", "logp"]
        assert ((out["logp"] - want).abs() / want.abs()).max().item() <= 1e-5
        reads = {(n, a): (s, e) for n, a, s, e in out["reads"] if n.startswith("model.layers.0.")}
        up = "model.layers.0.mlp.up_proj.weight"
        down = "model.layers.0.mlp.down_proj.weight"
        # 384 MLP rows = 3 blocks: rank 0 rows [0, 192) -> blocks [0, 2); rank 1 [192, 384)
        # -> blocks [1, 3), starting 64 rows into block 1. down_proj: the same along columns.
        assert reads[up, 0] == (192 * rank, 192 * (rank + 1))
        assert reads[up + "_scale_inv", 0] == ((0, 2), (1, 3))[rank]
        assert reads[down, 1] == (192 * rank, 192 * (rank + 1))
        assert reads[down + "_scale_inv", 1] == ((0, 2), (1, 3))[rank]
        assert not any(a is None for n, a, _, _ in out["reads"] if n.endswith("proj.weight"))


def test_export_writes_dequantised_bf16_without_quantization_config_or_mtp(fp8):
    """The Qwen3 source also holds an fp8 MTP layer (model.layers.2.*): skipped on import, so
    not written; config.json says so (num_nextn_predict_layers 0) and so does the log."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    root, expected, results = fp8
    config = json.loads((root / "export" / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    assert config["num_nextn_predict_layers"] == 0
    notes = " ".join(results["export_notes"])
    assert "fp8 block-scaled weights were dequantised on load and are written as bfloat16" in notes
    assert "1 multi-token-prediction layer(s) were not read and are not written" in notes
    written = load_file(root / "export" / "model.safetensors")
    want = expected["qwen3", torch.bfloat16]
    assert sorted(written) == sorted(want)  # no *_scale_inv, no model.layers.2.*
    for name, tensor in written.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, want[name]), name
    model = AutoModelForCausalLM.from_pretrained(root / "export", dtype=torch.bfloat16)
    assert torch.equal(_hf_logp_sums(model.eval()), expected["qwen3", "bf16_logp"])


@pytest.mark.parametrize("shape", [(200, 300), (64, 72), (300, 260)])
def test_partial_edge_blocks_follow_the_block_indexed_formula(shape):
    """Any shape: `transformers`' `_dequantize_fp8_weight` (block = index // 128, cut at the
    edge — DeepSeek's `weight_dequant`) to the bit."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    from megatron_kto.conversion.fp8 import dequantize_fp8

    weight, scale = quantize(torch.randn(shape) * 3)
    got = dequantize_fp8(weight, scale, BLOCK)
    assert torch.equal(got, _dequantize_fp8_weight(weight, scale, list(BLOCK), torch.float32))


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    path.mkdir(exist_ok=True)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_slices_of_a_weight_equal_the_slices_of_the_whole(tmp_path):
    """Row and column slices starting and ending mid-block, read through `HFWeights`."""
    from megatron_kto.conversion.safetensors_io import HFWeights

    weight, scale = quantize(torch.randn(300, 260))
    weights = HFWeights(_write(tmp_path, {"w": weight, "w_scale_inv": scale}), (), BLOCK)
    whole = weights.get("w")
    assert weights.shapes(["w"]) == {"w": (300, 260)}
    assert weights.stored("w") == ("w", "w_scale_inv")
    for axis, (start, stop) in ((0, (100, 250)), (0, (128, 300)), (1, (1, 129)), (1, (200, 260))):
        assert torch.equal(
            weights.get_rows("w", axis, start, stop), whole.narrow(axis, start, stop - start)
        )


@pytest.mark.parametrize(
    "quant,key",
    [
        ({**QUANT, "quant_method": "awq"}, "quantization_config.quant_method 'awq'"),
        ({**QUANT, "fmt": "e5m2"}, "quantization_config.fmt 'e5m2'"),
        ({**QUANT, "weight_block_size": None}, "quantization_config.weight_block_size None"),
        ({**QUANT, "weight_block_size": [128]}, "quantization_config.weight_block_size [128]"),
        ({**QUANT, "activation_scheme": "static"}, "quantization_config.activation_scheme"),
    ],
)
def test_unsupported_quantization_config_is_one_line(quant, key):
    from megatron_kto.conversion.errors import ConversionError
    from megatron_kto.conversion.fp8 import fp8_block

    with pytest.raises(ConversionError) as info:
        fp8_block({"quantization_config": quant}, "x/config.json")
    assert "\n" not in str(info.value) and str(info.value).startswith(f"x/config.json: {key}")


def test_bad_fp8_tensors_are_one_line_naming_the_tensor(tmp_path):
    from megatron_kto.conversion.errors import ConversionError
    from megatron_kto.conversion.safetensors_io import HFWeights

    weight, scale = quantize(torch.randn(200, 130))
    cases = {
        # an fp8 weight without its scale: refused, not read as its codes
        "missing": ({"w": weight}, BLOCK, "tensor w is torch.float8_e4m3fn without a w_scale_inv"),
        "shape": (
            {"w": weight, "w_scale_inv": scale[:1]},
            BLOCK,
            "tensor w_scale_inv: shape (1, 2)",
        ),
        "dtype": (
            {"w": weight.float(), "w_scale_inv": scale},
            BLOCK,
            "tensor w is stored as F32, but has a block scale w_scale_inv",
        ),
        "config": ({"w": weight, "w_scale_inv": scale}, None, "tensor w_scale_inv is an fp8 block"),
    }
    for case, (tensors, block, message) in cases.items():
        with pytest.raises(ConversionError) as info:
            weights = HFWeights(_write(tmp_path / case, tensors), (), block)
            weights.shapes(["w"])  # the direct load checks headers first
            weights.get("w")
        assert "\n" not in str(info.value) and message in str(info.value), case
    # the import path (no header check first) refuses a mis-shaped scale as well
    weights = HFWeights(tmp_path / "shape", (), BLOCK)
    with pytest.raises(ConversionError, match="tensor w: scale shape"):
        weights.get("w")
