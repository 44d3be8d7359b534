"""SDPA core attention, the local-spec norms and activation recomputation, on one process (fp32).

`SDPAttention` must compute what megatron-core's own `DotProductAttention` computes (the local
spec's attention, which materialises the scores): module against module on random inputs, and a
whole `GPTModel` built with `attention_backend=sdpa` against the same weights with `local`,
in log-probs and in every parameter's gradient. Multi-rank layouts (TP=2, PP=2) are in
`test_attention_parallel.py`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_parallel_common import make_batch, tiny_arch

from megatron_kto.models import attention as attention_module
from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks, make_transformer_config
from megatron_kto.models.logprobs import masked_sum, token_logprobs
from megatron_kto.models.norms import LocalNorm
from megatron_kto.runtime import init_runtime, teardown
from megatron_kto.runtime.gpu_settings import Accelerator

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def runtime():
    rt = init_runtime(1, 1, seed=5)
    yield rt
    teardown()


def _reseed(seed: int) -> None:
    """Same default and megatron tensor-parallel RNG streams (dropout) for a repeated run."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# Backend selection
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "machine,precision,pack,request_,want",
    [
        (Accelerator(cuda=False), "32", True, "auto", "sdpa"),
        (Accelerator(cuda=True, transformer_engine="2.9.0"), "32", True, "auto", "sdpa"),
        (Accelerator(cuda=True, transformer_engine="2.9.0"), "bf16", True, "auto", "te"),
        (Accelerator(cuda=True, transformer_engine="2.9.0"), "32", False, "te", "te"),
        (Accelerator(cuda=True, transformer_engine="2.11.0"), "32", True, "te", "te"),
        (Accelerator(cuda=True, transformer_engine="2.9.0"), "bf16", False, "local", "local"),
    ],
)
def test_the_builder_takes_its_backend_from_the_decision(
    monkeypatch, machine, precision, pack, request_, want
):
    """`build_gpt_chunks` builds with what `choose_attention_backend` decides for the stated
    machine and the layout's precision and packing (no TE spec is built on this CPU)."""
    from megatron_kto.models import builder

    monkeypatch.setattr(
        builder.Accelerator, "detect", classmethod(lambda cls, read_device=False: machine)
    )
    layout = ParallelLayout(precision=precision, pack_sequences=pack, attention_backend=request_)
    assert builder.attention_choice(tiny_arch(), layout).backend == want


def test_the_builder_decides_again_with_the_gpu_known(monkeypatch, caplog):
    """Start-up cannot read the GPU generation (it would initialise CUDA); the builder can, and
    an A100 without flash-attn has no TE kernel for packed input on TE 2.9: auto becomes sdpa,
    with a warning, where the start-up check (GPU unread) expected te."""
    from megatron_kto.models import builder

    def detect(cls, read_device=False):
        return Accelerator(
            cuda=True,
            transformer_engine="2.9.0",
            compute_capability=(8, 0) if read_device else None,
        )

    monkeypatch.setattr(builder.Accelerator, "detect", classmethod(detect))
    layout = ParallelLayout(precision="bf16", pack_sequences=True, attention_backend="auto")
    with caplog.at_level("WARNING", logger=builder.__name__):
        choice = builder.attention_choice(tiny_arch(), layout)
    assert choice.backend == "sdpa"
    assert "model.attention_backend=auto: sdpa" in caplog.text and "sm80" in caplog.text


def test_the_builder_refuses_what_cannot_run(monkeypatch):
    from megatron_kto.models import builder

    te_2_9 = Accelerator(cuda=True, transformer_engine="2.9.0")
    monkeypatch.setattr(
        builder.Accelerator, "detect", classmethod(lambda cls, read_device=False: te_2_9)
    )
    layout = ParallelLayout(precision="32", pack_sequences=True, attention_backend="te")
    with pytest.raises(
        ValueError, match=r"^model\.attention_backend: 'te' cannot run fp32 \+ packed"
    ):
        builder.attention_choice(tiny_arch(), layout)
    monkeypatch.setattr(
        builder.Accelerator,
        "detect",
        classmethod(lambda cls, read_device=False: Accelerator(False)),
    )
    with pytest.raises(ValueError, match=r"^model\.attention_backend: 'te' needs Transformer"):
        builder.attention_choice(tiny_arch(), dataclasses.replace(layout, precision="bf16"))


