"""KTO on a tiny GPT-OSS against TRL 1.16's `KTOTrainer`: 8 steps, router load-balancing loss on
(`transformers`' `load_balancing_loss_func` over the GPT-OSS routers' biased logits, as TRL adds
it). The harness is `test_moe_trl_parity.py`'s (same data order, optimizer, β, clip; its
docstring says why each choice); only the model differs: `test_gpt_oss._hf_config`'s shape
(sinks, alternating window-8 / full layers over rows longer than the window, YaRN, 4 experts
top-2 with biases and the clamp) with decisive routers, sinks N(0, 1), and a byte-level BPE
tokenizer. Step losses and aux losses must agree to 1e-5 relative, packed and padded, and the
exported weights to fp32 round-off.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from e2e_cli import REPO, run_script
from hf_tiny import make_tokenizer, write_kto_rows
from test_gpt_oss import _hf_config
from test_moe_trl_parity import _ours, _trl

pytestmark = pytest.mark.e2e
trl = pytest.importorskip("trl")

TOOL = REPO / "tools" / "convert_checkpoint.py"
AUX_COEF, ROWS, STEPS = 0.1, 64, 8
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 2e-6


def _make_hf(directory: Path) -> None:
    from transformers import AutoModelForCausalLM

    config = _hf_config()
    config.vocab_size = make_tokenizer(directory)
    config.router_aux_loss_coef = AUX_COEF
    config.max_position_embeddings = 128  # the harness's max_length
    config.bos_token_id, config.eos_token_id = 1, 2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "sinks" in name or name.endswith("router.weight"):
                p.normal_(0.0, 1.0)  # sinks that matter; routing far from ties
    model.save_pretrained(directory)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("gpt_oss_trl")
    _make_hf(root / "hf")
    write_kto_rows(root / "train.jsonl", 0, ROWS)
    run_script(TOOL, ["import", "--hf-dir", str(root / "hf"), "--out", str(root / "mcore")])
    start = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).state_dict()
    return root, _trl(root), {k: v.clone() for k, v in start.items()}


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "padded"])
def test_trajectory_equals_trl(prepared, pack):
    root, (trl_losses, trl_aux, trl_state), start = prepared
    metrics, ours = _ours(root, "packed" if pack else "padded", pack)
    losses = [r["loss"] for r in metrics]
    aux = [r["aux_loss"] for r in metrics]
    print(f"\nours loss {losses}\ntrl  loss {trl_losses}\nours aux {aux}\ntrl  aux {trl_aux}")
    assert len(losses) == len(trl_losses) == STEPS
    assert aux == pytest.approx(trl_aux, rel=LOSS_RTOL)
    assert losses == pytest.approx(trl_losses, rel=LOSS_RTOL)
    assert ours.keys() == trl_state.keys()
    worst = max((ours[k] - trl_state[k]).abs().max().item() for k in ours)
    moved = {k: (trl_state[k] - start[k]).abs().max().item() for k in ours}
    print(f"weights: max |ours - trl| {worst:.1e}; smallest move {min(moved.values()):.1e}")
    assert worst <= WEIGHT_ATOL
    moving = [k for k in ours if k.endswith(("router.weight", "sinks", "gate_up_proj"))]
    assert moving and all(moved[k] > 100 * WEIGHT_ATOL for k in moving)
