"""KTO on a tiny Qwen3-MoE against TRL 1.16's `KTOTrainer`: 8 steps, router load-balancing loss on.

One tiny random `transformers` Qwen3-MoE (2 layers, 4 experts, 2 routed per token, decisive
routers so that round-off never flips a routing choice) with a byte-level BPE tokenizer
(`hf_tiny.make_hf_qwen3_moe`) is the start of both runs; its config's `router_aux_loss_coef` is the
coefficient of both (TRL reads it from the config, we from the imported checkpoint).

TRL adds `coef · aux_loss` of the policy's forward over each batch — whole sequences, each row's
final token included, under the attention mask (`trl.trainer.utils.add_fused_lm_head`) — to the
batch's loss and logs `aux_loss`. Its KL and reference passes add nothing. Ours must give the
same `aux_loss` at every step and the same losses and weights, packed and padded.

Batches are taken in data order, 8 rows a step in one micro-batch (TRL's aux is joint over its
batch of 8), each batch's rows reversed for TRL: TRL 1.16's collator pairs prompt i with the
completion of row i-1, ours with row i+1 (DESIGN §1), so reversed batches give both sides the same
KL rows. Same β, constant lr, Adam (ε 1e-5, see `test_e2e_lora.py`), gradient clip 1.0. Step
losses, aux losses and the final weights (ours exported with `tools/convert_checkpoint.py`) must
agree to fp32 round-off, and the weights must have moved well beyond it.
"""

from __future__ import annotations

import pytest
from hf_tiny import make_hf_qwen3_moe
from trl_harness import check_trajectory, prepare_trajectory

pytestmark = pytest.mark.e2e
trl = pytest.importorskip("trl")

AUX_COEF = 0.1


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return prepare_trajectory(
        tmp_path_factory.mktemp("moe_trl"), lambda d: make_hf_qwen3_moe(d, AUX_COEF), aux=True
    )


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "padded"])
def test_trajectory_equals_trl(prepared, pack):
    check_trajectory(prepared, pack, moving=("mlp.gate.weight",))