def test_backends_build_the_expected_modules(runtime):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    arch = tiny_arch(num_layers=2)
    for backend, core in (("sdpa", attention_module.SDPAttention), ("local", DotProductAttention)):
        (model,) = build_gpt_chunks(arch, ParallelLayout(attention_backend=backend), runtime.device)
        for layer in model.decoder.layers:
            assert type(layer.self_attention.core_attention) is core
            assert type(layer.input_layernorm) is LocalNorm
        assert type(model.decoder.final_layernorm) is LocalNorm


# ---------------------------------------------------------------------------------------------
# The core-attention module against megatron's DotProductAttention
# ---------------------------------------------------------------------------------------------


def _attention_pair(heads: int, groups: int, dropout: float = 0.0):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    arch = tiny_arch(num_attention_heads=heads, num_query_groups=groups, attention_dropout=dropout)
    config = make_transformer_config(arch, ParallelLayout())
    kwargs = dict(
        config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
    )
    return attention_module.SDPAttention(**kwargs), DotProductAttention(**kwargs), config


def _qkv(seq: int, batch: int, heads: int, groups: int, dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((seq, batch, heads, dim), (seq, batch, groups, dim), (seq, batch, groups, dim))
    # Scale 2 makes the softmax peaked, so a wrong mask or head mapping cannot average out.
    return [(2 * torch.randn(s, generator=g)).requires_grad_() for s in shapes]


def _padding_mask(seq: int, batch: int, lengths: list[int]) -> torch.Tensor:
    """megatron convention (True = masked): causal, plus keys *and queries* past each row's
    length — so the padded query rows are fully masked."""
    causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    pos = torch.arange(seq)
    pad = torch.stack([pos >= n for n in lengths])  # [b, s]
    mask = causal[None] | pad[:, None, :] | pad[:, :, None]
    return mask[:, None]  # [b, 1, sq, sk]


def _run(module, q, k, v, mask, weights):
    out = module(q, k, v, mask)
    (out * weights).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    return out.detach(), grads


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "explicit_mask"])
def test_sdpa_matches_megatron_dot_product_attention(runtime, heads, groups, masked):
    """Output [s, b, heads·d] and d/d(q, k, v) equal megatron's unfused attention to 1e-5, with
    the default causal mask or an explicit padding mask.

    Padded query rows of the explicit mask are fully masked: both give the (finite) uniform
    average of the values there. Their gradient w.r.t. q and k differs (megatron's masked_fill
    cuts it, SDPA's additive mask does not), but such rows carry no loss in a model — real rows
    never attend to padded keys — so the upstream gradient is zero on them here too.
    """
    seq, batch, dim = 12, 3, 16
    lengths = [12, 7, 9]
    sdpa, local, _ = _attention_pair(heads, groups)
    q, k, v = _qkv(seq, batch, heads, groups, dim)
    mask = _padding_mask(seq, batch, lengths) if masked else None
    weights = torch.randn(seq, batch, heads * dim, generator=torch.Generator().manual_seed(1))
    if masked:
        for b, n in enumerate(lengths):
            weights[n:, b] = 0
    got, got_grads = _run(sdpa, q, k, v, mask, weights)
    want, want_grads = _run(local, q, k, v, mask, weights)
    assert got.shape == (seq, batch, heads * dim)
    assert torch.isfinite(got).all() and all(torch.isfinite(g).all() for g in got_grads)
    assert (got - want).abs().max() <= TOLERANCE
    for a, b in zip(got_grads, want_grads):
        assert (a - b).abs().max() <= TOLERANCE


def test_causal_right_padding_needs_no_mask(runtime):
    """Right padding under the causal mask: outputs of real positions do not depend on what the
    padded positions hold (so collate's mask-free right padding is exact)."""
    seq, batch, dim, heads, groups = 10, 2, 8, 4, 2
    sdpa, _, _ = _attention_pair(heads, groups)
    q, k, v = _qkv(seq, batch, heads, groups, dim)
    real = 6
    with torch.no_grad():
        base = sdpa(q, k, v, None)
        q2, k2, v2 = (t.detach().clone() for t in (q, k, v))
        for t in (q2, k2, v2):
            t[real:] = 100 * torch.randn_like(t[real:])
        changed = sdpa(q2, k2, v2, None)
    assert torch.equal(base[:real], changed[:real])
    assert not torch.equal(base[real:], changed[real:])


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "explicit_mask"])
def test_native_gqa_equals_expanded_kv(runtime, monkeypatch, masked):
    """SDPA's own GQA broadcast (used on CPU) and the explicit KV expansion (used on CUDA when
    flash cannot run) give the same result (padded query rows carry no upstream gradient, as
    in the test above)."""
    seq, batch, dim, heads, groups = 12, 2, 8, 4, 2
    sdpa, _, _ = _attention_pair(heads, groups)
    q, k, v = _qkv(seq, batch, heads, groups, dim)
    mask = _padding_mask(seq, batch, [12, 5]) if masked else None
    weights = torch.randn(seq, batch, heads * dim, generator=torch.Generator().manual_seed(2))
    weights[5:, 1] = 0
    outs = []
    for native in (True, False):
        monkeypatch.setattr(attention_module, "native_gqa_is_fast", lambda q, m, n=native: n)
        outs.append(_run(sdpa, q, k, v, mask, weights))
    (a, ga), (b, gb) = outs
    assert (a - b).abs().max() <= 1e-6
    assert all((x - y).abs().max() <= 1e-6 for x, y in zip(ga, gb))


