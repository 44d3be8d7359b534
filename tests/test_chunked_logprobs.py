"""Log-probs only where the loss looks (one process, TP=1): the completion-only, chunked output
layer equals the full-logits path in values and gradients.

* `chunked_token_logprobs` against float64 `log_softmax` of the full logits with a padded
  vocabulary, for chunk sizes that split the tokens unevenly, one token per chunk, and one
  chunk for all: log-probs, mean logits, and gradients w.r.t. hidden states and weight.
* A real megatron-core `GPTModel` (DDP-wrapped, through megatron's schedule, 2 micro-batches)
  with untied and tied embeddings: the per-row statistics and every parameter's gradient of a
  nonlinear loss are the same with `logprob_chunk_size` 3 as with 0 (full logits), to 1e-5 of
  each gradient tensor's largest entry.
* A bf16 weight outside megatron DDP gets its gradient summed in fp32 and rounded once.
* `hidden_states_output` really skips the output layer and always restores the model.
* Memory (torch's CPU allocator, `planning.measure.AllocationTrace`): the chunked head's peak
  over its forward + backward holds one chunk's logits and the weight gradient, so it does not
  grow with the number of scored tokens beyond their [N, H] hidden-state gradient, while full
  logits grow by 3 x N x V floats (`tools/bench_logprobs.py --vocab 262144` shows it at
  Gemma 3's vocabulary).
"""

from __future__ import annotations

import pytest
import torch

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks
from megatron_kto.models.chunked_logprobs import chunked_token_logprobs
from megatron_kto.models.forward import (
    LOGIT_SUM,
    LOGP_SUM,
    NUM_TOKENS,
    forward_sequence_stats,
    stats_forward_step,
)
from megatron_kto.models.logprobs import IGNORE_INDEX
from megatron_kto.models.output_head import hidden_states_output
from megatron_kto.models.schedule import run_schedule, split_micro_batches, to_device
from megatron_kto.models.training_setup import wrap_ddp
from megatron_kto.planning.measure import AllocationTrace
from megatron_kto.runtime import init_runtime, teardown

VOCAB, PADDED = 100, 128
TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def runtime():
    rt = init_runtime(1, 1, seed=5)
    yield rt
    teardown()


@pytest.mark.parametrize("chunk_size", [1, 4, 1000])
def test_chunked_logprobs_match_float64_log_softmax(chunk_size):
    g = torch.Generator().manual_seed(0)
    n, h = 11, 16
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    weight = (torch.randn(PADDED, h, generator=g) * 0.5).requires_grad_()
    target = torch.randint(0, VOCAB, (n,), generator=g)
    upstream = torch.randn(n, generator=g)  # a random weighting, so every token's grad differs

    logp, mean_logit = chunked_token_logprobs(hidden, weight, target, chunk_size, VOCAB)
    (logp * upstream).sum().backward()

    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    logits = h64 @ w64[:VOCAB].t()  # padded rows are not tokens
    want = torch.log_softmax(logits, -1).gather(-1, target[:, None])[:, 0]
    (want * upstream.double()).sum().backward()

    assert (want.min() < -3) and (want.std() > 0.5), "informative log-probs"
    torch.testing.assert_close(logp.double(), want.detach(), rtol=0, atol=TOL)
    torch.testing.assert_close(mean_logit.double(), logits.detach().mean(-1), rtol=0, atol=TOL)
    torch.testing.assert_close(hidden.grad.double(), h64.grad, rtol=0, atol=TOL)
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=0, atol=TOL)
    assert (weight.grad[VOCAB:] == 0).all(), "padded vocabulary rows get no gradient"
    assert not mean_logit.requires_grad


def test_bf16_weight_gradient_is_rounded_once_not_per_chunk():
    """Outside megatron DDP (no `main_grad`) a bf16 weight's gradient is the fp32 sum over its
    300 one-token chunks, rounded to bf16 once: within one bf16 rounding (2⁻⁸ relative) of the
    exact sum (`test_bf16_chunked_head`'s float64 reference); a running bf16 sum is ~1e-2 off."""
    from test_bf16_chunked_head import reference_weight_grad

    g = torch.Generator().manual_seed(0)
    n, h = 300, 64
    hidden = torch.randn(n, h, generator=g).bfloat16()
    weight = (torch.randn(PADDED, h, generator=g) * 0.1).bfloat16().requires_grad_()
    target = torch.randint(0, VOCAB, (n,), generator=g)
    upstream = torch.randn(n, generator=g)
    logp, _ = chunked_token_logprobs(hidden, weight, target, 1, VOCAB)
    logp.backward(upstream)
    want = reference_weight_grad(
        [{"hidden": hidden, "weight": weight.detach(), "target": target, "grad": upstream}]
    )
    assert weight.grad.dtype == torch.bfloat16
    assert (weight.grad.double() - want).norm() <= 2**-8 * want.norm()


