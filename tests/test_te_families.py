"""Gemma 3's layers and GPT-OSS's attention sinks on Transformer Engine, run on CPU: our TE layer
spec (megatron-core's TE wrappers over the TE 2.9 stand-ins `te_standin` / `te_attention_standin`,
its real `TEDotProductAttention` included) against our SDPA on the local spec, one process.

* Gemma 3 (`gemma3_arch`: windows of 5 in layers 1 and 3, a local RoPE base there, (1 + w) pre-,
  post- and Q/K norms, GeGLU, `query_pre_attn_scalar`'s softmax scale): `te_gemma_layer` keeps
  TE's fused norm + linear (`linear_qkv.layer_norm_weight`, `zero_centered_gamma`) and adds our
  post-norms and local RoPE; a local-spec checkpoint loads into it unchanged; windows reach TE's
  attention in the local layers only.
* GPT-OSS (a tiny `transformers` config converted: sinks set far from 0, q/k/v/o biases,
  windows of 8 in layers 0 and 2, YaRN, biased experts — the local spec's, inside the TE layer:
  `te_layer_with_local_experts`): megatron-core's `softmax_type="learnable"` gives TE's `softmax_offset`, which our
  `core_attention.softmax_offset` checkpoint entry fills; the stand-in computes TE's learnable
  softmax. Packed (`thd`) needs TE 2.12: TE 2.9 refuses it (as `get_attention_backend` leaves no
  backend), 2.12 runs it.

Per-row log-probs equal the SDPA path to 1e-5, padded (`sbhd`) and packed (`thd`).
"""

from __future__ import annotations

import pytest
import torch
from test_parallel_common import gemma3_arch
from test_te_sliding_window import _batch

from megatron_kto.models.forward import LOGP_SUM, forward_sequence_stats

TOL = 1e-5


def _gpt_oss_arch():
    """`test_gpt_oss`'s tiny GPT-OSS (`transformers`' config, converted): sinks, q/k/v/o biases,
    windows of 8 in layers 0 and 2, YaRN, 4 biased experts (top-2, clamped GLU)."""
    from test_gpt_oss import _hf_config

    from megatron_kto.conversion.hf_config import architecture_from_hf

    arch = architecture_from_hf(_hf_config().to_dict())
    arch.padded_vocab_size = arch.vocab_size
    arch.init_method_std = 0.1
    return arch


def _logps(chunks, pack: bool, vocab: int) -> torch.Tensor:
    """Per-row log-prob sums of `test_te_sliding_window`'s batch (rows of up to 14 tokens)."""
    with torch.no_grad():
        return forward_sequence_stats(chunks, *_batch(), 4, vocab, chunk_size=8, pack=pack)[
            :, LOGP_SUM
        ]


def _pair(root, arch, device, prepare=None):
    """(local-spec chunks, TE-spec chunks with the local one's checkpoint loaded)."""
    from te_standin import te_spec_models

    from megatron_kto.checkpointing.model_io import load_model, save_model
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks

    local = build_gpt_chunks(arch, ParallelLayout(), device)
    if prepare is not None:
        prepare(local)
    save_model(root, local, arch)
    with te_spec_models(attention="te"):
        te = build_gpt_chunks(arch, ParallelLayout(), device)
    # TE leaves its sink logits uninitialised (NaN in the stand-in): the builder fills them.
    sinks = [p for n, p in te[0].named_parameters() if n.endswith("softmax_offset")]
    assert all(p.isfinite().all() for p in sinks) and len(sinks) == 4 * arch.attention_sinks
    load_model(root, te)
    return local, te


