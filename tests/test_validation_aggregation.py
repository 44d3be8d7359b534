"""Metrics over several global batches are exact (sum, count) aggregates, not means of per-batch
means; a cpu_swap validation pass swaps the reference weights in once.

One process, a tiny randomly initialised model whose policy is moved away from its reference so
rewards are non-zero, and global batches whose class mix differs (one has no undesirable row):
* validation: each metric must equal its per-example definition over all validation rows,
  computed here directly from forward passes (policy and reference log-probs of every row);
* training with `trainer.log_every_n_steps=2`: each logged row must equal the count-weighted
  combination of the two per-step rows of an identical run logged every step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_kto.algorithms.dpo import LoopSettings
from megatron_kto.algorithms.kto import KTOTrainer
from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks
from megatron_kto.models.forward import LOGP_SUM, forward_sequence_stats
from megatron_kto.models.kto_model import KTOSettings, MegatronGPTKTOModel
from megatron_kto.models.reference import CPUSwapReference, copy_weights
from megatron_kto.models.training_setup import build_optimizer, build_scheduler, wrap_ddp
from megatron_kto.runtime import init_runtime, teardown

VOCAB, BETA = 100, 0.5
#: Class mix of each global batch (1 desirable): all desirable, one desirable, mixed.
PREFERENCES = ([1, 1, 1, 1], [1, 0, 0, 0], [0, 1, 1, 0], [0, 0, 1, 0])


def _batch(seed: int, preference: list[int], rows: int = 4, length: int = 10) -> dict:
    g = torch.Generator().manual_seed(seed)
    samples = torch.randint(0, VOCAB, (rows, length), generator=g)
    kl = torch.randint(0, VOCAB, (rows, length), generator=g)
    labels = []
    for tokens in (samples, kl):
        lab = tokens.roll(-1, 1).clone()
        lab[:, :3], lab[:, -1] = -100, -100
        labels.append(lab)
    return {
        "samples": samples,
        "kl_samples": kl,
        "sample_labels": labels[0],
        "kl_sample_labels": labels[1],
        "position_ids": torch.arange(length).expand(rows, length).clone(),
        "preference": torch.tensor(preference),
        "sample_lengths": torch.full((rows,), length),
        "kl_sample_lengths": torch.full((rows,), length),
    }


BATCHES = [_batch(10 + i, p) for i, p in enumerate(PREFERENCES)]


class _Rows:
    def __init__(self) -> None:
        self.rows: list[tuple[str, int, dict]] = []

    def log(self, split: str, step: int, consumed: int, metrics: dict) -> None:
        self.rows.append((split, step, dict(metrics)))

    def update(self, *args) -> None: ...
    def validation(self, *args) -> None: ...

    def close(self) -> None: ...


@pytest.fixture(scope="module")
def runtime():
    rt = init_runtime(1, 1, seed=7)
    yield rt
    teardown()


def _trainer(runtime, template, log_every: int, max_steps: int = 0) -> KTOTrainer:
    arch = GPTArchitecture(vocab_size=VOCAB, make_vocab_size_divisible_by=128)
    chunks = build_gpt_chunks(arch, ParallelLayout(), runtime.device)
    copy_weights(template, chunks)
    chunks = wrap_ddp(chunks, use_distributed_optimizer=False)
    reference = CPUSwapReference(chunks)  # the reference = the weights now
    with torch.no_grad():  # move the policy so that rewards and z0 are not 0
        g = torch.Generator().manual_seed(1)
        for p in chunks[0].module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    settings = KTOSettings(BETA, 1.0, 1.3, "kto", 0.0, 2, 2, VOCAB)
    model = MegatronGPTKTOModel(chunks, reference, settings)
    optimizer = build_optimizer(
        chunks, lr=1e-2, min_lr=1e-2, weight_decay=0.0, betas=(0.9, 0.98), eps=1e-8,
        clip_grad=1.0, precision="32", use_distributed_optimizer=False,
    )  # fmt: skip
    scheduler = build_scheduler(
        optimizer, name="Constant", lr=1e-2, min_lr=1e-2, warmup_steps=0, constant_steps=0,
        max_steps=max(1, max_steps), weight_decay=0.0,
    )  # fmt: skip
    loop = LoopSettings(
        max_steps=max_steps, steps_per_epoch=len(BATCHES), val_check_interval=1000,
        limit_val_batches=len(BATCHES), save_interval=0, log_every_n_steps=log_every,
        global_batch_size=4,
    )  # fmt: skip
    rows = _Rows()
    return KTOTrainer(
        model, optimizer, scheduler,
        train_loader=lambda epoch, done: [dict(b) for b in BATCHES[done:]],
        val_loader=lambda: [dict(b) for b in BATCHES],
        loop=loop, device=runtime.device, logger=rows, progress=rows,
    )  # fmt: skip


@pytest.fixture(scope="module")
def template(runtime):
    arch = GPTArchitecture(vocab_size=VOCAB, make_vocab_size_divisible_by=128)
    return build_gpt_chunks(arch, ParallelLayout(), runtime.device)


def _logps(chunks, tokens, labels, positions) -> np.ndarray:
    stats = forward_sequence_stats(chunks, tokens, labels, positions, 4, VOCAB)
    return stats[:, LOGP_SUM].double().numpy()


def test_validation_metrics_are_per_example_means_over_the_pass(runtime, template, monkeypatch):
    trainer = _trainer(runtime, template, log_every=1)
    model = trainer.model
    swaps = []
    original = model.reference.swapped
    monkeypatch.setattr(model.reference, "swapped", lambda: swaps.append(1) or original())
    metrics = trainer.run_validation()
    assert len(swaps) == 1, "cpu_swap must swap the reference in once per validation pass"
    monkeypatch.undo()

    # Expected, from forward passes of every row (no metric code involved).
    rewards, policy, desirable, z0s = [], [], [], []
    for b in BATCHES:
        pol = _logps(model.chunks, b["samples"], b["sample_labels"], b["position_ids"])
        pol_kl = _logps(model.chunks, b["kl_samples"], b["kl_sample_labels"], b["position_ids"])
        with model.reference.swapped() as ref_chunks:
            ref = _logps(ref_chunks, b["samples"], b["sample_labels"], b["position_ids"])
            ref_kl = _logps(ref_chunks, b["kl_samples"], b["kl_sample_labels"], b["position_ids"])
        rewards += list(BETA * (pol - ref))
        policy += list(pol)
        desirable += b["preference"].bool().tolist()
        z0s.append(max(0.0, float(np.mean(pol_kl - ref_kl))))
    rewards, policy, desirable = np.array(rewards), np.array(policy), np.array(desirable)
    expected = {
        "rewards/chosen": rewards[desirable].mean(),
        "rewards/rejected": rewards[~desirable].mean(),
        "logps/chosen": policy[desirable].mean(),
        "logps/rejected": policy[~desirable].mean(),
        "kl": np.mean(z0s),
    }
    expected["rewards/margins"] = expected["rewards/chosen"] - expected["rewards/rejected"]
    assert max(z0s) > 0, "the test should exercise a positive z0"
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name

    # The old aggregation (mean of per-batch means, absent class = 0) is measurably different.
    per_batch = [model.get_loss_and_metrics(dict(b, **_refs(model, b)), True)[1] for b in BATCHES]
    old = np.mean([m["rewards/rejected"] for m in per_batch])
    assert abs(old - expected["rewards/rejected"]) > 1e-3 * abs(expected["rewards/rejected"])


def _refs(model, batch) -> dict:
    ref = model.get_ref_policy_logprobs(batch)
    return {"ref_policy_log_probs_samples": ref[:4], "ref_policy_log_probs_kl": ref[4:]}


def test_logged_train_row_is_the_count_weighted_interval(runtime, template):
    every = _trainer(runtime, template, log_every=1, max_steps=4)
    every.fit()
    pairs = _trainer(runtime, template, log_every=2, max_steps=4)
    pairs.fit()
    steps = {step: m for split, step, m in every.logger.rows if split == "train"}
    logged = {step: m for split, step, m in pairs.logger.rows if split == "train"}
    assert sorted(steps) == [1, 2, 3, 4] and sorted(logged) == [2, 4]
    for end in (2, 4):
        a, b = steps[end - 1], steps[end]
        n_a, n_b = (sum(PREFERENCES[s - 1]) for s in (end - 1, end))
        u_a, u_b = 4 - n_a, 4 - n_b
        want = {
            "rewards/chosen": (a["rewards/chosen"] * n_a + b["rewards/chosen"] * n_b) / (n_a + n_b),
            "rewards/rejected": (a["rewards/rejected"] * u_a + b["rewards/rejected"] * u_b)
            / (u_a + u_b),
            "logps/chosen": (a["logps/chosen"] * n_a + b["logps/chosen"] * n_b) / (n_a + n_b),
            "loss": (a["loss"] + b["loss"]) / 2,  # equal batch sizes
            "kl": (a["kl"] + b["kl"]) / 2,
            "grad_norm": (a["grad_norm"] + b["grad_norm"]) / 2,
            "lr": b["lr"],
            "skipped_step": 0.0,
        }
        want["rewards/margins"] = want["rewards/chosen"] - want["rewards/rejected"]
        got = logged[end]
        for name, value in want.items():
            assert got[name] == pytest.approx(value, rel=1e-9, abs=1e-12), (end, name)
        # Not the last step's values (the interval really mixes two steps).
        assert got["rewards/chosen"] != pytest.approx(b["rewards/chosen"], rel=1e-6)
        assert got["tokens_per_sec"] > 0 and got["step_time"] > 0
