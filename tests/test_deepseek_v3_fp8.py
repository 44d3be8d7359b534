"""DeepSeek-V3's published fp8 checkpoint format on the tiny MLA + expert models of
`test_deepseek_v3.py` (both configs), quantised here as DeepSeek stores V3 / R1: every linear
weight — the MLA projections (`q_a_proj`, `q_b_proj` or `q_proj`, `kv_a_proj_with_mqa`,
`kv_b_proj`, `o_proj`), the dense, routed and shared experts' projections — float8_e4m3fn with a
fp32 `weight_scale_inv` per block; norms, embeddings, output layer and routers bf16, the
correction bias fp32; `quantization_config` {quant_method fp8, fmt e4m3, activation_scheme
dynamic, weight_block_size}; one fp8 multi-token-prediction layer after the decoder layers, in
the last file of a sharded directory with its index.
`transformers`' CPU fp8 load derives the block from the scale grid: it refuses DeepSeek-V3's
`kv_a_proj_with_mqa` (576 rows, 5 scale rows) and reads this one (24 rows, 2 scale rows) with
blocks of 12 rows — other values, silently (5.24) — so the reference dequantisation is computed
here block by block from the stored fp8 values and scales.

`qlora` uses 16x32 blocks (rows x columns, as weight_block_size allows; `kv_a_proj_with_mqa`
[24, 64]: one whole and one half block of rows; `kv_b_proj` [112, 16], TP rank 1's rows start
mid-block; `o_proj` [64, 48] likewise along columns), `plain` the published 128x128 (every weight
one partial block). Shown:

* the direct load at TP=1 and `tools/convert_checkpoint.py import` hold exactly the reference
  dequantisation (fp32, bit for bit), and the log-probs and expert choices equal `transformers`'
  DeepseekV3ForCausalLM loaded with the dequantised weights (<= 1e-5 relative);
* at TP=2 with SP and at EP=2 each rank reads only its rows / columns of each weight and the
  scale blocks they touch (its experts only under EP), holds exactly its shard of the TP=1 model,
  and the log-probs equal `transformers`';
* `convert_checkpoint.py export` of the import writes the dequantised weights as bf16 (the
  source's torch_dtype) without quantization_config or the MTP layer, and `transformers` loads
  it to the logits of the dequantised weights in bf16;
* the MTP layer is skipped with the note bf16 checkpoints get (never read); a scale with the
  wrong block count or a missing `weight_scale_inv` is one line naming the tensor, from the direct
  load and from the converter.

Spawns: one single-process worker and one 2-rank worker.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import family_parity as fp
import pytest
import torch
from multirank import run_multirank
from test_deepseek_v3 import _grad_errors, _hf_configs
from test_fp8_checkpoints import QUANT, _as_hf, quantize

MODELS = ("qlora", "plain")
BLOCKS = {"qlora": (16, 32), "plain": (128, 128)}
#: The 2-rank runs' layouts.
LAYOUTS = {"tp2_sp": fp.Layout(tp=2, sp=True), "ep2": fp.Layout(ep=2)}
TOOL = Path(__file__).resolve().parents[1] / "tools" / "convert_checkpoint.py"
FP8_SUFFIXES = ("proj.weight", "proj_with_mqa.weight")
BROKEN = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
MISSING = "model.layers.1.self_attn.kv_b_proj.weight"


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """The reference: each bm x bn block (the edge ones cut) times its scale, in fp32."""
    (rows, cols), (bm, bn) = weight.shape, block
    out = torch.empty(rows, cols)
    for i in range(0, rows, bm):
        for j in range(0, cols, bn):
            part = weight[i : i + bm, j : j + bn].to(torch.float32)
            out[i : i + bm, j : j + bn] = part * scale[i // bm, j // bn]
    return out


def _write_published(hf: Path, fp8: Path, deq: Path, block) -> dict[str, torch.Tensor]:
    """`hf` (an fp32 tiny DeepSeek-V3) as DeepSeek publishes V3 under `fp8`, with an fp8 MTP
    layer; under `deq` the reference dequantisation as a plain fp32 model (the bf16 tensors as
    stored). Returns the reference tensors."""
    from safetensors.torch import load_file, save_file

    config = json.loads((hf / "config.json").read_text())
    stored, reference = {}, {}
    for name, tensor in load_file(hf / "model.safetensors").items():
        if name.endswith(FP8_SUFFIXES):
            weight, scale = quantize(tensor, block)
            stored[name], stored[name + "_scale_inv"] = weight, scale
            reference[name] = dequantize_blocks(weight, scale, block)
        else:
            keep = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
            stored[name] = tensor.to(keep)
            reference[name] = stored[name].float()
    mtp = f"model.layers.{config['num_hidden_layers']}."
    hidden = config["hidden_size"]
    for name, shape in (("eh_proj", (hidden, 2 * hidden)), ("self_attn.kv_a_proj_with_mqa", None)):
        shape = shape or tuple(stored[BROKEN].shape)
        stored[f"{mtp}{name}.weight"], stored[f"{mtp}{name}.weight_scale_inv"] = quantize(
            torch.randn(shape), block
        )
    stored[mtp + "enorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    quant = {**QUANT, "weight_block_size": list(block)}
    shards = {  # as published: an index, the MTP layer in the last file
        "model-00001-of-00002.safetensors": {
            k: v for k, v in stored.items() if not k.startswith(mtp)
        },
        "model-00002-of-00002.safetensors": {k: v for k, v in stored.items() if k.startswith(mtp)},
    }
    for path, files, extra in (
        (fp8, shards, dict(quantization_config=quant, torch_dtype="bfloat16", nextn=1)),
        (deq, {"model.safetensors": reference}, dict(torch_dtype="float32", nextn=0)),
    ):
        path.mkdir()
        for file, tensors in files.items():
            save_file(tensors, path / file, metadata={"format": "pt"})
        extra["num_nextn_predict_layers"] = extra.pop("nextn")
        (path / "config.json").write_text(json.dumps({**config, **extra}))
    weight_map = {k: file for file, tensors in shards.items() for k in tensors}
    size = sum(t.numel() * t.element_size() for t in stored.values())
    index = {"metadata": {"total_size": size}, "weight_map": weight_map}
    (fp8 / "model.safetensors.index.json").write_text(json.dumps(index))
    return reference


def _write_broken(fp8: Path, root: Path) -> None:
    """Copies of `fp8` with one scale row short of its weight's blocks, and with a scale gone."""
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = {k: v for f in sorted(fp8.glob("*.safetensors")) for k, v in load_file(f).items()}
    for case, change in (
        ("short", {BROKEN + "_scale_inv": tensors[BROKEN + "_scale_inv"][:1]}),
        ("missing", {MISSING + "_scale_inv": None}),
    ):
        out = root / case
        out.mkdir()
        shutil.copy(fp8 / "config.json", out / "config.json")
        changed = {**tensors, **change}
        changed = {k: v for k, v in changed.items() if v is not None}
        save_file(changed, out / "model.safetensors", metadata={"format": "pt"})


