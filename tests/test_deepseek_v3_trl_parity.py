"""KTO on a tiny DeepSeek-V3-style model (`deepseek_v3`) against TRL 1.16's `KTOTrainer`: 8 steps.

The model (2 layers: a dense first layer, then sigmoid-routed experts — 4, top-2, renormalised,
routed_scaling_factor 1.5 — with an ungated shared expert) has multi-latent attention with a
query bottleneck (q_lora_rank 16, kv_lora_rank 16, qk head dim 16 + 8 rotated, v head dim 12)
and YaRN with mscale / mscale_all_dim. Both runs start from one Hugging Face directory whose
expert-score correction biases are non-zero random values; the bias is frozen on both sides
(`transformers` never updates the buffer, our `model.moe_router_bias_update_rate` defaults to 0).
DeepseekV3 has no load-balancing loss, so neither side adds one.

The harness is `trl_harness.py`'s (its TRL run and our CLI run + export, packed rows); step losses and the final weights must agree to fp32 round-off, and the weights must have
moved well beyond it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_tiny import make_hf_sigmoid_routed
from trl_harness import check_trajectory, prepare_trajectory

pytestmark = pytest.mark.e2e
trl = pytest.importorskip("trl")


def _make_deepseek(directory: Path) -> None:
    """A random tiny deepseek_v3 with routers far from ties and non-zero correction biases."""
    make_hf_sigmoid_routed(directory, "deepseek_v3")  # hf_tiny.TINY_DEEPSEEK_V3


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return prepare_trajectory(tmp_path_factory.mktemp("deepseek_trl"), _make_deepseek, aux=False)


def test_trajectory_equals_trl(prepared):
    ours = check_trajectory(prepared, True, moving=("kv_b_proj.weight", "q_a_proj.weight"))
    _, _, start, _ = prepared
    biases = [k for k in ours if k.endswith("e_score_correction_bias")]
    assert biases and all(torch.equal(ours[k], start[k]) for k in biases)  # frozen on both sides
