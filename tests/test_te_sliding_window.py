"""Sliding windows on Transformer Engine's attention, run on CPU: megatron-core's TE layer spec with
its real `TEDotProductAttention` over the TE 2.9 stand-in (`te_attention_standin`, which computes
TE's `window_size` (left, 0): keys i − left .. i) against our SDPA on the local spec.

A tiny GPT (4 layers, GQA, window 4 in layers 1 and 3 — `window_layers` [1, 0, 1, 0], as a
Qwen2 / GPT-OSS pattern reads — rows of up to 14 tokens, so windows cut most of them) is built on
the local spec, saved, and loaded into the TE spec (one process). What reaches TE is
megatron-core's own per-layer mechanism (`window_size` + `window_attn_skip_freq` in the
transformer config, `is_layer_window_attention` in `TEDotProductAttention.__init__`): the
windowed layers' attention gets `window_size=(3, 0)`, the others none. Per-row log-probs of the
two specs agree to 1e-5, padded (`sbhd` + `causal`) and packed (`thd` + `padding_causal`); the
same weights without windows give other log-probs, so the windows are really applied.
"""

from __future__ import annotations

import pytest
import torch

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.models.forward import LOGP_SUM, forward_sequence_stats
from megatron_kto.models.logprobs import IGNORE_INDEX

WINDOW, PATTERN, VOCAB = 4, [1, 0, 1, 0], 60
TOL = 1e-5


def _arch(window: int | None) -> GPTArchitecture:
    return GPTArchitecture(
        num_layers=4,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        encoder_seq_length=16,
        vocab_size=VOCAB,
        padded_vocab_size=64,
        init_method_std=0.2,
        sliding_window=window,
        window_layers=PATTERN if window else None,
    )


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Four rows of 14, 9, 12 and 6 real tokens, right-padded to 14."""
    g = torch.Generator().manual_seed(3)
    lengths, seq = (14, 9, 12, 6), 14
    tokens = torch.randint(0, VOCAB, (len(lengths), seq), generator=g)
    labels = torch.full_like(tokens, IGNORE_INDEX)
    for i, n in enumerate(lengths):
        labels[i, 1 : n - 1] = tokens[i, 2:n]
    positions = torch.arange(seq).expand(len(lengths), seq).contiguous()
    return tokens, labels, positions


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from te_attention_standin import CALLS
    from te_standin import te_spec_models

    from megatron_kto.checkpointing.model_io import load_model, save_model
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks, unwrap
    from megatron_kto.runtime import init_runtime, teardown

    root = tmp_path_factory.mktemp("te_window")
    runtime = init_runtime(1, 1, seed=2)
    try:
        arch = _arch(WINDOW)
        local = build_gpt_chunks(arch, ParallelLayout(), runtime.device)
        save_model(root, local, arch)
        with te_spec_models(attention="te"):
            te = build_gpt_chunks(arch, ParallelLayout(), runtime.device)
        load_model(root, te)
        full = build_gpt_chunks(_arch(None), ParallelLayout(), runtime.device)
        load_model(root, full)
        windows = [
            layer.self_attention.core_attention.window_size
            for layer in unwrap(te[0]).decoder.layers
        ]
        stats, formats = {}, {}
        with torch.no_grad():
            for pack in (False, True):
                for name, chunks in (("local", local), ("te", te), ("full", full)):
                    CALLS.clear()
                    stats[name, pack] = forward_sequence_stats(
                        chunks, *_batch(), 4, VOCAB, chunk_size=8, pack=pack
                    )[:, LOGP_SUM]
                    if name == "te":
                        formats[pack] = {(c["qkv_format"], c["attn_mask_type"]) for c in CALLS}
                        formats[pack, "windows"] = [c["window_size"] for c in CALLS]
        return windows, stats, formats
    finally:
        teardown()


def test_window_reaches_te_per_layer(built):
    windows, _, formats = built
    assert windows == [(WINDOW - 1, 0), None, (WINDOW - 1, 0), None]
    assert formats[False] == {("sbhd", "causal")}
    assert formats[True] == {("thd", "padding_causal")}
    assert formats[True, "windows"] == [(WINDOW - 1, 0), None] * 2


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_te_window_logprobs_equal_sdpa(built, pack):
    _, stats, _ = built
    local, te, full = stats["local", pack], stats["te", pack], stats["full", pack]
    print(f"\nsdpa {local.tolist()}\nte   {te.tolist()}\nfull {full.tolist()}")
    torch.testing.assert_close(te, local, rtol=TOL, atol=TOL)
    assert (full - local).abs().max() > 1e-2  # the windows change the rows longer than them
