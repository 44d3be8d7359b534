"""The `fla` (flash-linear-attention) path of the gated DeltaNet layers, on CPU.

fla's kernels are Triton (accelerators only), so CPU tests cannot run them. What is shown here:

* our calls bind to fla 0.5.2's stated signatures — stand-ins with exactly those parameters
  (read from the 0.5.2 source: `fla/ops/gated_delta_rule/chunk.py::chunk_gated_delta_rule`,
  `fla/modules/conv/causal_conv1d.py::causal_conv1d`) replace the package, so a misspelt or
  missing keyword fails; where the real `fla` is installed its signatures must be these;
* packed rows reach fla as `cu_seqlens` (int64 row boundaries on the device, and the host copy):
  the stand-ins run our reference on each [cu[i], cu[i+1]) segment from a zero state, and the
  results equal our packed operators (a boundary off by one would fail, as would a missing
  `cu_seqlens`, which runs the rows as one sequence);
* the one backend decision picks fla on an accelerator where it is installed and ours elsewhere,
  says so in the start-up note, and the layer spec carries the choice.
"""

from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch

from megatron_kto.models import delta_rule, fla_kernels

SEQLENS = [5, 17, 1, 9]
CALLS: list[dict] = []


def chunk_gated_delta_rule(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
    state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, cp_context=None, **kwargs,
):  # fmt: skip
    """fla 0.5.2's signature; our reference per `cu_seqlens` segment from a zero state."""
    assert not kwargs and initial_state is None and not use_beta_sigmoid_in_kernel
    assert scale == q.shape[-1] ** -0.5
    CALLS.append({"op": "rule", "cu": cu_seqlens, "cu_cpu": cu_seqlens_cpu})
    bounds = [0, q.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
    outs = [
        delta_rule.chunk_gated_delta_rule(
            *(t[:, a:b] for t in (q, k, v, g, beta)), qk_l2norm=use_qk_l2norm_in_kernel
        )
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(outs, dim=1), None


def causal_conv1d(
    x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
    activation=None, backend="triton", cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
    cp_context=None, **kwargs,
):  # fmt: skip
    """fla 0.5.2's signature; our reference per `cu_seqlens` segment."""
    assert not kwargs and residual is None and activation in ("silu", "swish")
    CALLS.append({"op": "conv", "cu": cu_seqlens, "cu_cpu": cu_seqlens_cpu})
    bounds = [0, x.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
    outs = [
        delta_rule.causal_depthwise_conv(x[:, a:b], weight, bias)
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(outs, dim=1), None


@pytest.fixture
def stand_in_fla(monkeypatch):
    """`fla` replaced by the stand-ins (the real package, if any, must have their signatures)."""
    try:
        from fla.modules.conv import causal_conv1d as real_conv
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as real_rule
    except ImportError:
        pass
    else:
        for real, ours in ((real_rule, chunk_gated_delta_rule), (real_conv, causal_conv1d)):
            assert list(inspect.signature(real).parameters) == list(
                inspect.signature(ours).parameters
            )
    modules = {}
    for name in ("fla", "fla.ops", "fla.ops.gated_delta_rule", "fla.modules", "fla.modules.conv"):
        modules[name] = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, modules[name])
    modules["fla.ops.gated_delta_rule"].chunk_gated_delta_rule = chunk_gated_delta_rule
    modules["fla.modules.conv"].causal_conv1d = causal_conv1d
    CALLS.clear()
    yield CALLS


def _inputs(batch: int, t: int):
    gen = torch.Generator().manual_seed(0)
    hk, hv, dk, dv = 2, 4, 8, 12
    q = torch.randn(batch, t, hk, dk, generator=gen)
    k = torch.randn(batch, t, hk, dk, generator=gen)
    v = torch.randn(batch, t, hv, dv, generator=gen)
    g = -torch.rand(batch, t, hv, generator=gen)
    beta = torch.rand(batch, t, hv, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_fla_calls_equal_ours_with_row_boundaries(stand_in_fla, packed):
    seqlens = SEQLENS if packed else None
    q, k, v, g, beta = _inputs(1 if packed else 3, sum(SEQLENS))
    ours = delta_rule.chunk_gated_delta_rule(q, k, v, g, beta, seqlens=seqlens)
    theirs = fla_kernels.fla_delta_rule(q, k, v, g, beta, seqlens=seqlens)
    assert torch.allclose(theirs, ours, rtol=1e-5, atol=1e-6)
    x = torch.randn(q.shape[0], q.shape[1], 6, generator=torch.Generator().manual_seed(1))
    weight, bias = torch.randn(6, 4), torch.randn(6)
    conv_ours = delta_rule.causal_depthwise_conv(x, weight, bias, seqlens=seqlens)
    assert torch.allclose(fla_kernels.fla_conv(x, weight, bias, seqlens=seqlens), conv_ours)
    assert [c["op"] for c in stand_in_fla] == ["rule", "conv"]
    for call in stand_in_fla:
        if not packed:
            assert call["cu"] is None and call["cu_cpu"] is None
            continue
        assert call["cu"].dtype == torch.long and call["cu"].tolist() == [0, 5, 22, 23, 32]
        assert call["cu_cpu"].device.type == "cpu" and call["cu_cpu"].tolist() == [0, 5, 22, 23, 32]
    if packed:  # the rows run as one sequence (no cu_seqlens) leak their state: not equal
        joined = delta_rule.chunk_gated_delta_rule(q, k, v, g, beta)
        assert not torch.allclose(joined, ours, rtol=1e-3, atol=1e-4)


def test_backend_decision_picks_fla_only_on_an_accelerator_with_fla():
    from megatron_kto.models.gated_delta_net import PortableGatedDeltaNet
    from megatron_kto.models.hybrid import hybrid_layer_spec
    from megatron_kto.runtime.attention_backend import AttentionFeatures, choose_attention_backend
    from megatron_kto.runtime.gpu_settings import Accelerator

    def choose(accelerator, linear=True):
        features = AttentionFeatures(head_dim=128, linear_attention=linear)
        return choose_attention_backend(
            "auto", precision="bf16", packed=True, accelerator=accelerator, features=features
        )

    gpu = choose(Accelerator(cuda=True, fla=True))
    assert gpu.deltanet == "fla" and "cu_seqlens" in gpu.note("auto")
    assert "gated DeltaNet: fla" in gpu.note("auto") and "\n" not in gpu.note("auto")
    assert choose(Accelerator(cuda=True, fla=False)).deltanet == "torch"
    cpu = choose(Accelerator(cuda=False, fla=True))
    assert cpu.deltanet == "torch" and "no accelerator" in cpu.note("auto")
    assert choose(Accelerator(cuda=True, fla=True), linear=False).deltanet is None
    assert "DeltaNet" not in choose(Accelerator(cuda=True, fla=True), linear=False).note("auto")

    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, normalization="RMSNorm"
    )
    spec = hybrid_layer_spec(config, "sdpa", linear=True, moe=False, deltanet="fla")
    attention = spec.submodules.self_attention
    assert attention.module is PortableGatedDeltaNet and attention.params == {"kernels": "fla"}
