"""GPT-OSS (`gpt_oss`) against `transformers`, fp32: a tiny random model with every feature —
GQA (4 query heads, 2 KV heads), attention sinks (drawn N(0, 1), so they matter), biased q/k/v/o,
alternating sliding-window (8) / full layers (4 layers: both kinds, twice), rows up to 20 tokens
(longer than the window), YaRN RoPE (factor 4 over 16 original positions), 4 experts top-2 with a
biased router, expert biases and the clamped gated activation (biases and expert weights drawn
large enough that the clamp at 7 cuts).

Shown, loading the Hugging Face directory directly (`pretrained_checkpoint.restore_from_path`):
* each row's completion log-prob sum equals `transformers`' to 1e-5 relative at TP=1, TP=2,
  PP=2, EP=2 and TP=2 x EP=2, padded and packed (packed = padded);
* an MXFP4 checkpoint in the published format (into an fp32 and a bf16 model) (`*_blocks` + E8M0 `*_scales`, config
  `quantization_config.quant_method: mxfp4`) loads to exactly the values `transformers`'
  `convert_moe_packed_tensors` dequantises, and at EP=2 each rank reads only its own experts'
  slices;
* import -> export writes the stacked experts (and every other tensor) back bit for bit, and
  `transformers` loads the export (equal log-probs);
* a run's `hf/` output of the MXFP4 checkpoint (torch_dtype bfloat16, as published) writes the
  dequantised experts as bf16 stacked tensors without quantization_config, and `transformers`
  loads it to the log-probs of its own (dequantised) load of the MXFP4 checkpoint.

Spawns: one single-process worker (TP=1, MXFP4, the round trip), one 2-rank worker (TP=2, PP=2,
EP=2), one 4-rank worker (TP=2 x EP=2).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hf_tiny import hf_row_logp_sums
from multirank import run_multirank

VOCAB, WINDOW, EXPERTS = 200, 8, 4
LENGTHS = [20, 13, 17, 9]
SEQ = max(LENGTHS)
LAYOUTS2 = {"tp2": (2, 1, 1), "pp2": (1, 2, 1), "ep2": (1, 1, 2)}
LAYOUTS4 = {"tp2ep2": (2, 1, 2)}
TOLERANCE = 1e-5


def _hf_config():
    from transformers import GptOssConfig

    return GptOssConfig(
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=EXPERTS,
        num_experts_per_tok=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        sliding_window=WINDOW,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 16,
            "rope_theta": 150000.0,
        },
        tie_word_embeddings=False,
    )


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, labels, position_ids) [rows, SEQ]: rows of `LENGTHS`, right-padded."""
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (len(LENGTHS), SEQ), generator=g)
    labels = torch.full_like(tokens, -100)
    for i, n in enumerate(LENGTHS):
        labels[i, : n - 1] = tokens[i, 1:n]
    positions = torch.arange(SEQ).expand(len(LENGTHS), SEQ).clone()
    return tokens, labels, positions


def _hf_logp_sums(model) -> torch.Tensor:
    return hf_row_logp_sums(model, _batch()[0], LENGTHS)


def _logp_sums(arch, chunks, pack: bool) -> torch.Tensor:
    from megatron_kto.models.forward import forward_sequence_stats

    tokens, labels, positions = _batch()
    stats = forward_sequence_stats(chunks, tokens, labels, positions, 2, arch.vocab_size, pack=pack)
    return stats[:, 0].double()


def _load(hf_dir: Path, tp: int, pp: int, ep: int, rt, precision: str = "32"):
    from megatron_kto.checkpointing.hf_source import load_hf_model
    from megatron_kto.conversion.hf_config import architecture_from_hf
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks

    arch = architecture_from_hf(json.loads((hf_dir / "config.json").read_text()))
    layout = ParallelLayout(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,  # biased experts: megatron-core splits them at ETP 1 only
        precision=precision,
    )
    chunks = build_gpt_chunks(arch, layout, rt.device)
    load_hf_model(hf_dir, chunks)
    return arch, chunks