def _batch(rows: int = 4, length: int = 12, seed: int = 1) -> dict[str, torch.Tensor]:
    """Rows with different prompt lengths and right padding: scored positions differ per row."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (rows, length), generator=g)
    labels = torch.full_like(tokens, IGNORE_INDEX)
    labels[:, :-1] = tokens[:, 1:]
    for i in range(rows):
        labels[i, : 2 + i] = IGNORE_INDEX  # prompt
        labels[i, length - 1 - (i % 3) :] = IGNORE_INDEX  # padding
    positions = torch.arange(length).expand(rows, length).contiguous()
    return {"tokens": tokens, "labels": labels, "position_ids": positions}


def _loss(batch, stats):
    """Nonlinear in each row's log-prob, so a mis-routed or mis-scaled row would show."""
    logp = stats[:, LOGP_SUM]
    loss = (-logp + 0.05 * logp.square()).mean()
    return loss, {"stats": stats.detach().clone()}


def _train_pass(chunks, batch, chunk_size: int):
    for c in chunks:
        c.zero_grad_buffer()
    device_batch = to_device(batch, torch.device("cpu"))
    scored = device_batch["host_scored"]["labels"]
    micro = split_micro_batches(device_batch, 2, scored=scored)
    step = stats_forward_step(_loss, VOCAB, chunk_size)
    reported = run_schedule(chunks, micro, step, forward_only=False)
    stats = torch.cat([r["stats"] for r in reported])
    grads = {n: p.main_grad.clone() for n, p in chunks[0].module.named_parameters()}
    return stats, grads


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_model_stats_and_gradients_equal_full_logits(runtime, tied):
    arch = GPTArchitecture(
        vocab_size=VOCAB,
        padded_vocab_size=PADDED,
        share_embeddings_and_output_weights=tied,
        init_method_std=0.1,
    )
    chunks = wrap_ddp(build_gpt_chunks(arch, ParallelLayout(), runtime.device), False)
    batch = _batch()
    full_stats, full_grads = _train_pass(chunks, batch, chunk_size=0)
    chunk_stats, chunk_grads = _train_pass(chunks, batch, chunk_size=3)

    counts = (batch["labels"] != IGNORE_INDEX).sum(-1).float()
    assert torch.equal(full_stats[:, NUM_TOKENS], counts)
    torch.testing.assert_close(chunk_stats, full_stats, rtol=TOL, atol=TOL)
    assert full_stats[:, LOGP_SUM].std() > 1.0 and full_stats[:, LOGIT_SUM].abs().max() > 0
    assert set(chunk_grads) == set(full_grads)
    for name, want in full_grads.items():
        scale = want.abs().max().item()
        assert scale > 0, f"{name}: no gradient reaches it"
        # Relative to the tensor's largest entry: the two paths sum in different orders, so tiny
        # entries differ by fp32 rounding of the large ones (measured ≤ 5e-7 of the scale).
        err = (chunk_grads[name] - want).abs().max().item()
        assert err <= TOL * scale, f"{name}: max |Δ| {err:.2e} vs scale {scale:.2e}"

    # Forward-only passes (reference / KL rows) agree too.
    with torch.no_grad():
        args = (batch["tokens"], batch["labels"], batch["position_ids"], 2, VOCAB)
        full = forward_sequence_stats(chunks, *args, chunk_size=0)
        chunked = forward_sequence_stats(chunks, *args, chunk_size=5)
    torch.testing.assert_close(chunked, full, rtol=TOL, atol=TOL)


def test_hidden_states_output_skips_the_output_layer_and_restores(runtime):
    arch = GPTArchitecture(vocab_size=VOCAB, padded_vocab_size=PADDED)
    (model,) = build_gpt_chunks(arch, ParallelLayout(), runtime.device)
    batch = _batch()
    calls = []
    hook = model.output_layer.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad(), hidden_states_output(model):
        hidden = model(batch["tokens"], batch["position_ids"], None)
    assert hidden.shape == (12, 4, arch.hidden_size) and not calls
    assert model.post_process
    with pytest.raises(RuntimeError), hidden_states_output(model):
        raise RuntimeError("boom")
    assert model.post_process, "restored after an exception"
    with torch.no_grad():
        logits = model(batch["tokens"], batch["position_ids"], None)
    assert logits.shape == (4, 12, PADDED) and calls == [1]
    hook.remove()


