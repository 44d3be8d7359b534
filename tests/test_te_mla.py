"""DeepSeek-V3's multi-latent attention on Transformer Engine, run on CPU: the product's MLA layer
for `model.attention_backend=te` (`models/mla.py`: local MLA linears and norms, megatron-core's
`TEDotProductAttention` as core attention), with that class compiled over the TE 2.9 stand-in
(`te_standin` / `te_attention_standin`, which computes TE's attention), one process.

The model is `test_deepseek_v3`'s `qlora` (q-LoRA, value head dim 12 != qk head dim 16 + 8,
YaRN factor 4 with mscale_all_dim 0.7, so the softmax scale is not 1/√24), loaded straight from
its Hugging Face directory. Shown: log-probs equal `transformers`' within 1e-5 relative padded
(`sbhd`) and packed (`thd`), rows of different lengths packed = padded, the same experts per
token; TE received k_channels 24, v_channels 12 and megatron's YaRN softmax scale (worked out
here by hand), and without that scale the log-probs move; the parameter names are the SDPA
build's, so checkpoints move between the backends. At TP=2 × SP (one 2-rank run) the log-probs
still equal `transformers`' and every gradient of a DPO-shaped loss equals TP=1's.
"""

from __future__ import annotations

import math

import family_parity as fp
import pytest
import torch
from multirank import run_multirank
from test_deepseek_v3 import _grad_errors, _hf_configs, _loss_grads
from test_glm4_moe import _row_sums

NAME = "qlora"
#: megatron-core's MLA softmax scale by hand: YaRN mscale(4, 0.7) = 0.1·0.7·ln 4 + 1, squared,
#: over √(qk_nope 16 + qk_rope 8).
SCALE = (0.1 * 0.7 * math.log(4.0) + 1.0) ** 2 / math.sqrt(24)


def _relative_error(logprobs: torch.Tensor, name: str, reference: dict) -> float:
    want = fp.reference_logprobs(reference[name]["logits"])
    return ((logprobs - want).abs() / want.abs().clamp(min=1.0)).max().item()


def _sdpa_chunk(arch, rt):
    """The same model built on SDPA (its parameter names are the TE build's)."""
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks

    return build_gpt_chunks(arch, ParallelLayout(attention_backend="sdpa"), rt.device)[0]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from te_attention_standin import CALLS
    from te_standin import te_spec_models

    from megatron_kto.models.builder import unwrap
    from megatron_kto.runtime import init_runtime, teardown

    root = tmp_path_factory.mktemp("te_mla")
    reference = fp.sigmoid_moe_references(root, {NAME: _hf_configs()[NAME]})
    hf_dir = root / NAME / "hf"
    rt = init_runtime(1, 1, seed=9)
    out: dict = {"reference": reference}
    try:
        with te_spec_models(attention="te"):
            arch, chunks = fp.restore_and_run(hf_dir, fp.Layout(), rt)
        out["sdpa_names"] = [n for n, _ in _sdpa_chunk(arch, rt).named_parameters()]
        out["te_names"] = [n for n, _ in chunks[0].named_parameters()]
        cores = [m.self_attention.core_attention for m in unwrap(chunks[0]).decoder.layers]
        out["cores"] = {type(c).__name__ for c in cores}
        CALLS.clear()
        out["padded"] = fp.forward(arch, chunks)
        out["padded_calls"] = list(CALLS)
        CALLS.clear()
        out["packed_sums"] = _row_sums(arch, chunks, pack=True)
        out["packed_calls"] = list(CALLS)
        out["packed_vs_padded"] = fp.packed_vs_padded(arch, chunks[0])
        torch.save(_loss_grads(arch, chunks[0]), root / "tp1_grads.pt")
        for core in cores:  # TE's own default scale instead of megatron's: must be wrong
            core.softmax_scale = 1.0 / math.sqrt(24)
        out["default_scale"] = fp.forward(arch, chunks)[0]
    finally:
        teardown()
    out["tp2_sp"] = run_multirank(_tp2_sp_worker, 2, str(root), timeout=300)
    return out


