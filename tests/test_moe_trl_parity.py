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

from pathlib import Path

import pytest
import torch
from e2e_cli import KTO_SCRIPT, QUIET, REPO, read_metrics, run_script
from hf_tiny import make_hf_qwen3_moe, write_kto_rows
from trl_harness import in_order_trainer, kl_aligned_dataset, kto_args, trl_optimizer_overrides

pytestmark = pytest.mark.e2e
trl = pytest.importorskip("trl")

TOOL = REPO / "tools" / "convert_checkpoint.py"
STEPS, BATCH, ROWS = 8, 8, 64
BETA, LR, EPS, CLIP, AUX_COEF = 0.1, 1e-3, 1e-5, 1.0, 0.1
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 2e-6


def _trl(root: Path) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = kl_aligned_dataset(root / "train.jsonl", BATCH)
    model = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(root / "hf")
    args = kto_args(root / "trl", batch=BATCH, steps=STEPS, lr=LR, eps=EPS, clip=CLIP, beta=BETA)
    trainer = in_order_trainer()(
        model=model, args=args, train_dataset=data, processing_class=tokenizer
    )
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == AUX_COEF
    trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e]
    state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return [e["loss"] for e in logged], [e["aux_loss"] for e in logged], state


def _ours(root: Path, name: str, pack: bool) -> tuple[list[dict], dict[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    log_dir = root / name
    run_script(
        KTO_SCRIPT,
        [
            *QUIET,
            f"pretrained_checkpoint.restore_from_path={root / 'mcore'}",
            f"model.data.data_prefix.train=[{root / 'train.jsonl'}]",
            "model.data.data_prefix.validation=[]",
            "model.data.shuffle=false",
            "model.data.max_length=128",
            f"model.data.pack_sequences={str(pack).lower()}",
            "trainer.precision=32",
            f"exp_manager.explicit_log_dir={log_dir}",
            f"trainer.kto.max_steps={STEPS}",
            f"trainer.kto.gradient_clip_val={CLIP}",
            f"model.global_batch_size={BATCH}",
            f"model.micro_batch_size={BATCH}",
            f"model.kto.ref_policy_kl_penalty={BETA}",
            *trl_optimizer_overrides(LR, EPS),
        ],
        timeout=900,
    )
    out = root / f"{name}_hf"
    run_script(TOOL, ["export", "--ckpt", str(log_dir), "--out", str(out)])
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    return read_metrics(log_dir), {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("moe_trl")
    make_hf_qwen3_moe(root / "hf", AUX_COEF)
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
    routers = [k for k in ours if k.endswith("mlp.gate.weight")]
    assert routers and all(moved[k] > 100 * WEIGHT_ATOL for k in routers)
