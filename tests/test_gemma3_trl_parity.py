"""KTO on a tiny Gemma 3 (`gemma3_text`) against TRL 1.16's `KTOTrainer`: 8 steps.

The model has both layer kinds — sliding window 8 in layers 0, 1 and 3, full attention in layer
2, over rows of up to ~60 tokens, so windows cut most rows — a RoPE base per kind with linear
scaling on the full layer, `query_pre_attn_scalar` 24 (not the head dim), (1 + w) norms moved away
from 1, Q/K norms, sandwich norms, GeGLU and tied, √hidden-scaled embeddings; a byte-level BPE
tokenizer. Gemma 3 has no router, so TRL adds no aux loss and neither do we.

The harness is `trl_harness`'s (batches in data order, reversed for TRL's KL pairing, same β, lr,
Adam ε and clip); step losses must agree to 1e-5 relative, packed and padded, and the final
weights (ours exported with `tools/convert_checkpoint.py`) to fp32 round-off, with every norm,
projection and the tied embedding moved well beyond it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_tiny import make_tokenizer
from trl_harness import check_trajectory, prepare_trajectory

pytestmark = pytest.mark.e2e
trl = pytest.importorskip("trl")

WINDOW = 8


def _make_gemma(directory: Path) -> None:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    vocab = make_tokenizer(directory)
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        vocab_size=vocab,
        max_position_embeddings=128,
        sliding_window=WINDOW,
        layer_types=["sliding_attention"] * 2 + ["full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        initializer_range=0.1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():  # (1 + w) norms away from 1
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(directory)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return prepare_trajectory(tmp_path_factory.mktemp("gemma3_trl"), _make_gemma, aux=False)


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "padded"])
def test_trajectory_equals_trl(prepared, pack):
    check_trajectory(prepared, pack, moving=("norm.weight", "proj.weight", "embed_tokens.weight"))
