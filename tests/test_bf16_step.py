"""bf16 mixed precision: bf16 parameters and compute, fp32 gradients, main weights and Adam state.

One KTO step (cpu_swap reference, 2 micro-batches) in `trainer.precision=bf16` against the same
step in fp32 from the same (bf16-representable) weights, the policy moved away from the
reference. bf16 keeps 8 bits of mantissa (relative rounding 2^-9 ≈ 2e-3 per operation), so the
two steps agree to about 1e-2 relative, not to fp32 precision. Measured on this CPU: loss
1.9e-3 relative, worst metric 1.9e-3, worst per-tensor gradient 1.03e-2 (relative L2), updates
cosine 0.995 overall and ≥ 0.969 per tensor; the tolerances are about 5x those.
"""

from __future__ import annotations

import pytest
import torch
from multirank import run_multirank
from test_kto_model import VOCAB, _batch, _settings

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks, unwrap
from megatron_kto.models.kto_model import REF_KL, REF_SAMPLES, MegatronGPTKTOModel
from megatron_kto.models.reference import CPUSwapReference
from megatron_kto.models.training_setup import build_optimizer, wrap_ddp, zero_grads
from megatron_kto.runtime import init_runtime, teardown

LR = 1e-3


def _steps(rank: int, world_size: int) -> dict:
    rt = init_runtime(1, 1, seed=21)
    arch = GPTArchitecture(vocab_size=VOCAB, hidden_size=64, ffn_hidden_size=128, num_layers=2)
    fp32 = build_gpt_chunks(arch, ParallelLayout(precision="32"), rt.device)
    bf16 = build_gpt_chunks(arch, ParallelLayout(precision="bf16"), rt.device)
    with torch.no_grad():
        for p32, p16 in zip(
            unwrap(fp32[0]).parameters(), unwrap(bf16[0]).parameters(), strict=True
        ):
            p32.copy_(p32.bfloat16().float())  # both runs start from the same values
            p16.copy_(p32)
    # The policy starts away from the reference (else every reward is 0 and the loss trivial).
    g = torch.Generator().manual_seed(0)
    moved = {
        n: (p + 0.05 * torch.randn(p.shape, generator=g)).bfloat16().float()
        for n, p in unwrap(fp32[0]).named_parameters()
    }
    out = {}
    for name, chunks in (("fp32", fp32), ("bf16", bf16)):
        # The decoder's final hidden states: what the (completion-only, chunked) output layer
        # multiplies; they are bf16 when the transformer computes in bf16.
        logits_dtype = []
        hook = unwrap(chunks[0]).decoder.final_layernorm.register_forward_hook(
            lambda m, i, o, seen=logits_dtype: seen.append(o.dtype)
        )
        ddp = wrap_ddp(chunks, use_distributed_optimizer=False)
        optimizer = build_optimizer(
            ddp,
            lr=LR,
            min_lr=0.0,
            weight_decay=0.0,
            betas=(0.9, 0.98),
            eps=1e-8,
            clip_grad=0.0,
            precision="bf16" if name == "bf16" else "32",
            use_distributed_optimizer=False,
        )
        model = MegatronGPTKTOModel(ddp, CPUSwapReference(ddp), _settings(2))
        with torch.no_grad():
            for n, p in unwrap(ddp[0]).named_parameters():
                p.copy_(moved[n])
        if name == "bf16":  # fp32 main weights follow the moved bf16 weights
            inner = optimizer.chained_optimizers[0]
            inner.reload_model_params()
        initial = {n: p.detach().float().clone() for n, p in unwrap(ddp[0]).named_parameters()}
        batch = _batch(seed=4)
        batch[REF_SAMPLES], batch[REF_KL] = model.get_ref_policy_logprobs(batch).chunk(2)
        zero_grads(ddp, optimizer)
        _, metrics = model.get_loss_and_metrics(batch, forward_only=False)
        grads = {n: p.main_grad.clone() for n, p in unwrap(ddp[0]).named_parameters()}
        optimizer.step()
        hook.remove()
        inner = optimizer.chained_optimizers[0]
        names = {p: n for n, p in unwrap(ddp[0]).named_parameters()}
        if name == "bf16":  # the fp32 main weights the optimizer updated (bf16 copies round)
            main = {
                names[p]: m
                for group, mains in zip(inner.float16_groups, inner.fp32_from_float16_groups)
                for p, m in zip(group, mains, strict=True)
            }
        else:
            main = {n: p for p, n in names.items()}
        out[name] = {
            "metrics": metrics,
            "grads": grads,
            "update": {n: main[n].detach().float() - initial[n] for n in initial},
            "param_dtypes": {p.dtype for p in unwrap(ddp[0]).parameters()},
            "grad_dtypes": {p.main_grad.dtype for p in unwrap(ddp[0]).parameters()},
            "logits_dtype": set(logits_dtype),
            "adam_dtypes": {
                t.dtype
                for state in inner.optimizer.state.values()
                for k, t in state.items()
                if k != "step"
            },
            "main_dtypes": {p.dtype for g in inner.optimizer.param_groups for p in g["params"]},
        }
    teardown()
    return out


@pytest.fixture(scope="module")
def steps() -> dict:
    # A process of its own: megatron's runtime patches the process (cpu_compat), and a later
    # in-process `transformers` model would run under them.
    return run_multirank(_steps, 1, timeout=240)[0]


def test_bf16_parameters_and_compute_fp32_gradients_and_optimizer(steps) -> None:
    b = steps["bf16"]
    assert b["param_dtypes"] == {torch.bfloat16}
    assert b["logits_dtype"] == {torch.bfloat16}, "the transformer must compute in bf16"
    assert b["grad_dtypes"] == {torch.float32}, "gradients accumulate/reduce in fp32"
    assert b["main_dtypes"] == {torch.float32}, "the optimizer steps fp32 main weights"
    assert b["adam_dtypes"] == {torch.float32}, "Adam moments are fp32"
    assert steps["fp32"]["param_dtypes"] == {torch.float32}


def test_bf16_step_tracks_the_fp32_step(steps) -> None:
    f, b = steps["fp32"], steps["bf16"]
    for key in ("loss", "rewards/chosen", "logps/chosen", "logps/rejected", "kl"):
        ref = f["metrics"][key]
        assert abs(b["metrics"][key] - ref) <= 1e-2 * max(1.0, abs(ref)), key
    for name, g in f["grads"].items():
        rel = (b["grads"][name] - g).norm() / g.norm().clamp(min=1e-12)
        assert rel <= 5e-2, (name, rel.item())
    # Adam's first update is about ±lr per element whatever |g|, so an element whose tiny
    # gradient changes sign under bf16 rounding moves the other way at full size: per tensor
    # the updates agree less closely than the gradients do.
    cos = torch.nn.functional.cosine_similarity
    for name, u in f["update"].items():
        assert cos(b["update"][name].flatten(), u.flatten(), 0) >= 0.85, name
    flat_f = torch.cat([u.flatten() for u in f["update"].values()])
    flat_b = torch.cat([b["update"][n].flatten() for n in f["update"]])
    assert cos(flat_b, flat_f, 0) >= 0.97
