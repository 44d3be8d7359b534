"""KTO on a tiny Qwen3.5 (`qwen3_5_text`: gated DeltaNet + gated full attention) against TRL 1.16's
`KTOTrainer`: every step's loss and the final weights.

The model (4 layers: DeltaNet, attention, DeltaNet, attention; 2 key / 4 value DeltaNet heads,
partial RoPE, Q/K norms, (1 + w) RMSNorms moved away from their init) starts both runs from one
Hugging Face directory. TRL runs `transformers`' own torch fallback of the delta rule and the
causal convolution (no `fla` / `causal_conv1d` on CPU); we run ours (`models/delta_rule.py`) on
packed micro-batches, where the DeltaNet state restarts at every row.

The harness is `trl_harness.py`'s (batches in data order, reversed for TRL's KL
pairing, same β, lr, Adam ε and clip); step losses must agree to 1e-5 relative and the final
weights (ours exported with `tools/convert_checkpoint.py`) to 1e-5 — fp32 round-off as Adam
amplifies it over 5 steps (see `STEPS`) — while every DeltaNet tensor has moved 100x beyond it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_tiny import make_tokenizer
from trl_harness import check_trajectory, prepare_trajectory

pytestmark = pytest.mark.e2e
trl = pytest.importorskip("trl")

#: Fewer steps and half the lr of the GLM test: Adam turns fp32 round-off into drift that grows
#: with every step. TRL against itself with only the delta rule's chunk size changed (64 vs 16)
#: drifts 4.9e-6 in the loss by step 6 at lr 1e-3; at these 5 steps and lr 5e-4, 5.8e-7 in the
#: loss and 1.9e-6 in the weights (ours against TRL, measured: 2.0e-6 and 4.9e-6).
STEPS, LR = 5, 5e-4
WEIGHT_ATOL = 1e-5


def _make_qwen3_5(
    directory: Path, layer_types: tuple[str, ...] = ("linear_attention", "full_attention") * 2
) -> None:
    """The tiny model in `directory` (4 layers of `layer_types`) with its tokenizer."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    vocab = make_tokenizer(directory)
    torch.manual_seed(0)
    config = Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        layer_types=list(layer_types),
        max_position_embeddings=128, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("dt_bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(directory)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_5_trl")
    return prepare_trajectory(root, _make_qwen3_5, aux=False, steps=STEPS, lr=LR)


def test_packed_trajectory_equals_trl(prepared):
    check_trajectory(prepared, True, moving=(".linear_attn.",), weight_atol=WEIGHT_ATOL)
