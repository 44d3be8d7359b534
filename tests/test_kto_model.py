"""MegatronGPTKTOModel on one process: the efficient path equals a naive autograd implementation.

The efficient path computes the KL rows' policy log-probs forward-only (no graph), z₀ from them,
then forward+backward over the sample rows only, in micro-batches through megatron-core's
schedule. The naive path runs samples *and* KL rows through one autograd graph with a plain
model call and the same (detached) z₀. Gradients must agree.
"""

from __future__ import annotations

import pytest
import torch

from megatron_kto.algorithms.kto import KTOTrainer
from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.losses.kto import kto_total_loss
from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks
from megatron_kto.models.kto_model import REF_KL, REF_SAMPLES, KTOSettings, MegatronGPTKTOModel
from megatron_kto.models.logprobs import masked_sum, token_logprobs
from megatron_kto.models.reference import CPUSwapReference, SeparateReference, copy_weights
from megatron_kto.models.training_setup import wrap_ddp
from megatron_kto.runtime import init_runtime, set_seed, teardown

VOCAB = 100


def _batch(
    rows: int = 4, length: int = 12, prompt: int = 4, seed: int = 0
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    samples = torch.randint(0, VOCAB, (rows, length), generator=g)
    kl = torch.randint(0, VOCAB, (rows, length), generator=g)
    sample_labels = samples.roll(-1, 1).clone()
    kl_labels = kl.roll(-1, 1).clone()
    for labels in (sample_labels, kl_labels):
        labels[:, : prompt - 1] = -100
        labels[:, -1] = -100
    return {
        "samples": samples,
        "kl_samples": kl,
        "sample_labels": sample_labels,
        "kl_sample_labels": kl_labels,
        "position_ids": torch.arange(length).expand(rows, length).clone(),
        "preference": torch.tensor([1, 0, 1, 1][:rows]),
        "sample_lengths": torch.full((rows,), length),
        "kl_sample_lengths": torch.full((rows,), length),
    }


@pytest.fixture(scope="module")
def runtime():
    rt = init_runtime(1, 1, seed=7)
    yield rt
    teardown()


#: NeMo-Aligner's loss options: length-normalised rewards (and z₀), summed SFT NLL, a weight on
#: the KTO term.
NEMO_OPTIONS = dict(average_log_probs=True, sft_average_log_probs=False, preference_loss_weight=0.7)


def _settings(micro_batch_size: int, sft: float = 0.0, **options) -> KTOSettings:
    return KTOSettings(
        **options,
        beta=0.5,
        desirable_weight=1.0,
        undesirable_weight=1.5,
        loss_type="kto",
        sft_loss_weight=sft,
        micro_batch_size=micro_batch_size,
        forward_micro_batch_size=2,
        vocab_size=VOCAB,
    )


def _grads(chunks) -> dict[str, torch.Tensor]:
    return {n: p.main_grad.clone() for n, p in chunks[0].module.named_parameters()}


@pytest.mark.parametrize("micro_batch_size", [1, 4])
@pytest.mark.parametrize("sft,options", [(0.0, {}), (0.3, {}), (0.3, NEMO_OPTIONS)])
def test_efficient_gradient_equals_naive(runtime, micro_batch_size, sft, options):
    set_seed(7)  # the same initial weights whichever tests ran before
    arch = GPTArchitecture(vocab_size=VOCAB, make_vocab_size_divisible_by=128)
    policy = build_gpt_chunks(arch, ParallelLayout(), runtime.device)
    reference_chunks = build_gpt_chunks(arch, ParallelLayout(), runtime.device)
    copy_weights(policy, reference_chunks)
    # A noisier reference is sharper, so it scores random completions lower: r > 0 and z₀ > 0.
    g = torch.Generator().manual_seed(3)  # fixed: the test must not depend on test order
    with torch.no_grad():
        for p in reference_chunks[0].parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    chunks = wrap_ddp(policy, use_distributed_optimizer=False)
    model = MegatronGPTKTOModel(
        chunks, SeparateReference(reference_chunks), _settings(micro_batch_size, sft, **options)
    )

    batch = _batch()
    for i in range(4):  # completions of different lengths, so per-token means differ from sums
        batch["sample_labels"][i, 3 : 3 + i] = -100
        batch["kl_sample_labels"][i, 3 : 3 + 2 * i] = -100
    ref = model.get_ref_policy_logprobs(batch)
    batch[REF_SAMPLES], batch[REF_KL] = ref.chunk(2)
    for c in chunks:
        c.zero_grad_buffer()
    loss, metrics = model.get_loss_and_metrics(batch, forward_only=False)
    efficient = _grads(chunks)

    # Naive: one autograd graph over samples and KL rows, plain forward, same formula.
    for c in chunks:
        c.zero_grad_buffer()
    net = chunks[0].module
    tokens = torch.cat([batch["samples"], batch["kl_samples"]])
    labels = torch.cat([batch["sample_labels"], batch["kl_sample_labels"]])
    logits = net(tokens, torch.cat([batch["position_ids"]] * 2), None)
    logps, counts = masked_sum(token_logprobs(logits, labels, VOCAB), labels)
    policy_samples, policy_kl = logps.chunk(2)
    r_kl = policy_kl - batch[REF_KL]
    if options.get("average_log_probs"):
        r_kl = r_kl / counts.chunk(2)[1]
    z0 = r_kl.mean().clamp(min=0).detach()
    out = kto_total_loss(
        policy_samples,
        batch[REF_SAMPLES],
        batch["preference"].bool(),
        z0,
        beta=0.5,
        desirable_weight=1.0,
        undesirable_weight=1.5,
        sft_loss_weight=sft,
        num_tokens=counts.chunk(2)[0],
        **options,
    )
    out.loss.backward()
    chunks[0].finish_grad_sync()
    naive = _grads(chunks)

    assert abs(loss - out.loss.item()) < 1e-6
    # z₀ is a difference of two ~-40 sums: the chunked completion-only output layer sums in
    # another order than full logits, so compare relative to the summed magnitudes.
    assert abs(metrics["kl"] - z0.item()) < 1e-5 * max(1.0, z0.item())
    assert z0.item() > 0, "test should exercise a positive KL reference point"
    for name in naive:
        torch.testing.assert_close(efficient[name], naive[name], rtol=1e-5, atol=1e-7, msg=name)


def test_cpu_swap_reference_restores_policy(runtime):
    arch = GPTArchitecture(vocab_size=VOCAB)
    chunks = wrap_ddp(build_gpt_chunks(arch, ParallelLayout(), runtime.device), False)
    reference = CPUSwapReference(chunks)
    initial = [p.detach().clone() for p in chunks[0].parameters()]
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.add_(1.0)
    moved = [p.detach().clone() for p in chunks[0].parameters()]
    with reference.swapped() as ref_chunks:
        for p, want in zip(ref_chunks[0].parameters(), initial, strict=True):
            assert torch.equal(p, want)
    for p, want in zip(chunks[0].parameters(), moved, strict=True):
        assert torch.equal(p, want)


def test_cpu_swap_and_separate_give_same_reference_logprobs(runtime):
    arch = GPTArchitecture(vocab_size=VOCAB)
    policy = build_gpt_chunks(arch, ParallelLayout(), runtime.device)
    ref_chunks = build_gpt_chunks(arch, ParallelLayout(), runtime.device)
    copy_weights(policy, ref_chunks)
    chunks = wrap_ddp(policy, False)
    swap = MegatronGPTKTOModel(chunks, CPUSwapReference(chunks), _settings(2))
    separate = MegatronGPTKTOModel(chunks, SeparateReference(ref_chunks), _settings(2))
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.mul_(1.1)
    batch = _batch()
    torch.testing.assert_close(
        swap.get_ref_policy_logprobs(batch), separate.get_ref_policy_logprobs(batch)
    )


def test_trainer_attaches_sample_and_kl_halves(runtime):
    arch = GPTArchitecture(vocab_size=VOCAB)
    chunks = wrap_ddp(build_gpt_chunks(arch, ParallelLayout(), runtime.device), False)
    model = MegatronGPTKTOModel(chunks, CPUSwapReference(chunks), _settings(2))
    trainer = KTOTrainer.__new__(KTOTrainer)
    trainer.model, trainer.device = model, runtime.device
    batch = next(iter(trainer.augment_dataloader([_batch()])))
    ref = model.get_ref_policy_logprobs(_batch())
    torch.testing.assert_close(batch[REF_SAMPLES], ref[:4])
    torch.testing.assert_close(batch[REF_KL], ref[4:])


def test_nemo_ddp_options_reach_megatron_ddp(runtime):
    """model.optim.overlap_grad_sync / bucket_cap_mb become megatron DDP's overlap_grad_reduce /
    bucket_size (MiB of fp32 gradients, 4 bytes each)."""
    from megatron_kto.run import _bucket_size

    assert _bucket_size(None) is None and _bucket_size(200) == 200 * 2**20 // 4
    arch = GPTArchitecture(vocab_size=VOCAB, make_vocab_size_divisible_by=128)
    chunks = build_gpt_chunks(arch, ParallelLayout(), runtime.device)
    ddp = wrap_ddp(chunks, False, overlap_grad_reduce=True, bucket_size=_bucket_size(1))[0]
    assert ddp.ddp_config.overlap_grad_reduce and ddp.ddp_config.bucket_size == 2**18
    plain = wrap_ddp(build_gpt_chunks(arch, ParallelLayout(), runtime.device), False)[0]
    assert not plain.ddp_config.overlap_grad_reduce
