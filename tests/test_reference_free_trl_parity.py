"""CPO, SimPO and ORPO trajectories against TRL 1.16's experimental `CPOTrainer` / `ORPOTrainer`.

The setup of `test_dpo_trl_parity.py` (tiny random Llama read directly, the first 24 pairs of the
bundled DPO example in data order, 8 pairs a step, fp32, β 0.1, constant lr 1e-3, Adam ε 1e-5,
clip 1.0), with two changes:

- every prompt starts with the tokenizer's BOS text: TRL's CPO/ORPO tokenisation prepends BOS
  whatever the tokenizer does, ours follows the tokenizer (DESIGN §1), so a prompt that already
  starts with it gives both sides the same ids;
- our micro-batch is the whole step (8 pairs): TRL's NLL is token-weighted over the batch it is
  given, ours over each micro-batch.

CPO (`loss_type=cpo`, TRL `loss_type="sigmoid"`) and SimPO (γ 0.5), both with `cpo_alpha` 1.0,
and ORPO (its NLL over the chosen rows' prompt and completion tokens, TRL's definition and our
default `model.dpo.orpo_prompt_nll=true`): every step's loss, NLL, log-probs and gradient norm to
1e-5 relative, rewards (and ORPO's mean log odds, a difference of per-token means near 0) to 5e-6
absolute, final weights to fp32 round-off.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from e2e_cli import QUIET, REPO, read_metrics, run_script
from hf_tiny import make_hf_chat_model
from trl_harness import (
    in_order_trainer,
    paired_dataset,
    reference_free_args,
    trl_optimizer_overrides,
)

pytestmark = pytest.mark.e2e
trl = pytest.importorskip("trl")

DPO_SCRIPT = REPO / "examples" / "train_gpt_dpo.py"
DPO_DATA = REPO / "examples" / "data" / "tiny_dpo" / "train.jsonl"
STEPS, BATCH = 3, 8
BETA, LR, EPS, CLIP = 0.1, 1e-3, 1e-5, 1.0
RTOL, REWARD_ATOL, WEIGHT_ATOL = 1e-5, 5e-6, 2e-6
RELATIVE = ("loss", "nll_loss", "logps/chosen", "logps/rejected", "grad_norm")
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins")
ODDS = {"orpo": ("log_odds_chosen",)}

#: name -> (our loss_type, TRL trainer, TRL config's loss arguments, steps).
CASES: dict[str, tuple[str, str, dict, int]] = {
    "cpo": ("cpo", "cpo", {"loss_type": "sigmoid", "cpo_alpha": 1.0}, STEPS),
    "simpo": ("simpo", "cpo", {"loss_type": "simpo", "cpo_alpha": 1.0, "simpo_gamma": 0.5}, STEPS),
    "orpo": ("orpo", "orpo", {}, STEPS),
}


def _trl(root: Path, name: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, kind, loss, steps = CASES[name]
    model = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(root / "hf")
    args = reference_free_args(
        root / f"trl_{name}",
        kind,
        batch=BATCH,
        steps=steps,
        lr=LR,
        eps=EPS,
        clip=CLIP,
        beta=BETA,
        **loss,
    )
    trainer = in_order_trainer(kind)(
        model=model,
        args=args,
        train_dataset=paired_dataset(root / "train.jsonl"),
        processing_class=tokenizer,
    )
    trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e]
    return logged, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _ours(root: Path, name: str):
    from transformers import AutoModelForCausalLM

    loss_type, _, _, steps = CASES[name]
    log_dir = root / f"ours_{name}"
    run_script(
        DPO_SCRIPT,
        [
            *QUIET,
            f"pretrained_checkpoint.restore_from_path={root / 'hf'}",
            f"model.data.data_prefix.train=[{root / 'train.jsonl'}]",
            "model.data.data_prefix.validation=[]",
            "model.data.shuffle=false",
            "model.data.max_length=128",
            "trainer.precision=32",
            f"exp_manager.explicit_log_dir={log_dir}",
            "exp_manager.create_checkpoint_callback=false",
            f"exp_manager.save_hf={steps == STEPS}",
            f"trainer.dpo.max_steps={steps}",
            f"trainer.dpo.gradient_clip_val={CLIP}",
            f"model.global_batch_size={BATCH}",
            f"model.micro_batch_size={BATCH}",
            f"model.dpo.ref_policy_kl_penalty={BETA}",
            f"model.dpo.loss_type={loss_type}",
            *trl_optimizer_overrides(LR, EPS),
        ],
        timeout=600,
    )
    if steps != STEPS:
        return read_metrics(log_dir), None
    model = AutoModelForCausalLM.from_pretrained(log_dir / "hf", dtype=torch.float32)
    return read_metrics(log_dir), {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (ours metrics, ours weights, TRL logs, TRL weights), plus the starting weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("reference_free_trl")
    make_hf_chat_model(root / "hf")
    bos = AutoTokenizer.from_pretrained(root / "hf").bos_token
    rows = [json.loads(line) for line in DPO_DATA.read_text().splitlines()[: STEPS * BATCH]]
    (root / "train.jsonl").write_text(
        "".join(json.dumps({**r, "prompt": bos + r["prompt"]}) + "\n" for r in rows)
    )
    start = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).state_dict()
    results = {name: (*_ours(root, name), *_trl(root, name)) for name in CASES}
    return results, {k: v.clone() for k, v in start.items()}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if a != b else 0.0


@pytest.mark.parametrize("name", ["cpo", "simpo", "orpo"])
def test_steps_and_weights_equal_trl(runs, name):
    results, start = runs
    ours, our_state, theirs, their_state = results[name]
    assert len(ours) == len(theirs) == STEPS
    pairs = list(zip(ours, theirs, strict=True))
    rel = max(_rel(o[m], t[m]) for o, t in pairs for m in RELATIVE)
    weights = max((our_state[k] - their_state[k]).abs().max().item() for k in their_state)
    moved = min((their_state[k] - start[k]).abs().max().item() for k in their_state)
    print(
        f"\n{name}: losses ours {[r['loss'] for r in ours]} trl {[e['loss'] for e in theirs]}\n"
        f"max rel. delta {rel:.1e}; weights max |ours - trl| {weights:.1e}, smallest move "
        f"{moved:.1e}"
    )
    for o, t in pairs:
        for m in RELATIVE:
            assert o[m] == pytest.approx(t[m], rel=RTOL, abs=0), (name, o["step"], m)
        for m in REWARDS + ODDS.get(name, ()):
            assert o[m] == pytest.approx(t[m], rel=0, abs=REWARD_ATOL), (name, o["step"], m)
        if name == "orpo":
            m = "log_odds_ratio"
            assert o[m] == pytest.approx(t[m], rel=RTOL, abs=0), (name, o["step"], m)
    assert weights <= WEIGHT_ATOL
    assert moved > 100 * WEIGHT_ATOL
