"""TRL 1.16 `KTOTrainer` / `DPOTrainer` set up to see what our trainer sees, for the trajectory
parity tests.

Same rows in the same order (`SequentialSampler`), the same KL rows — TRL pairs prompt i with
completion i−1 of its batch, we pair it with completion i+1 (DESIGN §1), so TRL gets each batch's
rows in reverse order (KTO only; DPO has no KL rows) — and a constant learning rate without
warm-up or weight decay.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


def kl_aligned_dataset(train_jsonl: Path, batch: int):
    """The rows of `train_jsonl` as a `datasets.Dataset`, each batch of `batch` reversed."""
    from datasets import Dataset

    from megatron_kto.data.formats import iter_kto_examples

    rows = list(iter_kto_examples(train_jsonl))
    rows = [r for b in range(0, len(rows), batch) for r in reversed(rows[b : b + batch])]
    return Dataset.from_dict(
        {
            "prompt": [r.prompt for r in rows],
            "completion": [r.completion for r in rows],
            "label": [bool(r.label) for r in rows],
        }
    )


def paired_dataset(train_jsonl: Path):
    """The `{"prompt", "chosen", "rejected"}` rows of `train_jsonl` as a `datasets.Dataset`."""
    from datasets import Dataset

    rows = [json.loads(line) for line in train_jsonl.read_text().splitlines() if line.strip()]
    return Dataset.from_dict({k: [r[k] for r in rows] for k in ("prompt", "chosen", "rejected")})


def in_order_trainer(kind: str = "kto"):
    """`KTOTrainer` (or `DPOTrainer`, `kind="dpo"`; the experimental `CPOTrainer`, "cpo", or
    `ORPOTrainer`, "orpo") that takes its rows in dataset order."""
    from torch.utils.data import SequentialSampler
    from trl import DPOTrainer, KTOTrainer

    if kind in ("cpo", "orpo"):
        from trl.experimental.cpo import CPOTrainer
        from trl.experimental.orpo import ORPOTrainer

        base = CPOTrainer if kind == "cpo" else ORPOTrainer
    else:
        base = DPOTrainer if kind == "dpo" else KTOTrainer

    class InOrder(base):
        def _get_train_sampler(self, train_dataset=None):
            return SequentialSampler(train_dataset or self.train_dataset)

    return InOrder


def kto_args(
    output_dir: Path, *, batch: int, steps: int, lr: float, eps: float, clip: float, beta: float
):
    """`KTOConfig` of a fp32 run: constant lr, Adam (0.9, 0.999, `eps`), no weight decay."""
    from trl import KTOConfig

    return KTOConfig(**_common_args(output_dir, batch, steps, lr, eps, clip, beta))


def dpo_args(
    output_dir: Path,
    *,
    batch: int,
    steps: int,
    lr: float,
    eps: float,
    clip: float,
    beta: float,
    **loss: object,
):
    """`DPOConfig` of a fp32 run as `kto_args`; `loss`: `loss_type`, `loss_weights`,
    `label_smoothing`, `f_divergence_type`, ... as TRL names them."""
    from trl import DPOConfig

    return DPOConfig(**_common_args(output_dir, batch, steps, lr, eps, clip, beta), **loss)


def reference_free_args(
    output_dir: Path,
    kind: str,
    *,
    batch: int,
    steps: int,
    lr: float,
    eps: float,
    clip: float,
    beta: float,
    **loss: object,
):
    """`CPOConfig` (`kind="cpo"`) or `ORPOConfig` ("orpo") of a fp32 run as `kto_args`; `loss`:
    `loss_type`, `cpo_alpha`, `simpo_gamma`, ... as TRL names them."""
    from trl.experimental.cpo import CPOConfig
    from trl.experimental.orpo import ORPOConfig

    config = CPOConfig if kind == "cpo" else ORPOConfig
    return config(**_common_args(output_dir, batch, steps, lr, eps, clip, beta), **loss)


def _common_args(output_dir, batch, steps, lr, eps, clip, beta) -> dict:
    return dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=batch,
        max_steps=steps,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=eps,
        max_grad_norm=clip,
        beta=beta,
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


def trl_optimizer_overrides(lr: float, eps: float) -> list[str]:
    """Our optimizer keys set as `_common_args` sets TRL's: a constant learning rate with no
    warm-up, Adam betas (0.9, 0.999), `eps`, no weight decay."""
    return [
        "model.optim.sched.name=Constant",
        "model.optim.sched.warmup_steps=0",
        f"model.optim.lr={lr}",
        f"model.optim.eps={eps}",
        "model.optim.betas=[0.9,0.999]",
        "model.optim.weight_decay=0.0",
    ]


# The KTO trajectory tests' common run: 8 steps of one 8-row micro-batch, β 0.1, constant lr 1e-3,
# Adam ε 1e-5 (see `test_e2e_lora.py`), gradient clip 1.0; fp32 on both sides.
STEPS, BATCH, BETA, LR, EPS, CLIP = 8, 8, 0.1, 1e-3, 1e-5, 1.0
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 2e-6


def trl_kto_trajectory(
    root: Path, aux: bool, steps: int = STEPS, lr: float = LR
) -> tuple[list[float], list[float], dict]:
    """TRL's run of `steps` steps at `lr` from `root/hf` over `root/train.jsonl`: (step losses,
    step aux losses — empty unless `aux`, which must match TRL's own `aux_loss_enabled` — final
    state dict)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = kl_aligned_dataset(root / "train.jsonl", BATCH)
    model = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(root / "hf")
    args = kto_args(root / "trl", batch=BATCH, steps=steps, lr=lr, eps=EPS, clip=CLIP, beta=BETA)
    trainer = in_order_trainer()(
        model=model, args=args, train_dataset=data, processing_class=tokenizer
    )
    assert trainer.aux_loss_enabled == aux
    trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e]
    state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return [e["loss"] for e in logged], [e["aux_loss"] for e in logged if aux], state


