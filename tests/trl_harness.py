"""TRL 1.16 `KTOTrainer` / `DPOTrainer` set up to see what our trainer sees, for the trajectory
parity tests.

Same rows in the same order (`SequentialSampler`), the same KL rows — TRL pairs prompt i with
completion i−1 of its batch, we pair it with completion i+1 (DESIGN §1), so TRL gets each batch's
rows in reverse order (KTO only; DPO has no KL rows) — and a constant learning rate without
warm-up or weight decay.
"""

from __future__ import annotations

import json
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