def _expert_values(chunks) -> dict[str, torch.Tensor]:
    from megatron_kto.models.builder import unwrap

    return {
        n: p.detach().clone()
        for chunk in chunks
        for n, p in unwrap(chunk).named_parameters()
        if "local_experts" in n and "weight" in n
    }


def _run_layouts(root: str, layouts: dict) -> dict:
    from megatron_kto.conversion import safetensors_io
    from megatron_kto.runtime import init_runtime, teardown

    out = {}
    reads: list[tuple[str, int]] = []
    original = safetensors_io.HFWeights._slice

    def recording(self, name, expert):
        reads.append((name, expert))
        return original(self, name, expert)

    safetensors_io.HFWeights._slice = recording
    for layout, (tp, pp, ep) in layouts.items():
        rt = init_runtime(tp, pp, seed=9, expert_parallel_size=ep, expert_tensor_parallel_size=1)
        arch, chunks = _load(Path(root) / "hf", tp, pp, ep, rt)
        out[layout, "padded"] = _logp_sums(arch, chunks, pack=False)
        out[layout, "packed"] = _logp_sums(arch, chunks, pack=True)
        reads.clear()
        _, chunks = _load(Path(root) / "mxfp4", tp, pp, ep, rt)
        out[layout, "mxfp4_reads"] = sorted(set(reads))
        out[layout, "mxfp4_experts"] = _expert_values(chunks)
    teardown()  # once: init_runtime re-initialises megatron's groups in the same world
    return out


def _single_worker(rank: int, world_size: int, root: str) -> dict:
    from megatron_kto.hf_writer.convert import export_hf, import_hf
    from megatron_kto.runtime import init_runtime, teardown

    out = _run_layouts(root, {"tp1": (1, 1, 1)})
    rt = init_runtime(1, 1, seed=9)
    _, chunks = _load(Path(root) / "mxfp4", 1, 1, 1, rt, precision="bf16")
    out["tp1", "mxfp4_bf16_experts"] = _expert_values(chunks)
    _write_hf_output(Path(root), rt)
    teardown()
    base = Path(root)
    import_hf(base / "hf", base / "mcore")
    export_hf(base / "mcore", base / "export")
    return out


def _write_hf_output(root: Path, rt) -> None:
    """A run's `hf/` output (`HFOutput.write`, as a training run's final save calls it) of the
    MXFP4 checkpoint loaded directly into an fp32 model."""
    from megatron_kto.hf_writer.output import HFOutput

    arch, chunks = _load(root / "mxfp4", 1, 1, 1, rt)
    source = str(root / "mxfp4")
    HFOutput(arch, root / "run", restore_from_path=source, tokenizer_model=None).write(
        1, chunks, None
    )


def _layout_worker(rank: int, world_size: int, root: str, layouts: dict) -> dict:
    return _run_layouts(root, layouts)