def imported_run(root: Path, name: str, start: str = "mcore") -> list[str]:
    """Overrides of a fp32 run of the entry script from the imported `root/mcore` (or another
    `root/<start>`: `hf` loads the Hugging Face directory directly) on `root/train.jsonl` in file
    order, no validation, logging to `root/<name>`."""
    from e2e_cli import QUIET

    return [
        *QUIET,
        f"pretrained_checkpoint.restore_from_path={root / start}",
        f"model.data.data_prefix.train=[{root / 'train.jsonl'}]",
        "model.data.data_prefix.validation=[]",
        "model.data.shuffle=false",
        "model.data.max_length=128",
        "trainer.precision=32",
        f"exp_manager.explicit_log_dir={root / name}",
    ]


def our_kto_trajectory(
    root: Path, name: str, pack: bool, steps: int = STEPS, lr: float = LR
) -> tuple[list[dict], dict]:
    """Our run of `examples/train_gpt_kto.py` from the imported `root/mcore` with the same data,
    order and optimizer as `trl_kto_trajectory`, exported to `root/<name>_hf`: (metrics rows,
    the exported model's fp32 state dict)."""
    import torch
    from e2e_cli import KTO_SCRIPT, REPO, read_metrics, run_script
    from transformers import AutoModelForCausalLM

    log_dir = root / name
    run_script(
        KTO_SCRIPT,
        [
            *imported_run(root, name),
            f"model.data.pack_sequences={str(pack).lower()}",
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
    tool = REPO / "tools" / "convert_checkpoint.py"
    run_script(tool, ["export", "--ckpt", str(log_dir), "--out", str(out)])
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    return read_metrics(log_dir), {k: v.detach().clone() for k, v in model.state_dict().items()}


def prepare_trajectory(
    root: Path, make_hf, aux: bool, steps: int = STEPS, lr: float = LR
) -> tuple[Path, tuple, dict, tuple[int, float]]:
    """A trajectory test's module fixture: `make_hf(root / "hf")` writes the model (and its
    tokenizer), 64 KTO rows go to `root/train.jsonl`, the model is imported (`import_start`) and
    TRL's run of `steps` steps at `lr` made: (root, `trl_kto_trajectory`'s result, the starting
    state dict, (steps, lr))."""
    from hf_tiny import write_kto_rows

    make_hf(root / "hf")
    write_kto_rows(root / "train.jsonl", 0, 64)
    start = import_start(root)
    return root, trl_kto_trajectory(root, aux, steps, lr), start, (steps, lr)


def check_trajectory(
    prepared: tuple, pack: bool, moving: tuple[str, ...], weight_atol: float = WEIGHT_ATOL
) -> dict:
    """Our run (packed or padded) against `prepare_trajectory`'s TRL run
    (`assert_same_trajectory`); returns our exported state dict."""
    root, trl_run, start, (steps, lr) = prepared
    metrics, ours = our_kto_trajectory(root, "packed" if pack else "padded", pack, steps, lr)
    assert_same_trajectory(metrics, ours, trl_run, start, moving, weight_atol)
    return ours


def import_start(root: Path) -> dict:
    """Import `root/hf` into `root/mcore` with `tools/convert_checkpoint.py`; returns the HF
    model's starting fp32 state dict (to show the weights moved)."""
    import torch
    from e2e_cli import REPO, run_script
    from transformers import AutoModelForCausalLM

    tool = REPO / "tools" / "convert_checkpoint.py"
    run_script(tool, ["import", "--hf-dir", str(root / "hf"), "--out", str(root / "mcore")])
    start = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).state_dict()
    return {k: v.clone() for k, v in start.items()}


def assert_same_trajectory(
    metrics, ours, trl_run, start, moving: tuple[str, ...], weight_atol: float = WEIGHT_ATOL
) -> None:
    """Step losses (and aux losses where TRL logs them) to `LOSS_RTOL`, every final weight to
    `weight_atol`, and the tensors whose names contain one of `moving` moved well beyond it."""
    import pytest

    trl_losses, trl_aux, trl_state = trl_run
    losses = [r["loss"] for r in metrics]
    print(f"\nours loss {losses}\ntrl  loss {trl_losses}")
    assert len(losses) == len(trl_losses) and losses
    if trl_aux:
        aux = [r["aux_loss"] for r in metrics]
        print(f"ours aux {aux}\ntrl  aux {trl_aux}")
        assert aux == pytest.approx(trl_aux, rel=LOSS_RTOL)
    else:
        assert all("aux_loss" not in r for r in metrics)
    assert losses == pytest.approx(trl_losses, rel=LOSS_RTOL)
    assert ours.keys() == trl_state.keys()
    worst = max((ours[k] - trl_state[k]).abs().max().item() for k in ours)
    moved = {k: (trl_state[k] - start[k]).abs().max().item() for k in ours}
    print(f"weights: max |ours - trl| {worst:.1e}; smallest move {min(moved.values()):.1e}")
    assert worst <= weight_atol
    named = [k for k in ours if any(m in k for m in moving)]
    assert named and all(moved[k] > 100 * weight_atol for k in named)


# LoRA trajectories: `peft` adapters on both sides (rank, alpha and targets as `LoRARun` says).
@dataclass(frozen=True)
class LoRARun:
    """A LoRA run's adapter shape: `peft` target module names, rank, alpha (dropout 0)."""

    targets: tuple[str, ...]
    rank: int = 4
    alpha: int = 8

    def peft_config(self):
        """The `peft` `LoraConfig` of these adapters."""
        from peft import LoraConfig

        return LoraConfig(
            r=self.rank, lora_alpha=self.alpha, lora_dropout=0.0, target_modules=list(self.targets)
        )

    def overrides(self, adapter: Path) -> list[str]:
        """Our run's keys for these adapters, starting from the `peft` directory `adapter`."""
        return [
            "model.peft.peft_scheme=lora",
            f"model.peft.lora_tuning.adapter_dim={self.rank}",
            f"model.peft.lora_tuning.alpha={self.alpha}",
            f"model.peft.lora_tuning.target_modules=[{','.join(self.targets)}]",
            f"model.peft.restore_from_path={adapter}",
        ]


def our_lora_run(
    root: Path,
    name: str,
    lora: LoRARun,
    adapter: Path,
    steps: int,
    batch: int,
    extra: tuple[str, ...] | list[str] = (),
    start: str = "mcore",
) -> None:
    """Our KTO run (`examples/train_gpt_kto.py` from `root/<start>`, `imported_run`) of `steps`
    steps of `batch` rows in micro-batches of 4 with `lora` from the `peft` adapter `adapter`,
    β / lr / ε / clip as `trl_lora_trajectory`, then `extra` overrides; logs to `root/<name>`."""
    from e2e_cli import KTO_SCRIPT, run_script

    run_script(
        KTO_SCRIPT,
        [
            *imported_run(root, name, start),
            f"trainer.kto.max_steps={steps}",
            f"trainer.kto.gradient_clip_val={CLIP}",
            f"model.global_batch_size={batch}",
            "model.micro_batch_size=4",
            f"model.kto.ref_policy_kl_penalty={BETA}",
            *trl_optimizer_overrides(LR, EPS),
            *lora.overrides(adapter),
            *extra,
        ],
        timeout=600,
    )


def start_adapter(root: Path, lora: LoRARun) -> Path:
    """A `peft` adapter of `lora` on `root/hf` with a non-zero B (0.05·N(0, 1), seed 0), saved
    to `root/adapter0` (returned)."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32)
    model = get_peft_model(base, lora.peft_config())
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    model.save_pretrained(root / "adapter0")
    return root / "adapter0"


def trl_lora_trajectory(
    root: Path, adapter: Path, reference: str, lora: LoRARun, steps: int, batch: int
) -> tuple[list[float], dict]:
    """TRL's KTO run of `steps` steps (batches of `batch`, β / lr / ε / clip of this module)
    from `root/hf` + the `peft` adapter `adapter`: (step losses, final adapter by peft's keys).

    `reference="start"`: the wrapped `PeftModel` without `peft_config` / `ref_model`, for which
    TRL's reference is base + a frozen "ref" copy of the starting adapter; `"base"`:
    `peft_config=lora`, its fresh adapter overwritten with the starting one, reference = the
    adapter disabled."""
    import torch
    from peft import PeftModel, get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = kl_aligned_dataset(root / "train.jsonl", batch)
    base = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(root / "hf")
    trainer_class = in_order_trainer()
    args = kto_args(root / "trl", batch=batch, steps=steps, lr=LR, eps=EPS, clip=CLIP, beta=BETA)
    if reference == "start":
        model = PeftModel.from_pretrained(base, adapter, is_trainable=True)
        trainer = trainer_class(
            model=model, args=args, train_dataset=data, processing_class=tokenizer
        )
        assert set(trainer.model.peft_config) == {"default", "ref"}
    else:
        trainer = trainer_class(
            model=base,
            args=args,
            train_dataset=data,
            processing_class=tokenizer,
            peft_config=lora.peft_config(),
        )
        weights = load_file(str(adapter / "adapter_model.safetensors"))
        result = set_peft_model_state_dict(trainer.model, weights)
        assert not result.unexpected_keys
    model = trainer.model
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    state = {
        k.replace(".default", ""): v.detach().clone()
        for k, v in get_peft_model_state_dict(model).items()
    }
    return losses, state
