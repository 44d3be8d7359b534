"""Qwen3-Next and Qwen3.5 (hybrid gated DeltaNet / gated attention) against `transformers`
(Qwen3NextForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM) on tiny random models in fp32.

Every model has both layer kinds (DeltaNet, attention, DeltaNet, attention), grouped DeltaNet
value heads (4 value heads over 2 key heads), partial RoPE (0.25), GQA, a padded vocabulary;
Qwen3-Next mixes MoE (+ gated shared expert) and dense MLPs (`mlp_only_layers=[1]`), Qwen3.5 is
dense, Qwen3.5-MoE has experts everywhere. Norms are moved away from their init and routers get
large weights, so every tensor shows. Shown here, in one single-process run and ONE 2-rank run:

* import -> our logits equal HF's (max |Δ| / max |logit| <= 1e-5) at TP=1, TP=2, TP=2 with
  sequence parallelism, EP=2 and TP=2 x EP=2 (+SP; MoE models) and PP=2 (each
  stage holds both layer kinds), padded, and packed (rows of different lengths end to end: a
  DeltaNet state or convolution window leaking across rows would break it) at TP=1 and TP=2;
* export -> the safetensors equal the source bit for bit, and `transformers` loads them with
  identical logits;
* context parallelism is refused in one line naming the DeltaNet layers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from multirank import run_multirank

VOCAB, SEQ, BATCH = 100, 24, 4
TOLERANCE = 1e-5
#: Scored length of each row (labels -100 after): packed rows are these minus one long.
ROW_LENGTHS = (24, 11, 17, 6)
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}
MODELS = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
MOE_MODELS = ("qwen3_next", "qwen3_5_moe_text")
#: Expert-parallel layouts of the MoE models: name -> TP (EP 2, expert TP 1).
EP_LAYOUTS = {"ep2": 1, "tp2ep2sp": 2}
#: Vision-language checkpoints: their language model is read (TP=1 only here), exported as text.
VL_MODELS = {"qwen3_5_vl": "qwen3_5_text", "qwen3_5_moe_vl": "qwen3_5_moe_text"}


def _hf_configs() -> dict:
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5TextConfig
    from transformers.models.qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeTextConfig

    common = dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=24, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        max_position_embeddings=64, rms_norm_eps=1e-6,
    )  # fmt: skip
    moe = dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        shared_expert_intermediate_size=40,
    )  # fmt: skip
    vision = dict(
        depth=1, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
        patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
    )  # fmt: skip
    return {
        "qwen3_5_vl": Qwen3_5Config(
            text_config=dict(intermediate_size=96, **common), vision_config=vision
        ),
        "qwen3_5_moe_vl": Qwen3_5MoeConfig(text_config=dict(**moe, **common), vision_config=vision),
        "qwen3_next": Qwen3NextConfig(intermediate_size=96, mlp_only_layers=[1], **moe, **common),
        "qwen3_5_text": Qwen3_5TextConfig(intermediate_size=96, **common),
        "qwen3_5_moe_text": Qwen3_5MoeTextConfig(**moe, **common),
    }


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))


def _micro_batches(packed: bool) -> list[dict]:
    from megatron_kto.models.packing import host_row_lengths, pack_micro_batch

    tokens = _tokens()
    labels = torch.cat([tokens[:, 1:], torch.full((BATCH, 1), -100)], dim=1)
    for row, n in enumerate(ROW_LENGTHS):
        labels[row, n - 1 :] = -100
    positions = torch.arange(SEQ).expand(BATCH, SEQ).clone()
    micro = [
        {
            "tokens": tokens[i : i + 2],
            "labels": labels[i : i + 2],
            "position_ids": positions[i : i + 2],
        }
        for i in range(0, BATCH, 2)
    ]
    if packed:
        micro = [pack_micro_batch(m, host_row_lengths(m["labels"])) for m in micro]
    return micro


def _forward(chunks, packed: bool):
    """Logits (padded: [B, T, V]; packed: each row's kept positions, concatenated [ΣL, V])
    through megatron-core's schedule, two micro-batches; None off the last pipeline stage."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_kto.models.forward import eval_mode, gpt_forward_step
    from megatron_kto.models.schedule import run_schedule

    def outputs(batch, logits):
        return gather_from_tensor_model_parallel_region(logits)[..., :VOCAB].clone()

    with torch.no_grad(), eval_mode(chunks):
        results = run_schedule(
            chunks,
            _micro_batches(packed),
            gpt_forward_step(outputs),
            forward_only=True,
            collect_non_loss_data=True,
        )
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    if packed:
        return torch.cat([r[0] for r in results])
    return torch.cat(results)


def _run(root: Path, tp: int, pp: int, rt, packed: bool, sp: bool = False, ep: int = 1):
    from megatron_kto.checkpointing.model_io import read_architecture
    from megatron_kto.checkpointing.pretrained import restore_pretrained
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks

    ckpt = root / "mcore"
    arch = read_architecture(ckpt)
    layout = ParallelLayout(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pack_sequences=packed,
        sequence_parallel=sp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1 if ep > 1 else None,
    )
    chunks = build_gpt_chunks(arch, layout, rt.device)
    restore_pretrained(ckpt, chunks)
    return _forward(chunks, packed)


def _convert_worker(rank: int, world_size: int, root: str) -> dict:
    from megatron_kto.hf_writer.convert import export_hf, import_hf
    from megatron_kto.models.builder import ParallelLayout, make_transformer_config
    from megatron_kto.runtime import init_runtime, teardown

    out = {}
    for name in MODELS:
        base = Path(root) / name
        arch = import_hf(base / "hf", base / "mcore")
        rt = init_runtime(1, 1, seed=9)  # a different init: only the checkpoint can match
        out[name, "tp1"] = _run(base, 1, 1, rt, False)
        out[name, "tp1-packed"] = _run(base, 1, 1, rt, True)
        out[name, "tp1", "grads"] = {k: g for k, (g, _) in _grads(base, 1, rt).items()}
        try:
            make_transformer_config(arch, ParallelLayout(context_parallel_size=2))
        except ValueError as e:
            out[name, "cp-error"] = str(e)
        teardown()
        export_hf(base / "mcore", base / "export")
    for name in VL_MODELS:
        base = Path(root) / name
        import_hf(base / "hf", base / "mcore")
        rt = init_runtime(1, 1, seed=9)
        out[name, "tp1"] = _run(base, 1, 1, rt, False)
        out[name, "sliced"] = _sliced_paths(base, 1, 1, rt, VL_MODELS[name])
        teardown()
        export_hf(base / "mcore", base / "export")
    return out


def _sliced_paths(base: Path, tp: int, pp: int, rt, family: str | None = None) -> dict:
    """This rank's chunks loaded straight from the HF directory (only its slices) vs restored
    from the imported checkpoint: parameters differing (names); and the HF writer's gathers
    (`StageTensors.get`, collective over TP) vs the whole TP=1 tensors of the HF files: tensors
    differing (names)."""
    from megatron_kto.checkpointing.hf_source import load_hf_model
    from megatron_kto.checkpointing.model_io import read_architecture
    from megatron_kto.checkpointing.pretrained import restore_pretrained
    from megatron_kto.conversion.addressing import ChunkLayout, norm_names
    from megatron_kto.conversion.mappings import to_megatron
    from megatron_kto.conversion.safetensors_io import HFWeights
    from megatron_kto.hf_writer.gather import StageTensors
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks, unwrap

    arch = read_architecture(base / "mcore")
    layout = ParallelLayout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    restored = build_gpt_chunks(arch, layout, rt.device)
    restore_pretrained(base / "mcore", restored)
    direct = build_gpt_chunks(arch, layout, rt.device)
    load_hf_model(base / "hf", direct)
    load_diff = [
        name
        for a, b in zip(restored, direct)
        for (name, p), (_, q) in zip(unwrap(a).named_parameters(), unwrap(b).named_parameters())
        if not torch.equal(p, q)
    ]
    weights = HFWeights(base / "hf")
    params = {n for c in restored for n, _ in unwrap(c).named_parameters()}
    whole = dict(
        to_megatron(
            weights.get, arch, arch.padded_vocab_size, norm_names(params), family or base.name
        )
    )
    stage = StageTensors(restored, arch, family or base.name)
    held = sorted(
        str(ChunkLayout.of(unwrap(c)).to_global(n))
        for c in restored
        for n, _ in unwrap(c).named_parameters()
    )
    gather_diff = [n for n in held if "layers" in n and not torch.equal(stage.get(n), whole[n])]
    return {"load": load_diff, "gather": gather_diff}


def _grads(base: Path, tp: int, rt, sp: bool = False) -> dict:
    """Gradients of every replicated (not tensor-parallel) parameter of the layers after one
    backward of a fixed function of the logits, as one rank holds them before megatron's
    gradient finalisation (which sums only sequence-parallel norms and Q/K norms over TP)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_kto.checkpointing.model_io import read_architecture
    from megatron_kto.checkpointing.pretrained import restore_pretrained
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks, unwrap

    arch = read_architecture(base / "mcore")
    layout = ParallelLayout(tensor_model_parallel_size=tp, sequence_parallel=sp)
    (chunk,) = build_gpt_chunks(arch, layout, rt.device)
    restore_pretrained(base / "mcore", [chunk])
    tokens = _tokens()
    logits = chunk(tokens, torch.arange(SEQ).expand(BATCH, SEQ), None)
    logits = gather_from_tensor_model_parallel_region(logits)[..., :VOCAB]
    weight = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3))
    (logits * weight).sum().backward()
    # (gradient, whether megatron's finalize_model_grads sums it over TP)
    return {
        n: (
            p.grad.clone(),
            (sp and getattr(p, "sequence_parallel", False))
            or "q_layernorm" in n
            or "k_layernorm" in n,
        )
        for n, p in unwrap(chunk).named_parameters()
        if "out_norm" in n or "layernorm" in n
    }


def _layout_worker(rank: int, world_size: int, root: str) -> dict:
    from megatron.core import parallel_state

    from megatron_kto.runtime import init_runtime, teardown

    out = {}
    for layout, (tp, pp) in LAYOUTS.items():
        rt = init_runtime(tp, pp, seed=9)
        for name in MODELS:
            out[name, layout] = _run(Path(root) / name, tp, pp, rt, False)
            if pp == 1:
                out[name, f"{layout}-packed"] = _run(Path(root) / name, tp, pp, rt, True)
            if tp == 2:  # sequence parallelism: DeltaNet's in_proj gathers, out_proj scatters
                out[name, f"{layout}sp"] = _run(Path(root) / name, tp, pp, rt, False, sp=True)
            out[name, layout, "sliced", rank] = _sliced_paths(Path(root) / name, tp, pp, rt)
            if tp == 2:  # MoE with TP trains only with sequence parallelism (megatron-core)
                for sp in (True,) if "moe" in name or "next" in name else (False, True):
                    out[name, layout, "grads", sp, rank] = _grads(Path(root) / name, tp, rt, sp)
    # Expert parallelism: each rank holds half of the experts (EP2 x DP2, and EP2 across the two
    # TP ranks with expert TP 1, MoE + TP needing sequence parallelism).
    for layout, tp in EP_LAYOUTS.items():
        rt = init_runtime(tp, 1, seed=9, expert_parallel_size=2, expert_tensor_parallel_size=1)
        out[layout, "ep_size"] = parallel_state.get_expert_model_parallel_world_size()
        for name in MOE_MODELS:
            out[name, layout] = _run(Path(root) / name, tp, 1, rt, False, sp=tp > 1, ep=2)
    teardown()
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("hybrid")
    reference = {}
    for name, config in _hf_configs().items():
        torch.manual_seed(0)
        if name in VL_MODELS:
            from transformers import AutoModelForImageTextToText

            model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
        else:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "norm" in pname or pname.endswith(("bias", "dt_bias")):
                    p.add_(0.1 * torch.randn_like(p))
                elif pname.endswith("gate.weight"):  # routers: decisive, far from ties
                    p.normal_(0.0, 1.0)
            reference[name] = model(_tokens()).logits.float()
        model.save_pretrained(root / name / "hf")
    results = run_multirank(_convert_worker, 1, str(root), timeout=600)[0]
    for rank_out in run_multirank(_layout_worker, 2, str(root), timeout=600):
        for key, value in rank_out.items():
            if value is not None:
                results.setdefault(key, value)
    return root, reference, results


def _kept(reference: torch.Tensor) -> torch.Tensor:
    """HF's logits at each row's kept positions, rows concatenated (the packed layout)."""
    return torch.cat([reference[r, : n - 1] for r, n in enumerate(ROW_LENGTHS)])


CASES = [
    (n, lay) for n in MODELS for lay in ("tp1", "tp2", "tp2sp", "pp2", "tp1-packed", "tp2-packed")
] + [(n, lay) for n in MOE_MODELS for lay in EP_LAYOUTS]


@pytest.mark.parametrize("name,layout", CASES, ids=[f"{n}-{lay}" for n, lay in CASES])
def test_logits_equal_transformers(converted, name, layout):
    _, reference, results = converted
    if layout in EP_LAYOUTS:
        assert results[layout, "ep_size"] == 2
    ours = results[name, layout]
    want = _kept(reference[name]) if layout.endswith("packed") else reference[name]
    assert ours.shape == want.shape
    rel = ((ours - want).abs().max() / want.abs().max()).item()
    print(f"{name} {layout}: max|Δ logits| / max|logits| {rel:.2e}")
    assert rel <= TOLERANCE


@pytest.mark.parametrize("name", MODELS)
def test_export_is_bit_exact_and_loads_in_transformers(converted, name):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    root, reference, _ = converted

    def tensors(d: Path) -> dict[str, torch.Tensor]:
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            out.update(load_file(f))
        return out

    src, back = tensors(root / name / "hf"), tensors(root / name / "export")
    assert sorted(src) == sorted(back)
    for key in src:
        assert torch.equal(src[key], back[key]), key
    model = AutoModelForCausalLM.from_pretrained(root / name / "export", dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(model.eval()(_tokens()).logits.float(), reference[name])


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_direct_load_and_writer_gathers_equal_the_whole_tensors(converted, name, layout):
    """Direct HF loading at TP2 / PP2 (each rank reads only its slices) gives the restored
    checkpoint's parameters bit for bit, and the HF writer's TP gathers give back the whole
    tensors bit for bit — DeltaNet's in_proj / conv1d shares and the gated QKV included."""
    _, _, results = converted
    for rank in range(2):
        assert results[name, layout, "sliced", rank] == {"load": [], "gather": []}


@pytest.mark.parametrize("name", MODELS)
def test_norm_gradients_at_tp2_equal_tp1(converted, name):
    """Every norm weight's gradient at TP2 (with and without sequence parallelism), as megatron's
    gradient finalisation leaves it — summed over the TP ranks where it sums them (sequence-
    parallel norms, Q/K norms), else as each rank holds it — equals TP1's (≤ 1e-5 relative). The
    DeltaNet output norm's weight serves the value heads the ranks split: each rank's own share
    alone would fail this."""
    _, _, results = converted
    want = results[name, "tp1", "grads"]
    runs = [k for k in results if k[:3] == (name, "tp2", "grads")]
    assert runs
    for sp in {k[3] for k in runs}:
        ranks = [results[name, "tp2", "grads", sp, r] for r in range(2)]
        assert sorted(ranks[0]) == sorted(want)
        for key, expected in want.items():
            (g0, summed), (g1, _) = ranks[0][key], ranks[1][key]
            for got in [g0 + g1] if summed else [g0, g1]:
                rel = ((got - expected).abs().max() / expected.abs().max()).item()
                assert rel <= TOLERANCE, (key, sp, rel)


@pytest.mark.parametrize("name", VL_MODELS)
def test_vision_language_checkpoints_give_their_language_model(converted, name):
    """A Qwen3.5 (MoE) vision-language checkpoint: its language model (`model.language_model.*`,
    `text_config`) imports and loads directly with the text model's logits, the vision tower is
    ignored, and the export is the text model (`qwen3_5_text` / `qwen3_5_moe_text`)."""
    import json

    root, reference, results = converted
    rel = (
        (results[name, "tp1"] - reference[name]).abs().max() / reference[name].abs().max()
    ).item()
    print(f"{name} tp1: max|Δ logits| / max|logits| {rel:.2e}")
    assert rel <= TOLERANCE
    assert results[name, "sliced"] == {"load": [], "gather": []}
    exported = json.loads((root / name / "export" / "config.json").read_text())
    assert exported["model_type"] == VL_MODELS[name] and "vision_config" not in exported


@pytest.mark.parametrize("name", MODELS)
def test_context_parallel_is_refused_naming_the_deltanet_layers(converted, name):
    _, _, results = converted
    message = results[name, "cp-error"]
    assert "\n" not in message and "[0, 2]" in message and "context_parallel_size" in message