def _write_mxfp4(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """A copy of `src` whose expert weights are MXFP4 in the published layout: random blocks and
    E8M0 scales (2^-3 .. 2^1), its other weights rounded to bf16 values and its config.json's
    torch_dtype bfloat16 (as published, so `hf/` is exact in bf16). Returns `transformers`'
    dequantisation of each stacked tensor."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    g = torch.Generator().manual_seed(11)
    expected = {}
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        experts, rows_in, rows_out = tensors.pop(name).shape  # [E, in, out]
        blocks = torch.randint(0, 256, (experts, rows_out, rows_in // 32, 16), generator=g)
        scales = torch.randint(124, 129, (experts, rows_out, rows_in // 32), generator=g)
        tensors[name + "_blocks"] = blocks.to(torch.uint8)
        tensors[name + "_scales"] = scales.to(torch.uint8)
        expected[name] = convert_moe_packed_tensors(
            blocks.to(torch.uint8), scales.to(torch.uint8), dtype=torch.float32
        )
    for name in [n for n in tensors if not n.endswith(("_blocks", "_scales"))]:
        tensors[name] = tensors[name].to(torch.bfloat16).float()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    config["torch_dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(config))
    return expected


@pytest.fixture(scope="module")
def oss(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("gpt_oss")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_hf_config(), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "sinks" in name or "router.weight" in name:
                p.normal_(0.0, 1.0)  # sinks that matter; decisive routing, far from ties
            elif "experts" in name:
                p.normal_(0.0, 0.5)  # gate/up beyond ±7 for some tokens: the clamp cuts
            elif "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(root / "hf")
    reference = _hf_logp_sums(model)
    expected = _write_mxfp4(root / "hf", root / "mxfp4")
    results = run_multirank(_single_worker, 1, str(root), timeout=600)[0]
    for outs in (
        run_multirank(_layout_worker, 2, str(root), LAYOUTS2, timeout=600),
        run_multirank(_layout_worker, 4, str(root), LAYOUTS4, timeout=600),
    ):
        for rank, rank_out in enumerate(outs):
            for key, value in rank_out.items():
                if key[1] in ("mxfp4_reads", "mxfp4_experts"):
                    results[(*key, rank)] = value
                else:
                    results.setdefault(key, value)
    return root, reference, expected, results


CASES = [(layout, how) for layout in ("tp1", *LAYOUTS2, *LAYOUTS4) for how in ("padded", "packed")]


@pytest.mark.parametrize("layout,how", CASES, ids=[f"{a}-{b}" for a, b in CASES])
def test_logprobs_equal_transformers(oss, layout, how):
    _, reference, _, results = oss
    got = results[layout, how]
    relative = ((got - reference).abs() / reference.abs()).max().item()
    assert relative <= TOLERANCE, f"{layout} {how}: max relative |dlogp| {relative:.2e}"


def _megatron_expert(expected: dict[str, torch.Tensor], layer: int, expert: int, param: str):
    from megatron_kto.conversion.addressing import from_stacked

    prefix = f"model.layers.{layer}.mlp.experts."
    if param == "linear_fc1.weight":
        return from_stacked("interleaved_gated_t", expected[prefix + "gate_up_proj"][expert])
    return from_stacked("transposed", expected[prefix + "down_proj"][expert])


def test_mxfp4_loads_to_the_dequantised_values(oss):
    """TP=1: every expert weight equals `transformers`' dequantisation exactly."""
    from megatron_kto.conversion.addressing import parse_name

    _, _, expected, results = oss
    values = results["tp1", "mxfp4_experts"]
    assert len(values) == 4 * EXPERTS * 2
    for name, value in values.items():
        parsed = parse_name(name)
        assert torch.equal(
            value, _megatron_expert(expected, parsed.layer, parsed.expert, parsed.rest)
        )


def test_mxfp4_loads_exactly_into_a_bf16_model(oss):
    """Every MXFP4 value (an E2M1 number times a power of two) is exact in bf16: a bf16 model
    holds the dequantised values themselves."""
    from megatron_kto.conversion.addressing import parse_name

    _, _, expected, results = oss
    for name, value in results["tp1", "mxfp4_bf16_experts"].items():
        parsed = parse_name(name)
        want = _megatron_expert(expected, parsed.layer, parsed.expert, parsed.rest)
        assert value.dtype == torch.bfloat16 and torch.equal(value.float(), want)


def test_mxfp4_at_ep2_each_rank_reads_only_its_experts(oss):
    """EP=2: rank r holds (and reads) experts [2r, 2r + 2) of every layer; its values are the
    dequantised ones (local expert i is global 2r + i)."""
    _, _, expected, results = oss
    for rank in (0, 1):
        reads = results["ep2", "mxfp4_reads", rank]
        assert {e for _, e in reads} == {2 * rank, 2 * rank + 1}
        assert {n.rsplit(".", 1)[-1] for n, _ in reads} == {
            "gate_up_proj_blocks",
            "gate_up_proj_scales",
            "down_proj_blocks",
            "down_proj_scales",
            "gate_up_proj_bias",
            "down_proj_bias",
        }
        for name, value in results["ep2", "mxfp4_experts", rank].items():
            layer = int(name.split(".")[2])
            local = int(name.split("local_experts.")[1].split(".")[0])
            param = name.split(f"local_experts.{local}.")[1]
            assert torch.equal(value, _megatron_expert(expected, layer, 2 * rank + local, param))


def test_round_trip_is_bit_exact_and_loads_in_transformers(oss):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    root, reference, _, _ = oss
    before = load_file(root / "hf" / "model.safetensors")
    after = load_file(root / "export" / "model.safetensors")
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert torch.equal(tensor, after[name]), name
    model = AutoModelForCausalLM.from_pretrained(root / "export", dtype=torch.float32)
    assert model.config.layer_types == _hf_config().layer_types
    got = _hf_logp_sums(model.eval())
    assert torch.equal(got, reference)


def test_hf_output_of_mxfp4_writes_bf16_experts_that_transformers_loads(oss):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    root, _, expected, _ = oss
    out = root / "run" / "hf"
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    assert any(
        "MXFP4" in note for note in json.loads((out / "hf_export.json").read_text())["notes"]
    )
    written = load_file(out / "model.safetensors")
    assert not any(n.endswith(("_blocks", "_scales")) for n in written)
    for name, want in expected.items():  # the stacked [E, in, out] experts
        assert written[name].dtype == torch.bfloat16 and torch.equal(written[name].float(), want)
    # transformers on a CPU dequantises the MXFP4 checkpoint itself: the same model
    source = AutoModelForCausalLM.from_pretrained(root / "mxfp4", dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert torch.equal(_hf_logp_sums(model.eval()), _hf_logp_sums(source.eval()))


def test_mxfp4_blocks_without_scales_is_one_line(oss, tmp_path):
    from safetensors.torch import load_file, save_file

    from megatron_kto.checkpointing.hf_source import load_hf_model

    root = oss[0]
    bad = tmp_path / "bad"
    shutil.copytree(root / "mxfp4", bad)
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Exception) as info:
        load_hf_model(bad, [])
    message = str(info.value)
    assert "\n" not in message
    assert "model.layers.1.mlp.experts.down_proj_scales is missing" in message


@pytest.mark.parametrize("kind", ["interleaved_gated_t", "interleaved_gated", "transposed"])
def test_a_stacked_expert_slice_fills_each_expert_tp_shard(kind):
    """Pure addressing: an expert's whole slice read once, each of 2 expert-TP ranks copies its
    part (gate and up halves cut alike) — the shard `shard_of` cuts from the whole tensor, and
    the shards merge back to it."""
    from megatron_kto.conversion.addressing import (
        COLUMN,
        ROW,
        Mapping,
        from_stacked,
        merge_shards,
        shard_of,
        shard_reads,
    )
    from megatron_kto.conversion.addressing import fill as fill_shard

    shapes = {"interleaved_gated_t": (6, 8), "interleaved_gated": (8,), "transposed": (4, 6)}
    axis = ROW if kind == "transposed" else COLUMN
    entry = Mapping("x", ("mlp.experts.t#1",), kind, axis, expert=True)
    hf = torch.randn(shapes[kind])
    whole = from_stacked(kind, hf)
    parts = []
    for rank in (0, 1):
        local = shard_of(whole, axis, kind, rank, 2)
        (read,) = shard_reads(entry, None, tuple(local.shape), rank, 2)
        assert read.axis is None  # the whole slice
        out = torch.empty_like(local)
        fill_shard(entry, None, out, 0, hf, 2, rank)
        assert torch.equal(out, local)
        parts.append(out)
    assert torch.equal(merge_shards(parts, axis, kind), whole)
