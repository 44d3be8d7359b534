"""KTO on a tiny GLM-4.5-style model (`glm4_moe`) against TRL 1.16's `KTOTrainer`: 8 steps.

The model (2 layers: a dense first layer, then sigmoid-routed experts — 4, top-2, renormalised,
routed_scaling_factor 1.5 — with an ungated shared expert; q/k/v biases, partial rotary) starts
both runs from one Hugging Face directory whose expert-score correction biases are non-zero
random values. The bias is frozen on both sides: `transformers` never updates the buffer and our
`model.moe_router_bias_update_rate` defaults to 0. Glm4Moe has no load-balancing loss, so TRL
adds none (`aux_loss_enabled` is False) and neither do we.

The harness is `test_moe_trl_parity.py`'s (batches in data order, reversed for TRL's KL pairing,
same β, lr, Adam ε and clip); step losses and the final weights (ours exported with
`tools/convert_checkpoint.py`; the biases included) must agree to fp32 round-off, and the weights
must have moved well beyond it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from e2e_cli import KTO_SCRIPT, QUIET, REPO, read_metrics, run_script
from hf_tiny import make_tokenizer, write_kto_rows
from trl_harness import in_order_trainer, kl_aligned_dataset, kto_args, trl_optimizer_overrides

pytestmark = pytest.mark.e2e
trl = pytest.importorskip("trl")

TOOL = REPO / "tools" / "convert_checkpoint.py"
STEPS, BATCH, ROWS = 8, 8, 64
BETA, LR, EPS, CLIP = 0.1, 1e-3, 1e-5, 1.0
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 2e-6


def _make_glm(directory: Path) -> None:
    """A random tiny glm4_moe with routers far from ties (weights ~N(0, 0.3), scores away from
    sigmoid's flat ends) and non-zero correction biases."""
    from transformers import AutoModelForCausalLM, Glm4MoeConfig

    vocab = make_tokenizer(directory)
    torch.manual_seed(0)
    config = Glm4MoeConfig(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=48,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        routed_scaling_factor=1.5,
        first_k_dense_replace=1,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attention_bias=True,
        vocab_size=vocab,
        max_position_embeddings=128,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    model.save_pretrained(directory)


def _trl(
    root: Path, steps: int = STEPS, lr: float = LR
) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = kl_aligned_dataset(root / "train.jsonl", BATCH)
    model = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(root / "hf")
    args = kto_args(root / "trl", batch=BATCH, steps=steps, lr=lr, eps=EPS, clip=CLIP, beta=BETA)
    trainer = in_order_trainer()(
        model=model, args=args, train_dataset=data, processing_class=tokenizer
    )
    assert not trainer.aux_loss_enabled
    trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e]
    state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return [e["loss"] for e in logged], [], state


def _ours(
    root: Path, name: str, pack: bool, steps: int = STEPS, lr: float = LR
) -> tuple[list[dict], dict[str, torch.Tensor]]:
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
            f"trainer.kto.max_steps={steps}",
            f"trainer.kto.gradient_clip_val={CLIP}",
            f"model.global_batch_size={BATCH}",
            f"model.micro_batch_size={BATCH}",
            f"model.kto.ref_policy_kl_penalty={BETA}",
            *trl_optimizer_overrides(lr, EPS),
        ],
        timeout=900,
    )
    out = root / f"{name}_hf"
    run_script(TOOL, ["export", "--ckpt", str(log_dir), "--out", str(out)])
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    return read_metrics(log_dir), {k: v.detach().clone() for k, v in model.state_dict().items()}


def prepare(root: Path, make_model, steps: int = STEPS, lr: float = LR) -> tuple:
    """(root, TRL's run, the starting weights): `make_model(root / "hf")` writes the model, the
    rows are written and imported for our runs, and TRL trains `steps` steps at `lr`."""
    from transformers import AutoModelForCausalLM

    make_model(root / "hf")
    write_kto_rows(root / "train.jsonl", 0, ROWS)
    run_script(TOOL, ["import", "--hf-dir", str(root / "hf"), "--out", str(root / "mcore")])
    start = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).state_dict()
    return root, _trl(root, steps, lr), {k: v.clone() for k, v in start.items()}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return prepare(tmp_path_factory.mktemp("glm_trl"), _make_glm)


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "padded"])
def test_trajectory_equals_trl(prepared, pack):
    root, (trl_losses, _, trl_state), start = prepared
    metrics, ours = _ours(root, "packed" if pack else "padded", pack)
    losses = [r["loss"] for r in metrics]
    print(f"\nours loss {losses}\ntrl  loss {trl_losses}")
    assert len(losses) == len(trl_losses) == STEPS
    assert all("aux_loss" not in r for r in metrics)
    assert losses == pytest.approx(trl_losses, rel=LOSS_RTOL)
    assert ours.keys() == trl_state.keys()
    worst = max((ours[k] - trl_state[k]).abs().max().item() for k in ours)
    moved = {k: (trl_state[k] - start[k]).abs().max().item() for k in ours}
    print(f"weights: max |ours - trl| {worst:.1e}; smallest move {min(moved.values()):.1e}")
    assert worst <= WEIGHT_ATOL
    biases = [k for k in ours if k.endswith("e_score_correction_bias")]
    assert biases and all(torch.equal(ours[k], start[k]) for k in biases)  # frozen on both sides
    routers = [k for k in ours if k.endswith("mlp.gate.weight")]
    assert routers and all(moved[k] > 100 * WEIGHT_ATOL for k in routers)
