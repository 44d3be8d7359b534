"""No KL pass the loss ignores: `apo_zero_unpaired` never builds or runs the KL rows.

The rows entering each model are counted with forward pre-hooks on the policy's and the
reference's `GPTModel` (megatron-core itself is untouched). A run of the trainer's batch
preparation + one training step on 8 bundled examples is compared with the KL-computing path
(the same settings with KL rows forced on, i.e. what every step did before): the reference then
runs 2B rows and the policy 2B (B forward-only KL rows + B trained), against B and B now; loss,
every metric but `kl`, and every gradient are the same; `kl` reads 0, as TRL logs it when it
skips the KL rows.
"""

from __future__ import annotations

import pytest
import torch
from e2e_cli import TOKENIZER, TRAIN_DATA

from megatron_kto.algorithms.kto import KTOTrainer
from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.data.collate import kto_custom_collate
from megatron_kto.data.dataset import build_kto_dataset
from megatron_kto.data.tokenizers import load_tokenizer
from megatron_kto.logging.throughput import ModelFlops
from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks, unwrap
from megatron_kto.models.kto_model import REF_KL, KTOSettings, MegatronGPTKTOModel
from megatron_kto.models.reference import SeparateReference, copy_weights
from megatron_kto.models.training_setup import wrap_ddp
from megatron_kto.runtime import init_runtime, teardown

ROWS = 8


class _KLRowsForced(KTOSettings):
    """The pre-change behaviour: KL rows built and run although the loss ignores z₀."""

    @property
    def uses_kl_rows(self) -> bool:
        return True


@pytest.fixture(scope="module")
def runtime():
    rt = init_runtime(1, 1, seed=3)
    yield rt
    teardown()


@pytest.fixture(scope="module")
def examples():
    tok = load_tokenizer("sentencepiece", str(TOKENIZER))
    dataset, _ = build_kto_dataset([TRAIN_DATA], tok, 64, use_cache=False)
    return [dataset[i] for i in range(ROWS)], tok.pad_id, tok.vocab_size


def test_collate_without_kl_rows(examples):
    items, pad_id, _ = examples
    with_kl = kto_custom_collate(items, pad_id)
    without = kto_custom_collate(items, pad_id, kl_rows=False)
    assert not any(k.startswith("kl_") for k in without)
    for key in ("samples", "sample_labels", "preference", "sample_lengths"):
        width = without[key].shape[-1]
        assert torch.equal(without[key], with_kl[key][..., :width]), key
    assert without["samples"].shape[1] == int(without["sample_lengths"].max())
    assert kto_custom_collate(items[:1], pad_id, kl_rows=False)["samples"].shape[0] == 1


def _count_rows(chunks, counts: list[int]):
    def hook(_module, args, kwargs):
        # A packed micro-batch is one [1, L] row of several examples (models.packing).
        packed = kwargs.get("packed_seq_params")
        counts.append(packed.num_rows if packed is not None else int(args[0].shape[0]))

    return [unwrap(c).register_forward_pre_hook(hook, with_kwargs=True) for c in chunks]


def _step(runtime, examples, settings_cls, kl_rows: bool):
    items, pad_id, vocab = examples
    arch = GPTArchitecture(vocab_size=vocab, init_method_std=0.1)
    torch.manual_seed(0)
    policy = build_gpt_chunks(arch, ParallelLayout(), runtime.device)
    reference = build_gpt_chunks(arch, ParallelLayout(), runtime.device)
    copy_weights(policy, reference)
    with torch.no_grad():  # a policy that differs from its reference: rewards are not 0
        g = torch.Generator().manual_seed(1)
        for p in policy[0].parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    chunks = wrap_ddp(policy, use_distributed_optimizer=False)
    settings = settings_cls(
        beta=0.5,
        desirable_weight=1.0,
        undesirable_weight=1.3,
        loss_type="apo_zero_unpaired",
        sft_loss_weight=0.0,
        micro_batch_size=2,
        forward_micro_batch_size=4,
        vocab_size=vocab,
    )
    model = MegatronGPTKTOModel(chunks, SeparateReference(reference), settings)
    policy_rows: list[int] = []
    reference_rows: list[int] = []
    hooks = _count_rows(chunks, policy_rows) + _count_rows(reference, reference_rows)
    trainer = KTOTrainer.__new__(KTOTrainer)  # only the batch preparation is used
    trainer.model, trainer.device = model, runtime.device
    # 1 FLOP per token + 0.5 per position of its row: the cost counts exactly the rows run.
    trainer.model_flops = ModelFlops(per_token=1.0, per_position=0.5)
    collated = kto_custom_collate(items, pad_id, kl_rows=kl_rows)
    batch = next(iter(trainer.augment_dataloader([collated])))
    for c in chunks:
        c.zero_grad_buffer()
    loss, metrics = model.get_loss_and_metrics(batch, forward_only=False)
    for h in hooks:
        h.remove()
    grads = {n: p.main_grad.clone() for n, p in chunks[0].module.named_parameters()}
    return {
        "loss": loss,
        "metrics": metrics,
        "grads": grads,
        "policy_rows": sum(policy_rows),
        "reference_rows": sum(reference_rows),
        "has_ref_kl": REF_KL in batch,
        "cost": trainer.step_cost(batch),
        "sample_lengths": batch["sample_lengths"].tolist(),
    }


def test_apo_zero_unpaired_skips_kl_rows_with_same_loss_and_gradients(runtime, examples):
    new = _step(runtime, examples, KTOSettings, kl_rows=False)
    old = _step(runtime, examples, _KLRowsForced, kl_rows=True)

    assert (new["reference_rows"], new["policy_rows"]) == (ROWS, ROWS)
    assert (old["reference_rows"], old["policy_rows"]) == (2 * ROWS, 2 * ROWS)
    assert not new["has_ref_kl"] and old["has_ref_kl"]
    # Throughput accounting counts the work done: samples only (ref fwd + policy fwd/bwd).
    tokens = sum(new["sample_lengths"])
    forward = sum(n + 0.5 * n * n for n in new["sample_lengths"])
    assert new["cost"] == (float(tokens), forward + 3.0 * forward)
    assert old["cost"][0] > tokens

    assert new["metrics"]["kl"] == 0.0
    assert abs(new["loss"] - old["loss"]) <= 1e-6 * max(1.0, abs(old["loss"]))
    compared = [k for k in old["metrics"] if k != "kl"]
    assert "rewards/margins" in compared and "logps/chosen" in compared
    assert abs(old["metrics"]["rewards/margins"]) > 1e-3, "rewards must not be trivially 0"
    for key in compared:
        a, b = new["metrics"][key], old["metrics"][key]
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (key, a, b)
    for name, want in old["grads"].items():
        scale = want.abs().max().item()
        assert scale > 0, name
        assert (new["grads"][name] - want).abs().max().item() <= 1e-5 * scale, name