def _recording_reads() -> list:
    """Every stored-tensor read (name, axis, start, stop) from now on, in this process."""
    from megatron_kto.conversion import safetensors_io

    reads, original = [], safetensors_io.HFWeights._read

    def recording(self, name, axis=None, start=0, stop=0, fp8=False):
        reads.append((name, axis, start, stop))
        return original(self, name, axis, start, stop, fp8)

    safetensors_io.HFWeights._read = recording
    return reads


@contextlib.contextmanager
def _notes() -> Iterator[list[str]]:
    """The lines our loggers write meanwhile (the notes a user reads)."""
    notes: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: notes.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("megatron_kto")
    logger.addHandler(handler)
    try:
        yield notes
    finally:
        logger.removeHandler(handler)


def _tool(*argv: str) -> tuple[int, str, list[str]]:
    """`tools/convert_checkpoint.py` in this process: (exit code, stderr, log notes)."""
    spec = importlib.util.spec_from_file_location("convert_checkpoint", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    stderr = io.StringIO()
    with _notes() as notes, contextlib.redirect_stderr(stderr):
        code = tool.main(list(argv))
    return code, stderr.getvalue(), notes


def _single_worker(rank: int, world_size: int, root: str) -> dict:
    """Per model: the direct load at TP=1 (weights, log-probs; its megatron state saved for the
    2-rank shards), the converter's import restored; the broken copies, both ways."""
    from megatron_kto.checkpointing.errors import CheckpointError
    from megatron_kto.checkpointing.hf_source import load_hf_model
    from megatron_kto.conversion.hf_dir import read_hf_architecture
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks, unwrap
    from megatron_kto.runtime import init_runtime, teardown

    out, reads = {}, _recording_reads()
    rt = init_runtime(1, 1, seed=9)
    sdpa = ParallelLayout(attention_backend="sdpa")
    for name in MODELS:
        base = Path(root) / name
        reads.clear()
        with _notes() as notes:
            arch, chunks = fp.restore_and_run(base / "fp8", fp.Layout(), rt)
        out["reads", name], out["notes", name] = list(reads), notes
        out["direct", name] = _as_hf(arch, chunks, "deepseek_v3")
        out["tp1", name] = fp.forward(arch, chunks)
        state = {k: p.detach().clone() for k, p in unwrap(chunks[0]).named_parameters()}
        torch.save(state, base / "tp1_state.pt")
    for case in ("short", "missing"):  # copies of the qlora model's directory
        broken = Path(root) / case
        try:
            load_hf_model(
                broken, build_gpt_chunks(read_hf_architecture(broken)[1], sdpa, rt.device)
            )
            out["direct", case] = None
        except CheckpointError as e:
            out["direct", case] = str(e)
    teardown()  # the converter runs as its own single process
    for case in ("short", "missing", *MODELS):
        source = Path(root) / case
        source = source / "fp8" if case in MODELS else source
        out["tool", case] = _tool("import", "--hf-dir", str(source), "--out", f"{source}_mc")
    qlora = Path(root) / "qlora"
    out["export"] = _tool("export", "--ckpt", str(qlora / "fp8_mc"), "--out", str(qlora / "export"))
    rt = init_runtime(1, 1, seed=9)
    for name in MODELS:
        arch, chunks = fp.restore_and_run(Path(root) / name / "fp8_mc", fp.Layout(), rt)
        out["imported", name] = _as_hf(arch, chunks, "deepseek_v3")
    teardown()
    return out


def _expert_shard_errors(state: dict, want: dict, ep_rank: int, local_experts: int) -> dict:
    """Per local expert parameter: max |this rank's - TP=1's global expert| (EP=2, ETP=1)."""
    import re

    errors = {}
    for name, tensor in state.items():
        match = re.search(r"\.local_experts\.(\d+)\.", name)
        if match is not None:
            index = int(match.group(1)) + ep_rank * local_experts
            name = f"{name[: match.start(1)]}{index}{name[match.end(1) :]}"
        errors[name] = (tensor - want[name]).abs().max().item()
    return errors


def _layout_worker(rank: int, world_size: int, root: str) -> dict:
    """TP=2 with SP and EP=2 straight from the fp8 directory: log-probs and expert choices, the
    reads, and each rank's parameters against its shard of the TP=1 model."""
    from megatron.core import parallel_state

    from megatron_kto.models.builder import unwrap
    from megatron_kto.runtime import init_runtime, teardown

    reads = _recording_reads()
    out = {}
    for key, layout in LAYOUTS.items():
        rt = init_runtime(layout.tp, 1, seed=9, expert_parallel_size=layout.ep)
        out["sizes", key] = fp.parallel_sizes()
        for name in MODELS:
            base = Path(root) / name
            reads.clear()
            arch, chunks = fp.restore_and_run(base / "fp8", layout, rt)
            out["reads", key, name] = list(reads)
            out[key, name] = fp.forward(arch, chunks)
            want = torch.load(base / "tp1_state.pt", weights_only=True)
            state = {k: p.detach() for k, p in unwrap(chunks[0]).named_parameters()}
            if layout.tp > 1:
                errors = _grad_errors(state, want, arch, chunks[0])
            else:
                ep_rank = parallel_state.get_expert_model_parallel_rank()
                local = arch.num_moe_experts // layout.ep
                errors = _expert_shard_errors(state, want, ep_rank, local)
            out["shards", key, name] = errors
    teardown()
    return out


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_v3_fp8")
    fp.sigmoid_moe_references(root, _hf_configs())  # the tiny random models, decisive routers
    reference, dequantised = {}, {}
    for name in MODELS:
        base = root / name
        dequantised[name] = _write_published(base / "hf", base / "fp8", base / "deq", BLOCKS[name])
        logits, choices = fp.hf_run(fp.hf_model(base / "deq"))
        reference[name] = {"logits": logits, "choices": choices}
    _write_broken(root / "qlora" / "fp8", root)
    results = run_multirank(_single_worker, 1, str(root), timeout=600)[0]
    ranks = run_multirank(_layout_worker, 2, str(root), timeout=600)
    results["ranks"] = ranks
    results = fp.merge_rank_outputs(results, ranks, ("reads", "shards", "ranks", "sizes"))
    return root, reference, results, dequantised


def _converted(fp8) -> tuple:
    root, reference, results, _ = fp8
    return root, reference, results


@pytest.mark.parametrize("way", ["direct", "imported"])
@pytest.mark.parametrize("name", MODELS)
def test_weights_are_exactly_the_reference_dequantisation(fp8, name, way):
    _, _, results, dequantised = fp8
    got, want = results[way, name], dequantised[name]
    assert sorted(got) == sorted(want)  # no scales, no MTP layer
    layers = _hf_configs()[name].num_hidden_layers
    assert sum(n.endswith("kv_a_proj_with_mqa.weight") for n in got) == layers
    for key, value in got.items():
        assert value.dtype == torch.float32 and torch.equal(value, want[key]), key


@pytest.mark.parametrize("name", MODELS)
def test_logprobs_and_choices_equal_transformers_at_tp1(fp8, name):
    fp.check_single_rank(_converted(fp8), "tp1", name, _hf_configs()[name].num_hidden_layers - 1)


@pytest.mark.parametrize("layout,name", fp.cases(LAYOUTS, MODELS))
def test_each_rank_holds_its_shard_and_logprobs_equal_transformers(fp8, layout, name):
    """Log-probs and expert choices as `family_parity.check_parallel` checks them (under SP each
    TP rank routes its half of the sequence), and each rank's parameters exactly its shard of
    TP=1's."""
    _, _, results, _ = fp8
    fp.check_parallel(_converted(fp8), layout, name, LAYOUTS)
    for rank_out in results["ranks"]:
        errors = rank_out["shards", layout, name]
        assert any("linear_kv_down_proj" in n for n in errors)
        assert max(errors.values()) == 0.0, {n: e for n, e in errors.items() if e}


def _layer0(reads: list) -> dict:
    return {(n, a): (s, e) for n, a, s, e in reads if n.startswith("model.layers.0.self_attn.")}


@pytest.mark.parametrize("name", MODELS)
def test_tp2_each_rank_reads_its_rows_or_columns_and_their_blocks(fp8, name):
    """kv_a_proj_with_mqa and kv_b_proj split by rows, o_proj by columns; each scale read is
    the blocks the rank's slice touches (qlora's 16x32: rank 1's kv_a rows [12, 24) start
    12 rows into block 0, its kv_b rows [56, 112) 8 rows into block 3, its o_proj columns
    [24, 48) 24 into block 0)."""
    _, _, results, _ = fp8
    config = _hf_configs()[name]
    heads = config.num_attention_heads
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    sides = {
        ("kv_a_proj_with_mqa", 0): config.kv_lora_rank + config.qk_rope_head_dim,
        ("kv_b_proj", 0): heads * (config.qk_nope_head_dim + config.v_head_dim),
        ("o_proj", 1): heads * config.v_head_dim,
        ("q_b_proj" if config.q_lora_rank else "q_proj", 0): heads * qk,
    }
    for rank, rank_out in enumerate(results["ranks"]):
        reads = _layer0(rank_out["reads", "tp2_sp", name])
        for (proj, axis), side in sides.items():
            weight = f"model.layers.0.self_attn.{proj}.weight"
            half = side // 2
            assert reads[weight, axis] == (half * rank, half * (rank + 1)), proj
            block = BLOCKS[name][axis]
            first, last = half * rank // block, -(-half * (rank + 1) // block)
            assert reads[weight + "_scale_inv", axis] == (first, last), proj
        assert not any(axis is None for read, axis in reads if "proj" in read), reads


@pytest.mark.parametrize("name", MODELS)
def test_ep2_each_rank_reads_only_its_experts_and_their_scales(fp8, name):
    _, _, results, _ = fp8
    experts = _hf_configs()[name].n_routed_experts
    per_rank = experts // 2
    moe_layers = _hf_configs()[name].num_hidden_layers - 1
    for rank, rank_out in enumerate(results["ranks"]):
        reads = [n for n, *_ in rank_out["reads", "ep2", name] if ".mlp.experts." in n]
        indices = {int(n.split(".mlp.experts.")[1].split(".")[0]) for n in reads}
        assert indices == set(range(per_rank * rank, per_rank * (rank + 1)))
        # gate, up, down of each of its experts in each MoE layer, each with its scales
        assert sum(n.endswith("_scale_inv") for n in reads) == len(reads) // 2
        assert len(reads) // 2 == moe_layers * per_rank * 3


def test_mtp_layer_is_skipped_with_a_note_and_never_read(fp8):
    _, _, results, _ = fp8
    for name in MODELS:
        mtp = f"model.layers.{_hf_configs()[name].num_hidden_layers}."
        every = [results["reads", name]] + [
            r["reads", k, name] for r in results["ranks"] for k in LAYOUTS
        ]
        assert not any(n.startswith(mtp) for reads in every for n, *_ in reads)
        code, stderr, notes = results["tool", name]
        assert code == 0 and stderr == ""
        for text in (" ".join(notes), " ".join(results["notes", name])):  # import, direct load
            assert "num_nextn_predict_layers=1: multi-token-prediction layers" in text
            assert f"({mtp[:-1]} on, where the weights have them) are skipped" in text
            block = "x".join(map(str, BLOCKS[name]))
            assert f"fp8 weights ({block} block scales) are dequantised on load" in text


@pytest.mark.parametrize(
    "case,message",
    [
        (
            "short",
            f"tensor {BROKEN}_scale_inv: shape (1, 2) does not match the 16x32 blocks of {BROKEN}",
        ),
        ("missing", f"tensor {MISSING} is torch.float8_e4m3fn without a {MISSING}_scale_inv"),
    ],
)
def test_a_bad_or_missing_scale_is_one_line_naming_the_tensor(fp8, case, message):
    _, _, results, _ = fp8
    direct = results["direct", case]
    assert direct is not None and "\n" not in direct and message in direct, direct
    code, stderr, _ = results["tool", case]
    assert code == 2 and stderr.count("\n") == 1 and stderr.startswith("error: "), stderr
    if case == "short":  # the converter reads the whole scale: the same fact, as it sees it
        message = f"tensor {BROKEN}: scale shape (1, 2) does not match the (2, 2) blocks"
    assert message in stderr, stderr


def test_export_writes_bf16_without_quantization_config_or_mtp(fp8):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    root, _, results, dequantised = fp8
    code, stderr, notes = results["export"]
    assert code == 0 and stderr == "", stderr
    text = " ".join(notes)
    assert "fp8 block-scaled weights were dequantised on load and are written as bfloat16" in text
    assert "1 multi-token-prediction layer(s) were not read and are not written" in text
    export = root / "qlora" / "export"
    config = json.loads((export / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    assert config["num_nextn_predict_layers"] == 0
    written, want = load_file(export / "model.safetensors"), dequantised["qlora"]
    assert sorted(written) == sorted(want)
    for name, tensor in written.items():
        assert torch.equal(tensor, want[name].to(torch.bfloat16)), name

    def bf16_logits(path: Path) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        return fp.hf_run(model.eval())[0]

    assert torch.equal(bf16_logits(export), bf16_logits(root / "qlora" / "deq"))