def _tp2_sp_worker(rank: int, world_size: int, root: str) -> dict:
    """TP=2 with SP (MoE at TP > 1 requires it) on TE's attention: log-probs, packed row sums, and
    every gradient's error against TP=1's (`test_deepseek_v3._grad_errors`)."""
    from pathlib import Path

    from te_standin import te_spec_models

    from megatron_kto.runtime import init_runtime, teardown

    rt = init_runtime(2, 1, seed=9)
    with te_spec_models(attention="te"):
        arch, chunks = fp.restore_and_run(Path(root) / NAME / "hf", fp.Layout(tp=2, sp=True), rt)
    want = torch.load(Path(root) / "tp1_grads.pt", weights_only=True)
    out = {
        "padded": fp.forward(arch, chunks)[0],
        "packed_sums": _row_sums(arch, chunks, pack=True),
        "grad_errors": _grad_errors(_loss_grads(arch, chunks[0]), want, arch, chunks[0]),
    }
    teardown()
    return out


def test_te_core_attention_in_the_mla_layers(results):
    assert results["cores"] == {"TEDotProductAttention"}
    assert results["te_names"] == results["sdpa_names"]


def test_te_received_mla_head_dims_and_softmax_scale(results):
    calls = results["padded_calls"] + results["packed_calls"]
    assert {c["qkv_format"] for c in results["padded_calls"]} == {"sbhd"}
    assert {c["qkv_format"] for c in results["packed_calls"]} == {"thd"}
    assert {c["kv_channels"] for c in calls} == {(24, 12)}
    scales = {c["softmax_scale"] for c in calls}
    assert len(scales) == 1 and math.isclose(scales.pop(), SCALE, rel_tol=1e-12)


def test_padded_logprobs_and_choices_equal_transformers(results):
    reference = results["reference"]
    logprobs, maps = results["padded"]
    error = _relative_error(logprobs, NAME, reference)
    print(f"\nte padded: max relative |Δ logp| {error:.2e}")
    assert error <= fp.RELATIVE
    choices = reference[NAME]["choices"]
    assert len(maps) == len(choices) == 1
    assert all(torch.equal(a, b) for a, b in zip(maps, choices, strict=True))
    default = _relative_error(results["default_scale"], NAME, reference)
    assert default > fp.RELATIVE, default  # the same check fails without the YaRN scale


def test_packed_logprobs_equal_transformers(results):
    want = fp.reference_logprobs(results["reference"][NAME]["logits"]).sum(-1)
    got = results["packed_sums"]
    error = ((got - want).abs() / want.abs()).max().item()
    print(f"\nte packed row sums: max relative error {error:.2e}")
    assert error <= fp.RELATIVE
    assert results["packed_vs_padded"] <= 1e-5


def test_tensor_parallel_sp_equals_transformers_and_tp1_gradients(results):
    """TP=2 × SP: each rank's TE attention takes its heads; the rotated key's gradient is still
    summed over TP (`LatentSelfAttention`), so every gradient equals TP=1's."""
    reference = results["reference"]
    want_sums = fp.reference_logprobs(reference[NAME]["logits"]).sum(-1)
    for rank_out in results["tp2_sp"]:
        assert _relative_error(rank_out["padded"], NAME, reference) <= fp.RELATIVE
        sums = rank_out["packed_sums"]
        assert ((sums - want_sums).abs() / want_sums.abs()).max().item() <= fp.RELATIVE
        errors = rank_out["grad_errors"]
        assert len(errors) > 10 and any("linear_kv_down_proj" in n for n in errors)
        worst = max(errors, key=errors.get)
        print(f"\nte TP2 x SP: worst gradient error {worst} {errors[worst]:.2e}")
        assert errors[worst] < 1e-5, (worst, errors[worst])
