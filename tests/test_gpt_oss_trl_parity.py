"""KTO on a tiny GPT-OSS against TRL 1.16's `KTOTrainer`: 8 steps, router load-balancing loss on
(`transformers`' `load_balancing_loss_func` over the GPT-OSS routers' biased logits, as TRL adds
it). The harness is `trl_harness`'s (same data order, optimizer, β, clip; its
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
from hf_tiny import make_tokenizer
from test_gpt_oss import _hf_config
from trl_harness import check_trajectory, prepare_trajectory

pytestmark = pytest.mark.e2e
trl = pytest.importorskip("trl")

AUX_COEF = 0.1


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
    return prepare_trajectory(tmp_path_factory.mktemp("gpt_oss_trl"), _make_hf, aux=True)


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "padded"])
def test_trajectory_equals_trl(prepared, pack):
    check_trajectory(prepared, pack, moving=("router.weight", "sinks", "gate_up_proj"))
