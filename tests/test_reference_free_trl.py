"""SimPO and ORPO on a tiny `transformers` Llama against TRL 1.16's loss code: 3 steps.

One tiny random Llama (the bundled sentencepiece vocabulary) is imported with
`tools/convert_checkpoint.py` and trained by `examples/train_gpt_dpo.py` for 3 steps on the
bundled paired data in data order, one micro-batch of 8 pairs per step (TRL's batch), fp32,
constant lr, Adam (ε 1e-5), no weight decay, gradient clip 1.0.

TRL's experimental `CPOTrainer` / `ORPOTrainer` tokenize with their own legacy row builder, so
instead of their training loop, the same model is trained here with `transformers` on our
tokenized rows (prompt tokens, then the completion's) and TRL's own loss code — its static
`get_batch_logps` (per-token means for SimPO and ORPO), `CPOTrainer.cpo_loss` and
`ORPOTrainer.odds_ratio_loss` run unmodified on a stand-in ``self`` — plus the NLL its
`concatenated_forward` takes (`nn.CrossEntropyLoss` over the chosen rows' label tokens), and
`torch.optim.Adam` + `clip_grad_norm_`. Step losses (and step 1's metrics) must agree to 1e-5.
ORPO runs with `model.dpo.orpo_prompt_nll=false` (the paper's NLL, of the chosen completion's
tokens) against that NLL here; the default, TRL's NLL over prompt and completion, is compared
with `ORPOTrainer` itself in `test_reference_free_trl_parity.py`.
"""

from __future__ import annotations

import types

import pytest
import torch
from e2e_cli import QUIET, REPO, TOKENIZER, read_metrics, run_script
from trl_harness import trl_optimizer_overrides

pytestmark = pytest.mark.e2e
trl = pytest.importorskip("trl")

TOOL = REPO / "tools" / "convert_checkpoint.py"
DPO_SCRIPT = REPO / "examples" / "train_gpt_dpo.py"
DATA = REPO / "examples" / "data" / "tiny_dpo" / "train.jsonl"
STEPS, BATCH, BETA, LR, EPS, CLIP, GAMMA = 3, 8, 0.2, 1e-3, 1e-5, 1.0, 0.3
RTOL = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_kto.data.tokenizers import load_tokenizer

    root = tmp_path_factory.mktemp("reffree_trl")
    vocab = load_tokenizer("sentencepiece", str(TOKENIZER)).vocab_size
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=128,
        initializer_range=0.1,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(root / "hf")
    run_script(TOOL, ["import", "--hf-dir", str(root / "hf"), "--out", str(root / "mcore")])
    return root


def _ours(root, loss_type: str) -> list[dict]:
    log_dir = root / loss_type
    run_script(
        DPO_SCRIPT,
        [
            *QUIET,
            f"pretrained_checkpoint.restore_from_path={root / 'mcore'}",
            f"model.data.data_prefix.train=[{DATA}]",
            "model.data.data_prefix.validation=[]",
            "model.tokenizer.library=sentencepiece",
            f"model.tokenizer.model={TOKENIZER}",
            "model.data.shuffle=false",
            "model.data.max_length=64",
            "trainer.precision=32",
            f"exp_manager.explicit_log_dir={log_dir}",
            "exp_manager.create_checkpoint_callback=false",
            f"trainer.dpo.max_steps={STEPS}",
            f"trainer.dpo.gradient_clip_val={CLIP}",
            f"model.global_batch_size={BATCH}",
            f"model.micro_batch_size={BATCH}",
            f"model.dpo.loss_type={loss_type}",
            f"model.dpo.ref_policy_kl_penalty={BETA}",
            f"model.dpo.simpo_gamma={GAMMA}",
            f"model.dpo.orpo_prompt_nll={loss_type != 'orpo'}",
            *trl_optimizer_overrides(LR, EPS),
        ],
        timeout=600,
    )
    return read_metrics(log_dir)


def _batches():
    """Our tokenized pairs, BATCH a step: (input ids, attention mask, labels) of the chosen rows
    then the rejected rows, right-padded; labels −100 on the prompt and the padding."""
    from megatron_kto.data.dataset import build_dpo_dataset
    from megatron_kto.data.tokenizers import load_tokenizer

    dataset, _ = build_dpo_dataset(
        [DATA], load_tokenizer("sentencepiece", str(TOKENIZER)), 64, use_cache=False
    )
    for start in range(0, STEPS * BATCH, BATCH):
        items = [dataset[i] for i in range(start, start + BATCH)]
        rows = [
            (list(it["prompt_ids"]), list(it[k]))
            for k in ("chosen_ids", "rejected_ids")
            for it in items
        ]
        width = max(len(p) + len(c) for p, c in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        labels = torch.full_like(ids, -100)
        for i, (p, c) in enumerate(rows):
            n = len(p) + len(c)
            ids[i, :n], mask[i, :n] = torch.tensor(p + c), 1
            labels[i, len(p) : n] = torch.tensor(c)
        yield ids, mask, labels


def _trl_steps(root, loss_type: str) -> list[dict[str, float]]:
    from transformers import AutoModelForCausalLM
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    model = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=EPS)
    stub = types.SimpleNamespace(
        alpha=0.0, beta=BETA, label_smoothing=0.0, loss_type="simpo", simpo_gamma=GAMMA,
        accelerator=types.SimpleNamespace(device=torch.device("cpu")),
    )  # fmt: skip
    out = []
    for ids, mask, labels in _batches():
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        logps = CPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
        nll = torch.nn.CrossEntropyLoss()(
            logits[:BATCH, :-1].reshape(-1, logits.shape[-1]), labels[:BATCH, 1:].reshape(-1)
        )
        row = {"nll_loss": nll.item(), "logps/chosen": logps[:BATCH].mean().item()}
        if loss_type == "simpo":
            losses, chosen, rejected = CPOTrainer.cpo_loss(stub, logps[:BATCH], logps[BATCH:])
            loss = losses.mean() + 1.0 * nll  # CPOConfig's default cpo_alpha
        else:
            losses, chosen, rejected, ratio, log_odds = ORPOTrainer.odds_ratio_loss(
                stub, logps[:BATCH], logps[BATCH:]
            )
            loss = nll - losses.mean()
            row |= {"log_odds_ratio": ratio.item(), "log_odds_chosen": log_odds.item()}
        row |= {
            "loss": loss.item(),
            "rewards/chosen": chosen.mean().item(),
            "rewards/margins": (chosen - rejected).mean().item(),
        }
        optimizer.zero_grad()
        loss.backward()
        row["grad_norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item()
        optimizer.step()
        out.append(row)
    return out


@pytest.mark.parametrize("loss_type", ["simpo", "orpo"])
def test_steps_equal_trl(model_dir, loss_type):
    ours = _ours(model_dir, loss_type)
    theirs = _trl_steps(model_dir, loss_type)
    print(f"\n{loss_type} ours {[r['loss'] for r in ours]}\n  trl  {[r['loss'] for r in theirs]}")
    assert len(ours) == len(theirs) == STEPS
    worst = max(abs(a["loss"] / b["loss"] - 1) for a, b in zip(ours, theirs, strict=True))
    print(f"{loss_type}: worst relative step-loss difference {worst:.1e}")
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True), start=1):
        keys = b if step == 1 else ("loss",)
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=RTOL, abs=1e-7), (step, key)
    assert theirs[-1]["loss"] != pytest.approx(theirs[0]["loss"], rel=1e-3)  # it trained
