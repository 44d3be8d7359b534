"""KTO on a tiny GLM-4.5-style model (`glm4_moe`) against TRL 1.16's `KTOTrainer`: 8 steps.

The model (2 layers: a dense first layer, then sigmoid-routed experts — 4, top-2, renormalised,
routed_scaling_factor 1.5 — with an ungated shared expert; q/k/v biases, partial rotary) starts
both runs from one Hugging Face directory whose expert-score correction biases are non-zero
random values. The bias is frozen on both sides: `transformers` never updates the buffer and our
`model.moe_router_bias_update_rate` defaults to 0. Glm4Moe has no load-balancing loss, so TRL
adds none (`aux_loss_enabled` is False) and neither do we.

The harness is `trl_harness`'s (batches in data order, reversed for TRL's KL pairing,
same β, lr, Adam ε and clip); step losses and the final weights (ours exported with
`tools/convert_checkpoint.py`; the biases included) must agree to fp32 round-off, and the weights
must have moved well beyond it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_tiny import make_hf_sigmoid_routed
from trl_harness import check_trajectory, prepare_trajectory

pytestmark = pytest.mark.e2e
trl = pytest.importorskip("trl")


def _make_glm(directory: Path) -> None:
    """A random tiny glm4_moe with routers far from ties (weights ~N(0, 0.3), scores away from
    sigmoid's flat ends) and non-zero correction biases."""
    make_hf_sigmoid_routed(directory, "glm4_moe", routed_scaling_factor=1.5)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return prepare_trajectory(tmp_path_factory.mktemp("glm_trl"), _make_glm, aux=False)


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "padded"])
def test_trajectory_equals_trl(prepared, pack):
    ours = check_trajectory(prepared, pack, moving=("mlp.gate.weight",))
    _, _, start, _ = prepared
    biases = [k for k in ours if k.endswith("e_score_correction_bias")]
    assert biases and all(torch.equal(ours[k], start[k]) for k in biases)  # frozen on both sides
