"""KTO with LoRA against TRL 1.16's `KTOTrainer` + `peft`: same steps, same adapters.

One tiny `transformers` Llama with grouped-query attention and its tokenizer (`hf_tiny`) is the
base of both runs. A `peft` LoRA adapter (rank 4, alpha 8, every projection, dropout 0) is made
on it with a non-zero B (so step 1 already has non-zero rewards and z₀) and saved; that
directory is the starting adapter of both sides:

* TRL: `KTOTrainer(model=base, peft_config=<the adapter's LoraConfig>)`, whose fresh adapter
  is then overwritten with the starting adapter's weights (`set_peft_model_state_dict`) before
  training; no `ref_model`, so TRL's reference is the model with the adapter disabled — the base,
  as ours. (Handed an already wrapped `PeftModel`, TRL 1.16 instead makes the reference the base
  plus a frozen copy of the starting adapter.) Batches are taken in data order (a
  `SequentialSampler`, as our `model.data.shuffle=false`), each batch's rows in reverse order:
  TRL 1.16's collator pairs prompt i with the completion of row i-1, ours with row i+1
  (DESIGN §1), so reversed batches give both sides the same set of KL rows;
* ours: `examples/train_gpt_kto.py` from the imported base with
  `model.peft.restore_from_path=<adapter>`, then `tools/convert_checkpoint.py export` of the
  run (a PEFT directory).

Same data (64 rows), β, λ_D/λ_U, constant lr 1e-3, Adam (β 0.9/0.999, ε 1e-5 — see
`test_e2e_lora.py` for why ε above round-off), gradient clip 1.0 and batch of 8 for 4 steps.
Step-by-step losses and the final adapter weights must agree to fp32 round-off.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from e2e_cli import KTO_SCRIPT, QUIET, REPO, read_metrics, run_script
from hf_tiny import make_hf_chat_model, write_kto_rows

pytestmark = pytest.mark.e2e
trl = pytest.importorskip("trl")
pytest.importorskip("peft")

TOOL = REPO / "tools" / "convert_checkpoint.py"
STEPS, BATCH, ROWS = 4, 8, 64
BETA, LR, EPS, CLIP = 0.1, 1e-3, 1e-5, 1.0
RANK, ALPHA = 4, 8
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LOSS_RTOL = 1e-5
WEIGHT_RTOL = 1e-4


def _initial_adapter(root: Path) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=PROJECTIONS)
    model = get_peft_model(base, config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    model.save_pretrained(root / "adapter0")
    return root / "adapter0"


def _trl(root: Path, adapter: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    from megatron_kto.data.formats import iter_kto_examples

    rows = list(iter_kto_examples(root / "train.jsonl"))
    # TRL pairs prompt i with completion i-1 of its batch, we with completion i+1 (DESIGN §1):
    # TRL gets each batch's rows in reverse order, so both sides form the same KL rows.
    rows = [r for b in range(0, len(rows), BATCH) for r in reversed(rows[b : b + BATCH])]
    data = Dataset.from_dict(
        {
            "prompt": [r.prompt for r in rows],
            "completion": [r.completion for r in rows],
            "label": [bool(r.label) for r in rows],
        }
    )
    base = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(root / "hf")

    class InOrder(KTOTrainer):
        def _get_train_sampler(self, train_dataset=None):
            return SequentialSampler(train_dataset or self.train_dataset)

    args = KTOConfig(
        output_dir=str(root / "trl"),
        per_device_train_batch_size=BATCH,
        max_steps=STEPS,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=EPS,
        max_grad_norm=CLIP,
        beta=BETA,
        max_length=128,
        gradient_checkpointing=False,
        bf16=False,
        seed=0,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_drop_last=True,
    )
    lora = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=PROJECTIONS)
    trainer = InOrder(
        model=base, args=args, train_dataset=data, processing_class=tokenizer, peft_config=lora
    )
    model = trainer.model
    result = set_peft_model_state_dict(model, load_file(str(adapter / "adapter_model.safetensors")))
    assert not result.unexpected_keys
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    state = {
        k.replace(".default", ""): v.detach().clone()
        for k, v in get_peft_model_state_dict(model).items()
    }
    return losses, state


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_trl")
    make_hf_chat_model(root / "hf")
    write_kto_rows(root / "train.jsonl", 0, ROWS)
    adapter = _initial_adapter(root)
    run_script(TOOL, ["import", "--hf-dir", str(root / "hf"), "--out", str(root / "mcore")])
    run_script(
        KTO_SCRIPT,
        [
            *QUIET,
            f"pretrained_checkpoint.restore_from_path={root / 'mcore'}",
            f"model.data.data_prefix.train=[{root / 'train.jsonl'}]",
            "model.data.data_prefix.validation=[]",
            "model.data.shuffle=false",
            "model.data.max_length=128",
            "trainer.precision=32",
            f"exp_manager.explicit_log_dir={root / 'ours'}",
            f"trainer.kto.max_steps={STEPS}",
            f"trainer.kto.gradient_clip_val={CLIP}",
            f"model.global_batch_size={BATCH}",
            "model.micro_batch_size=4",
            f"model.kto.ref_policy_kl_penalty={BETA}",
            "model.optim.sched.name=Constant",
            "model.optim.sched.warmup_steps=0",
            f"model.optim.lr={LR}",
            f"model.optim.eps={EPS}",
            "model.optim.betas=[0.9,0.999]",
            "model.optim.weight_decay=0.0",
            "model.peft.peft_scheme=lora",
            f"model.peft.lora_tuning.adapter_dim={RANK}",
            f"model.peft.lora_tuning.alpha={ALPHA}",
            f"model.peft.lora_tuning.target_modules=[{','.join(PROJECTIONS)}]",
            f"model.peft.restore_from_path={adapter}",
        ],
    )
    run_script(TOOL, ["export", "--ckpt", str(root / "ours"), "--out", str(root / "exported")])
    from safetensors.torch import load_file

    ours = load_file(str(root / "exported" / "adapter_model.safetensors"))
    trl_losses, trl_state = _trl(root, adapter)
    start = load_file(str(adapter / "adapter_model.safetensors"))
    return read_metrics(root / "ours"), ours, trl_losses, trl_state, start


def test_step_losses_equal_trl(runs):
    metrics, _, trl_losses, _, _ = runs
    ours = [r["loss"] for r in metrics]
    print(f"\nours {ours}\ntrl  {trl_losses}\nkl {[r['kl'] for r in metrics]}")
    assert len(ours) == len(trl_losses) == STEPS
    assert metrics[0]["rewards/chosen"] != 0.0  # the starting adapter is not the base
    assert ours == pytest.approx(trl_losses, rel=LOSS_RTOL)


def test_final_adapters_equal_trl(runs):
    _, ours, _, theirs, start = runs
    assert ours.keys() == theirs.keys()
    worst = max(float((ours[k] - theirs[k]).abs().max() / theirs[k].abs().max()) for k in theirs)
    moved = min(float((theirs[k] - start[k]).abs().max() / start[k].abs().max()) for k in theirs)
    print(f"\nadapters: max rel diff vs TRL {worst:.1e}; smallest relative move {moved:.1e}")
    assert moved > 10 * WEIGHT_RTOL
    assert worst <= WEIGHT_RTOL