def _set_sinks(chunks) -> None:
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in chunks[0].named_parameters():
            if name.endswith("softmax_offset"):
                param.copy_(torch.randn(param.shape, generator=g) * 2)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from megatron.core import utils as mcore_utils
    from packaging.version import Version
    from te_attention_standin import CALLS, TEContractError

    from megatron_kto.models.builder import unwrap
    from megatron_kto.runtime import init_runtime, teardown

    runtime = init_runtime(1, 1, seed=2)
    out: dict = {}
    try:
        gemma = gemma3_arch(hidden_size=32, ffn_hidden_size=64, kv_channels=16)
        vocab = gemma.vocab_size
        local, te = _pair(tmp_path_factory.mktemp("gemma_te"), gemma, runtime.device)
        layers = unwrap(te[0]).decoder.layers
        out["gemma_names"] = {n for n, _ in te[0].named_parameters()}
        out["gemma_windows"] = [layer.self_attention.core_attention.window_size for layer in layers]
        for pack in (False, True):
            CALLS.clear()
            out["gemma", pack] = _logps(local, pack, vocab), _logps(te, pack, vocab)
            out["gemma_calls", pack] = [(c["qkv_format"], c["window_size"]) for c in CALLS]

        oss = _gpt_oss_arch()
        assert oss.attention_sinks and oss.num_moe_experts and oss.sliding_window == 8
        vocab = oss.vocab_size
        local, te = _pair(tmp_path_factory.mktemp("sinks_te"), oss, runtime.device, _set_sinks)
        CALLS.clear()
        out["sinks", False] = _logps(local, False, vocab), _logps(te, False, vocab)
        out["sinks_types"] = {c["softmax_type"] for c in CALLS}
        out["sinks_windows"] = [c["window_size"] for c in CALLS]
        try:  # the stand-in is TE 2.9 (the image's): no backend takes thd with sinks
            _logps(te, True, vocab)
        except TEContractError as err:
            out["sinks_thd_2.9"] = str(err)
        saved = mcore_utils._te_version
        mcore_utils._te_version = Version("2.12.0")
        try:
            out["sinks", True] = _logps(local, True, vocab), _logps(te, True, vocab)
        finally:
            mcore_utils._te_version = saved
        with torch.no_grad():  # without the sinks' mass the TE path must move
            for layer in unwrap(te[0]).decoder.layers:
                layer.self_attention.core_attention.softmax_offset.fill_(-1e4)
        out["no_sinks"] = _logps(te, False, vocab)
        return out
    finally:
        teardown()


def test_gemma_te_layer_fuses_norms_and_windows_local_layers(results):
    names = results["gemma_names"]
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names
    for norm in ("self_attention.post_norm", "mlp.post_norm", "self_attention.q_layernorm"):
        assert f"decoder.layers.0.{norm}.weight" in names
    assert results["gemma_windows"] == [(4, 0), None, (4, 0), None]
    assert results["gemma_calls", False] == [("sbhd", (4, 0)), ("sbhd", None)] * 2
    assert results["gemma_calls", True] == [("thd", (4, 0)), ("thd", None)] * 2


@pytest.mark.parametrize("family", ["gemma", "sinks"])
@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_te_logprobs_equal_sdpa(results, family, pack):
    sdpa, te = results[family, pack]
    print(f"\n{family} sdpa {sdpa.tolist()}\n{family} te   {te.tolist()}")
    torch.testing.assert_close(te, sdpa, rtol=TOL, atol=TOL)


def test_te_sinks_are_learnable_softmax_and_matter(results):
    assert results["sinks_types"] == {"learnable"}
    assert results["sinks_windows"] == [(7, 0), None] * 2  # GPT-OSS: layers 0, 2 slide
    assert "thd before 2.12" in results["sinks_thd_2.9"]
    sdpa, _ = results["sinks", False]
    assert (results["no_sinks"] - sdpa).abs().max() > 1e-2


def test_the_product_te_branch_builds_these_layers():
    """`layer_specs.decoder_block_spec(..., 'te')` itself (megatron-core's TE spec, built without TE
    by `te_spec`): Gemma 3 gets TE's fused norm + linear and attention inside our Gemma modules,
    GPT-OSS TE's attention with the local spec's biased experts and pre-MLP norm."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    from te_standin import image_te_version, te_spec

    from megatron_kto.models.builder import ParallelLayout, make_transformer_config
    from megatron_kto.models.gemma_layers import GemmaSelfAttention, LayerExtras, PostNormMLP
    from megatron_kto.models.layer_specs import decoder_block_spec
    from megatron_kto.models.norms import LocalNorm

    _, te = te_spec(image_te_version())
    gemma = gemma3_arch()
    config = make_transformer_config(gemma, ParallelLayout())
    layer = decoder_block_spec(config, "RMSNorm", "te", None, LayerExtras.of(gemma)).submodules
    attn = layer.self_attention
    assert attn.module is GemmaSelfAttention and layer.mlp.module is PostNormMLP
    assert attn.params["post_norm"] and attn.params["local_rotary"][:2] == (10_000.0, 1_000_000.0)
    assert attn.submodules.linear_qkv is te.TELayerNormColumnParallelLinear
    assert attn.submodules.core_attention is te.TEDotProductAttention
    assert attn.submodules.q_layernorm is LocalNorm
    assert layer.mlp.submodules.linear_fc1 is te.TELayerNormColumnParallelLinear

    oss = _gpt_oss_arch()
    config = make_transformer_config(oss, ParallelLayout())
    layer = decoder_block_spec(config, "RMSNorm", "te", None).submodules
    assert layer.self_attention.submodules.core_attention is te.TEDotProductAttention
    assert layer.mlp.submodules.experts.module is SequentialMLP
    assert layer.pre_mlp_layernorm is LocalNorm