def test_dpo_step_equal_with_chunked_logprobs(runtime):
    """DPO shares the machinery: loss, metrics and gradients of one training step agree."""
    from megatron_kto.models.dpo_model import (
        REF_CHOSEN,
        REF_REJECTED,
        DPOSettings,
        MegatronGPTDPOModel,
    )
    from megatron_kto.models.reference import SeparateReference, copy_weights

    arch = GPTArchitecture(vocab_size=VOCAB, padded_vocab_size=PADDED, init_method_std=0.1)
    policy = build_gpt_chunks(arch, ParallelLayout(), runtime.device)
    reference = build_gpt_chunks(arch, ParallelLayout(), runtime.device)
    copy_weights(policy, reference)
    with torch.no_grad():
        for p in reference[0].parameters():
            p.add_(0.05 * torch.randn_like(p))
    chunks = wrap_ddp(policy, False)
    chosen, rejected = _batch(), _batch(seed=2)
    cpu_batch = {
        "chosen": chosen["tokens"],
        "rejected": rejected["tokens"],
        "chosen_labels": chosen["labels"],
        "rejected_labels": rejected["labels"],
        "position_ids": chosen["position_ids"],
    }
    results = {}
    for chunk_size in (0, 3):
        settings = DPOSettings(
            beta=0.3,
            loss_type="sigmoid",
            label_smoothing=0.0,
            average_log_probs=False,
            sft_loss_weight=0.2,
            micro_batch_size=2,
            forward_micro_batch_size=2,
            vocab_size=VOCAB,
            logprob_chunk_size=chunk_size,
        )
        model = MegatronGPTDPOModel(chunks, SeparateReference(reference), settings)
        batch = to_device(cpu_batch, runtime.device)
        batch[REF_CHOSEN], batch[REF_REJECTED] = model.get_ref_policy_logprobs(batch).chunk(2)
        for c in chunks:
            c.zero_grad_buffer()
        loss, metrics = model.get_loss_and_metrics(batch, forward_only=False)
        grads = {n: p.main_grad.clone() for n, p in chunks[0].module.named_parameters()}
        results[chunk_size] = (loss, metrics, grads)
    (loss0, m0, g0), (loss3, m3, g3) = results[0], results[3]
    assert abs(m0["rewards/margins"]) > 1e-3
    assert abs(loss3 - loss0) <= TOL * max(1.0, abs(loss0))
    for key, want in m0.items():
        assert abs(m3[key] - want) <= TOL * max(1.0, abs(want)), key
    for name, want in g0.items():
        scale = want.abs().max().item()
        assert scale > 0 and (g3[name] - want).abs().max().item() <= TOL * scale, name


def _head_peaks(cases: list[tuple[int, int | None]], vocab: int, hidden: int) -> list[int]:
    """Bytes the output head's forward + backward adds at its peak, per (tokens, chunk) case
    (chunked, or full logits with `log_softmax` when chunk is None), in one allocator trace."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(vocab, hidden, generator=g, requires_grad=True)
    with AllocationTrace() as trace:
        for tokens, chunk in cases:
            h = torch.randn(tokens, hidden, generator=g, requires_grad=True)
            target = torch.randint(0, vocab, (tokens,), generator=g)
            with trace.window():
                if chunk is None:
                    logp = torch.log_softmax(h @ w.t(), -1).gather(1, target[:, None])[:, 0]
                else:
                    logp, _ = chunked_token_logprobs(h, w, target, chunk, vocab)
                logp.sum().backward()
                del logp
            del h, target
            w.grad = None
    return [peak - start for start, peak in trace.windows]


def test_chunked_head_peak_is_flat_in_the_scored_tokens():
    """V 2048, H 16, chunks of 32, N = 128 and 1024 scored tokens. Chunked: the peak is the
    weight gradient (V·H·4 B, 0.125 MiB) plus a chunk's fp32 logits and their softmax (2·c·V·4,
    0.5 MiB), so going from N to 8N adds only per-token terms — the [N, H] hidden-state gradient
    and a few fp32 values per token (≤ H·4 + 32 B each). Full logits: the [N, V] logits, their
    log-softmax and its gradient (≥ 3·N·V·4 B, 24 MiB at N = 1024) — the test fails for a head
    that keeps [N, V]."""
    vocab, hidden, chunk, small, large = 2048, 16, 32, 128, 1024
    small_peak, large_peak, full = _head_peaks(
        [(small, chunk), (large, chunk), (large, None)], vocab, hidden
    )
    assert large_peak - small_peak <= (large - small) * (hidden * 4 + 32)
    assert large_peak <= vocab * 4 * (hidden + 3 * chunk) + large * (hidden * 4 + 32)
    assert full >= 3 * large * vocab * 4 > 20 * large_peak
