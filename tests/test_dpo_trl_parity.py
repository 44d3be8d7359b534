"""DPO trajectories against TRL 1.16's `DPOTrainer`: the same steps for a set of loss types.

One tiny random `transformers` Llama with its byte-level BPE tokenizer (`hf_tiny`) is the start
of every run; ours reads that directory directly (`pretrained_checkpoint.restore_from_path`) and
writes the trained model back as one (`exp_manager.save_hf`, no training checkpoint). Both sides
take the first 24 pairs of the bundled DPO example in data order (TRL: a `SequentialSampler`),
8 pairs a step (ours in micro-batches of 4) for 3 steps, fp32, β 0.1, constant lr 1e-3, Adam
(β 0.9/0.999, ε 1e-5 — see `test_e2e_lora.py` for why ε above round-off), gradient clip 1.0.

Loss settings (one shared setup, each run once): `robust` (ε 0.1), `apo_zero`, `discopop`, a
weighted three-loss list, an f-divergence (`alpha_divergence`, α 0.3); and, in one shared run,
the losses that reduce over the batch, `aot` + `aot_unpaired` + `bco_pair` (ε 0.1) as one weighted
list with LD-DPO (`ld_alpha` 0.3: the log-probs of tokens beyond the pair's shorter completion
count 0.3 times, policy and reference), run by us at DP=2 in micro-batches of 2 (each rank 4
pairs) against TRL on one process with all 8 pairs a step: the sorts are over the global batch,
so the two must agree. Every step's loss,
log-probs, logits and reward accuracy must agree to 1e-5 relative, the gradient norm to 3e-5,
the rewards (differences of fp32 log-prob sums, often near 0) to 5e-6 absolute, the final
weights to fp32 round-off (2e-6), and the weights must have moved well beyond it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from e2e_cli import QUIET, REPO, read_metrics, run_script
from hf_tiny import make_hf_chat_model
from trl_harness import dpo_args, in_order_trainer, paired_dataset, trl_optimizer_overrides

pytestmark = pytest.mark.e2e
trl = pytest.importorskip("trl")

DPO_SCRIPT = REPO / "examples" / "train_gpt_dpo.py"
DPO_DATA = REPO / "examples" / "data" / "tiny_dpo" / "train.jsonl"
STEPS, BATCH, MICRO = 3, 8, 4
BETA, LR, EPS, CLIP = 0.1, 1e-3, 1e-5, 1.0
RTOL = 1e-5
#: Rewards are β·(π − ref): differences of two fp32 log-prob sums of ~−130, which the two sides
#: add up in different orders (they differ by up to 2e-5 at step 1, where the weights are the same
#: on both sides), so rewards near 0 cannot agree relatively; β × 4e-7 × 130 ≈ 5e-6 absolute.
REWARD_ATOL = 5e-6
#: The gradient norm amplifies that round-off most under alpha_divergence (exp((α − 1)·u)):
#: 1.3e-5 relative at step 3.
GRAD_NORM_RTOL = 3e-5
WEIGHT_ATOL = 2e-6
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins")
RELATIVE = (
    "loss",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
)

#: name -> TRL's DPOConfig loss arguments; ours are the same keys under model.dpo.
CASES: dict[str, dict] = {
    "robust": {"loss_type": ["robust"], "label_smoothing": 0.1},
    "apo_zero": {"loss_type": ["apo_zero"]},
    "discopop": {"loss_type": ["discopop"], "discopop_tau": 0.05},
    "mixture": {
        "loss_type": ["sigmoid_norm", "nca_pair", "hinge"],
        "loss_weights": [1.0, 0.5, 0.3],
    },
    "alpha_divergence": {
        "loss_type": ["sigmoid"],
        "f_divergence_type": "alpha_divergence",
        "f_alpha_divergence_coef": 0.3,
    },
    "sorting_dp2": {
        "loss_type": ["aot", "aot_unpaired", "bco_pair"],
        "loss_weights": [1.0, 0.5, 0.25],
        "label_smoothing": 0.1,
        "ld_alpha": 0.3,
    },
}
#: name -> (data-parallel ranks, micro-batch size) of our run, where not (1, MICRO).
LAYOUT: dict[str, tuple[int, int]] = {"sorting_dp2": (2, 2)}


def _override(key: str, value) -> str:
    if isinstance(value, list):
        value = f"[{','.join(map(str, value))}]"
    return f"model.dpo.{key}={value}"


def _trl(root: Path, name: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(root / "hf")
    args = dpo_args(
        root / f"trl_{name}",
        batch=BATCH,
        steps=STEPS,
        lr=LR,
        eps=EPS,
        clip=CLIP,
        beta=BETA,
        **CASES[name],
    )
    trainer = in_order_trainer("dpo")(
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

    log_dir = root / f"ours_{name}"
    nproc, micro = LAYOUT.get(name, (1, MICRO))
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
            "exp_manager.save_hf=true",
            f"trainer.dpo.max_steps={STEPS}",
            f"trainer.dpo.gradient_clip_val={CLIP}",
            f"model.global_batch_size={BATCH}",
            f"model.micro_batch_size={micro}",
            f"model.dpo.ref_policy_kl_penalty={BETA}",
            *trl_optimizer_overrides(LR, EPS),
            *(_override(k, v) for k, v in CASES[name].items()),
        ],
        nproc=nproc,
        timeout=600,
    )
    model = AutoModelForCausalLM.from_pretrained(log_dir / "hf", dtype=torch.float32)
    return read_metrics(log_dir), {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case run once by both sides: name -> (ours metrics, ours weights, TRL logs, TRL
    weights), plus the starting weights."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("dpo_trl")
    make_hf_chat_model(root / "hf")
    lines = DPO_DATA.read_text().splitlines()[: STEPS * BATCH]
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    start = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).state_dict()
    results = {name: (*_ours(root, name), *_trl(root, name)) for name in CASES}
    return results, {k: v.clone() for k, v in start.items()}


def _rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    return abs(a - b) / abs(b) if b else float("inf")


def _compared(metrics: tuple[str, ...], theirs: dict) -> tuple[str, ...]:
    """`metrics` less the reward accuracy where TRL's rewards are all exactly 0 (step 1: policy =
    reference), which makes it count round-off signs: our reference pass packs its rows apart
    from the training pass's (DP=2 here), so a pair's reward can be ±1e-7 instead of 0. The
    rewards themselves are compared in absolute terms (`REWARD_ATOL`) at every step."""
    undefined = theirs["rewards/chosen"] == 0 and theirs["rewards/rejected"] == 0
    return tuple(m for m in metrics if not (undefined and m == "rewards/accuracies"))


@pytest.mark.parametrize("name", list(CASES))
def test_steps_and_weights_equal_trl(runs, name):
    (results, start) = runs
    ours, our_state, theirs, their_state = results[name]
    assert len(ours) == len(theirs) == STEPS
    pairs = list(zip(ours, theirs, strict=True))
    rel = max(_rel(o[m], t[m]) for o, t in pairs for m in _compared(RELATIVE, t))
    grad = max(_rel(o["grad_norm"], t["grad_norm"]) for o, t in pairs)
    rewards = max(abs(o[m] - t[m]) for o, t in pairs for m in REWARDS)
    weights = max((our_state[k] - their_state[k]).abs().max().item() for k in their_state)
    moved = min((their_state[k] - start[k]).abs().max().item() for k in their_state)
    print(
        f"\n{name}: losses ours {[r['loss'] for r in ours]} trl {[e['loss'] for e in theirs]}\n"
        f"max rel. delta loss/logps/logits/accuracies {rel:.1e}, grad_norm {grad:.1e}; rewards "
        f"max |delta| {rewards:.1e}; weights max |ours - trl| {weights:.1e}, smallest move "
        f"{moved:.1e}"
    )
    for o, t in pairs:
        for m in _compared(RELATIVE, t):
            assert o[m] == pytest.approx(t[m], rel=RTOL, abs=0), (name, o["step"], m)
        for m in REWARDS:
            assert o[m] == pytest.approx(t[m], rel=0, abs=REWARD_ATOL), (name, o["step"], m)
        assert o["grad_norm"] == pytest.approx(t["grad_norm"], rel=GRAD_NORM_RTOL)
    assert our_state.keys() == their_state.keys()
    assert weights <= WEIGHT_ATOL
    assert moved > 100 * WEIGHT_ATOL
