"""Qwen3-Next (hybrid gated DeltaNet / gated attention, MoE + gated shared expert) against
`transformers`' Qwen3NextForCausalLM on a tiny random model in fp32.

The model has both layer kinds and both MLP kinds (layers: DeltaNet+MoE, attention+dense,
DeltaNet+MoE, attention+MoE), grouped DeltaNet value heads (4 value heads over 2 key heads),
partial RoPE (0.25), GQA, a padded vocabulary; norms are moved away from their init and routers
get large weights, so every tensor shows. Shown here, in one single-process run and ONE 2-rank run:

* import -> our logits equal HF's (max |Δ| / max |logit| <= 1e-5) at TP=1, TP=2 and PP=2 (each
  stage holds both layer kinds), padded, and packed (rows of different lengths end to end: a
  DeltaNet state or convolution window leaking across rows would break it) at TP=1 and TP=2;
* export -> the safetensors equal the source bit for bit;
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


def _hf_config():
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=24, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=48, shared_expert_intermediate_size=40, mlp_only_layers=[1],
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        max_position_embeddings=64, rms_norm_eps=1e-6,
    )  # fmt: skip


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


def _run(root: str, tp: int, pp: int, rt, packed: bool):
    from megatron_kto.checkpointing.model_io import read_architecture
    from megatron_kto.checkpointing.pretrained import restore_pretrained
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks

    ckpt = Path(root) / "mcore"
    arch = read_architecture(ckpt)
    layout = ParallelLayout(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pack_sequences=packed
    )
    chunks = build_gpt_chunks(arch, layout, rt.device)
    restore_pretrained(ckpt, chunks)
    return _forward(chunks, packed)


def _convert_worker(rank: int, world_size: int, root: str) -> dict:
    from megatron_kto.hf_writer.convert import export_hf, import_hf
    from megatron_kto.models.builder import ParallelLayout, make_transformer_config
    from megatron_kto.runtime import init_runtime, teardown

    arch = import_hf(Path(root) / "hf", Path(root) / "mcore")
    rt = init_runtime(1, 1, seed=9)  # a different init: only the checkpoint can match
    out = {"tp1": _run(root, 1, 1, rt, False), "tp1-packed": _run(root, 1, 1, rt, True)}
    try:
        make_transformer_config(arch, ParallelLayout(context_parallel_size=2))
    except ValueError as e:
        out["cp-error"] = str(e)
    teardown()
    export_hf(Path(root) / "mcore", Path(root) / "export")
    return out


def _layout_worker(rank: int, world_size: int, root: str) -> dict:
    from megatron_kto.runtime import init_runtime, teardown

    out = {}
    for name, (tp, pp) in LAYOUTS.items():
        rt = init_runtime(tp, pp, seed=9)
        out[name] = _run(root, tp, pp, rt, False)
        if pp == 1:
            out[f"{name}-packed"] = _run(root, tp, pp, rt, True)
    teardown()
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("qwen3_next")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_hf_config(), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("bias", "dt_bias")):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("gate.weight"):  # routers: decisive, far from ties
                p.normal_(0.0, 1.0)
        reference = model(_tokens()).logits.float()
    model.save_pretrained(root / "hf")
    results = run_multirank(_convert_worker, 1, str(root), timeout=600)[0]
    for rank_out in run_multirank(_layout_worker, 2, str(root), timeout=600):
        for key, value in rank_out.items():
            if value is not None:
                results.setdefault(key, value)
    return root, reference, results


def _kept(reference: torch.Tensor) -> torch.Tensor:
    """HF's logits at each row's kept positions, rows concatenated (the packed layout)."""
    return torch.cat([reference[r, : n - 1] for r, n in enumerate(ROW_LENGTHS)])


@pytest.mark.parametrize("layout", ["tp1", "tp2", "pp2", "tp1-packed", "tp2-packed"])
def test_logits_equal_transformers(converted, layout):
    _, reference, results = converted
    ours = results[layout]
    want = _kept(reference) if layout.endswith("packed") else reference
    assert ours.shape == want.shape
    rel = ((ours - want).abs().max() / want.abs().max()).item()
    print(f"qwen3_next {layout}: max|Δ logits| / max|logits| {rel:.2e}")
    assert rel <= TOLERANCE


def test_export_is_bit_exact(converted):
    from safetensors.torch import load_file

    root, _, _ = converted

    def tensors(d: Path) -> dict[str, torch.Tensor]:
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            out.update(load_file(f))
        return out

    src, back = tensors(root / "hf"), tensors(root / "export")
    assert sorted(src) == sorted(back)
    for name in src:
        assert torch.equal(src[name], back[name]), name


def test_context_parallel_is_refused_naming_the_deltanet_layers(converted):
    _, _, results = converted
    message = results["cp-error"]
    assert "\n" not in message and "[0, 2]" in message and "context_parallel_size" in message