def test_cuda_calls_leave_cudnn_attention_out():
    """On CUDA our SDPA calls choose among flash, memory-efficient and math only: cuDNN's kernel
    gave wrong gradients for them on an H200 (`CUDA_SDPA_BACKENDS`); elsewhere torch chooses."""
    from torch.nn.attention import SDPBackend

    allowed = attention_module.sdpa_backends(torch.device("cuda", 0))
    assert SDPBackend.CUDNN_ATTENTION not in allowed
    assert allowed == [
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ]
    assert attention_module.sdpa_backends(torch.device("cpu")) is None


def test_the_allowed_backends_bind_every_sdpa_call(runtime, monkeypatch):
    """The list `sdpa_backends` returns is what SDPA may use: restricted to a kernel the CPU does
    not have, the module's call fails; restricted to the math kernel, it equals torch's choice."""
    from torch.nn.attention import SDPBackend

    seq, batch, dim, heads, groups = 12, 2, 8, 4, 2
    sdpa, _, _ = _attention_pair(heads, groups)
    q, k, v = _qkv(seq, batch, heads, groups, dim)
    with torch.no_grad():
        free = sdpa(q, k, v, None)
        monkeypatch.setattr(attention_module, "sdpa_backends", lambda d: [SDPBackend.MATH])
        assert (sdpa(q, k, v, None) - free).abs().max() <= 1e-6
        monkeypatch.setattr(
            attention_module, "sdpa_backends", lambda d: [SDPBackend.EFFICIENT_ATTENTION]
        )
        with pytest.raises(RuntimeError, match="backend"):
            sdpa(q, k, v, None)


def test_attention_dropout_is_seeded_and_off_in_eval(runtime):
    """Dropout on the probabilities is drawn from megatron's tensor-parallel RNG stream: the
    same seed repeats the masks exactly, another seed changes them, eval mode disables them."""
    seq, batch, dim, heads, groups = 12, 2, 8, 4, 2
    sdpa, _, _ = _attention_pair(heads, groups, dropout=0.3)
    q, k, v = _qkv(seq, batch, heads, groups, dim)
    sdpa.train()
    with torch.no_grad():
        _reseed(3)
        a = sdpa(q, k, v, None)
        _reseed(3)
        b = sdpa(q, k, v, None)
        _reseed(4)
        c = sdpa(q, k, v, None)
        sdpa.eval()
        d = sdpa(q, k, v, None)
        sdpa.dropout_p = 0.0
        sdpa.train()
        e = sdpa(q, k, v, None)
    assert torch.equal(a, b)
    assert (a - c).abs().max() > 1e-3
    assert torch.equal(d, e) and (a - d).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------
# Whole model: sdpa vs local on the same weights
# ---------------------------------------------------------------------------------------------


def _model_logprobs_and_grads(arch, backend: str, batch: dict, device, layout_kwargs=None):
    """Per-token log-probs, the loss, and every parameter's gradient of one forward/backward
    of a model built at seed 11 (identical weights for every backend and layout)."""
    _reseed(11)
    layout = ParallelLayout(attention_backend=backend, **(layout_kwargs or {}))
    (model,) = build_gpt_chunks(arch, layout, device)
    model.train()
    _reseed(12)  # the same dropout streams for every run
    logits = model(batch["samples"], batch["position_ids"], None)
    logp = token_logprobs(logits, batch["labels"])
    seq_logp, _ = masked_sum(logp, batch["labels"])
    loss = (-seq_logp).mean()
    loss.backward()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return logp.detach(), loss.detach(), grads, weights, model.state_dict().keys()


def test_model_with_sdpa_equals_local_spec(runtime):
    """Same weights (and the same state-dict keys, so checkpoints move between the two): log-probs
    and the gradient of every parameter equal to 1e-5 (fp32, GQA, RoPE, SwiGLU)."""
    arch = tiny_arch()
    batch = make_batch(arch.vocab_size)
    lp_s, loss_s, g_s, w_s, keys_s = _model_logprobs_and_grads(arch, "sdpa", batch, runtime.device)
    lp_l, loss_l, g_l, w_l, keys_l = _model_logprobs_and_grads(arch, "local", batch, runtime.device)
    assert keys_s == keys_l
    assert all(torch.equal(w_s[k], w_l[k]) for k in w_l), "same weights by construction"
    assert lp_s.std() > 0.3, "informative log-probs"
    assert (lp_s - lp_l).abs().max() <= TOLERANCE
    assert abs(loss_s - loss_l) <= TOLERANCE * abs(loss_l)
    worst = {k: (g_s[k] - g_l[k]).abs().max().item() for k in g_l}
    assert max(worst.values()) <= TOLERANCE, worst
    assert min(g.abs().max().item() for g in g_l.values()) > 1e-3, "every gradient is informative"


# ---------------------------------------------------------------------------------------------
# Activation recomputation: identical to no recomputation, dropout included
# ---------------------------------------------------------------------------------------------

RECOMPUTE = {
    "selective": {"activations_checkpoint_granularity": "selective"},
    "full_uniform_2": {
        "activations_checkpoint_granularity": "full",
        "activations_checkpoint_method": "uniform",
        "activations_checkpoint_num_layers": 2,
    },
    "full_block_1": {
        "activations_checkpoint_granularity": "full",
        "activations_checkpoint_method": "block",
        "activations_checkpoint_num_layers": 1,
    },
}


@pytest.mark.parametrize("backend", ["sdpa", "local"])
@pytest.mark.parametrize("recompute", list(RECOMPUTE))
def test_recompute_equals_no_recompute_with_dropout(runtime, backend, recompute):
    """With hidden and attention dropout 0.1 the recomputed forward must redraw exactly the same
    masks (megatron's checkpoint restores the RNG streams): loss and every gradient bitwise equal
    to the run that keeps its activations. A different dropout seed changes the gradients, so
    equality is not vacuous."""
    arch = tiny_arch(hidden_dropout=0.1, attention_dropout=0.1)
    batch = make_batch(arch.vocab_size)
    _, loss_ref, g_ref, _, _ = _model_logprobs_and_grads(arch, backend, batch, runtime.device)
    _, loss, grads, _, _ = _model_logprobs_and_grads(
        arch, backend, batch, runtime.device, RECOMPUTE[recompute]
    )
    assert torch.equal(loss, loss_ref)
    assert all(torch.equal(grads[k], g_ref[k]) for k in g_ref)


def test_dropout_changes_gradients(runtime):
    """Control for the recompute test: the dropout masks do matter to the gradients."""
    arch = tiny_arch(hidden_dropout=0.1, attention_dropout=0.1)
    batch = make_batch(arch.vocab_size)
    _, _, g_a, _, _ = _model_logprobs_and_grads(arch, "sdpa", batch, runtime.device)
    no_dropout = tiny_arch()
    _, _, g_b, _, _ = _model_logprobs_and_grads(no_dropout, "sdpa", batch, runtime.device)
    assert max((g_a[k] - g_b[k]).abs().max().item() for k in g_a) > 1e-3


# ---------------------------------------------------------------------------------------------
# LocalNorm
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_local_norm_equals_torch_norm_and_marks_params(kind, sequence_parallel):
    """Bit-identical to torch.nn.RMSNorm / LayerNorm (what megatron's local spec builds), same
    state-dict keys, and every parameter carries `sequence_parallel` as megatron-core's
    finalize_model_grads reads it."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        normalization=kind,
        sequence_parallel=sequence_parallel,
        tensor_model_parallel_size=2 if sequence_parallel else 1,
    )
    norm = LocalNorm(config, 16, eps=1e-5)
    cls = torch.nn.RMSNorm if kind == "RMSNorm" else torch.nn.LayerNorm
    ref = cls(16, eps=1e-5)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    norm.load_state_dict(ref.state_dict())
    x = torch.randn(5, 3, 16, generator=g)
    assert torch.equal(norm(x), ref(x))
    assert norm.state_dict().keys() == ref.state_dict().keys()
    assert all(p.sequence_parallel is sequence_parallel for p in norm.parameters())
