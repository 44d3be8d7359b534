"""`PortableGatedDeltaNet` (megatron-core's GatedDeltaNet parameters, our forward) against
`transformers`' Qwen3NextGatedDeltaNet with the same weights (fp32, one process, TP1), padded
and packed; the HF <-> megatron projection reorderings round-trip at TP1 and TP2."""

from __future__ import annotations

import pytest
import torch

from megatron_kto.conversion.deltanet import (
    DeltaNetShape,
    conv_from_megatron,
    join_hf_qkvz_ba,
    megatron_conv,
    megatron_in_proj,
    parts_from_megatron_in_proj,
    split_hf_qkvz_ba,
)
from megatron_kto.runtime import init_runtime, teardown

modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
Qwen3NextConfig = pytest.importorskip("transformers").Qwen3NextConfig

SHAPE = DeltaNetShape(key_heads=2, value_heads=4, key_dim=8, value_dim=6)


@pytest.fixture(scope="module")
def runtime():
    rt = init_runtime(1, 1, seed=5)
    yield rt
    teardown()


def _hf_layer() -> torch.nn.Module:
    config = Qwen3NextConfig(
        hidden_size=32,
        linear_num_key_heads=SHAPE.key_heads,
        linear_num_value_heads=SHAPE.value_heads,
        linear_key_head_dim=SHAPE.key_dim,
        linear_value_head_dim=SHAPE.value_dim,
        linear_conv_kernel_dim=4,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(0)
    layer = modeling.Qwen3NextGatedDeltaNet(config, layer_idx=0)
    with torch.no_grad():
        layer.norm.weight.uniform_(0.5, 1.5)
        layer.dt_bias.normal_()
    return layer.float()


def _ours(hf: torch.nn.Module) -> torch.nn.Module:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_kto.models.gated_delta_net import PortableGatedDeltaNet
    from megatron_kto.models.norms import LocalNorm

    config = TransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        layernorm_epsilon=1e-6,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=SHAPE.key_dim,
        linear_value_head_dim=SHAPE.value_dim,
        linear_num_key_heads=SHAPE.key_heads,
        linear_num_value_heads=SHAPE.value_heads,
        use_cpu_initialization=True,
    )
    ours = PortableGatedDeltaNet(
        config,
        GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=LocalNorm, out_proj=RowParallelLinear
        ),
        layer_number=1,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    parts = split_hf_qkvz_ba(hf.in_proj_qkvz.weight, hf.in_proj_ba.weight, SHAPE)
    with torch.no_grad():
        ours.in_proj.weight.copy_(megatron_in_proj(parts, SHAPE, 0, 1))
        ours.conv1d.weight.copy_(megatron_conv(hf.conv1d.weight, SHAPE, 0, 1))
        ours.A_log.copy_(hf.A_log)
        ours.dt_bias.copy_(hf.dt_bias)
        ours.out_norm.weight.copy_(hf.norm.weight)
        ours.out_proj.weight.copy_(hf.out_proj.weight)
    return ours


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_layer_equals_transformers_padded_and_packed(runtime) -> None:
    """Same outputs and input gradients as HF's layer on [b, s] rows; a packed [T, 1] micro-batch
    of rows of different lengths equals each row through HF's layer alone (fails if the conv
    window or the recurrence state crossed a row boundary)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    hf = _hf_layer()
    ours = _ours(hf)
    x = torch.randn(2, 70, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    ref = hf(x)
    out, bias = ours(x.transpose(0, 1), None)
    assert bias is None
    out = out.transpose(0, 1)
    assert _rel(out, ref) < 1e-5
    w = torch.randn(ref.shape)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), x)
    (g_out,) = torch.autograd.grad((out * w).sum(), x)
    assert _rel(g_out, g_ref) < 1e-5

    seqlens = [9, 70, 1, 33]
    rows = torch.randn(1, sum(seqlens), 32, generator=torch.Generator().manual_seed(2))
    bounds = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=bounds,
        cu_seqlens_kv=bounds,
        max_seqlen_q=max(seqlens),
        max_seqlen_kv=max(seqlens),
    )
    packed, _ = ours(rows.transpose(0, 1), None, packed_seq_params=params)
    alone = torch.cat([hf(r) for r in rows.split(seqlens, dim=1)], dim=1)
    assert _rel(packed.transpose(0, 1), alone) < 1e-5
    unpacked = ours(rows.transpose(0, 1), None)[0].transpose(0, 1)
    assert _rel(unpacked[:, 9:], alone[:, 9:]) > 1e-3


@pytest.mark.parametrize("tp", [1, 2])
def test_projection_reorderings_round_trip(tp: int) -> None:
    gen = torch.Generator().manual_seed(0)
    qkvz = torch.randn(SHAPE.key_heads * (2 * 8 + 2 * 2 * 6), 5, generator=gen)
    ba = torch.randn(SHAPE.value_heads * 2, 5, generator=gen)
    conv = torch.randn(2 * 16 + 24, 1, 4, generator=gen)
    parts = split_hf_qkvz_ba(qkvz, ba, SHAPE)
    ranks = [megatron_in_proj(parts, SHAPE, r, tp) for r in range(tp)]
    back = join_hf_qkvz_ba(parts_from_megatron_in_proj(ranks, SHAPE), SHAPE)
    assert torch.equal(back[0], qkvz) and torch.equal(back[1], ba)
    conv_ranks = [megatron_conv(conv, SHAPE, r, tp) for r in range(tp)]
    assert torch.equal(conv_from_megatron(conv_ranks, SHAPE), conv)
    if tp == 2:  # rank 1 holds key head 1 and value heads 2, 3: its q rows are q of head 1
        assert torch.equal(ranks[1][:8], qkvz[40:48])


def test_context_parallel_on_hybrid_models_is_refused() -> None:
    """Context parallelism (no split DeltaNet recurrence) on a hybrid architecture fails in one
    line instead of computing something else. (LoRA on these models: tests/test_hybrid_lora.py.)"""
    from megatron_kto.config.architecture import GPTArchitecture
    from megatron_kto.models.hybrid import hybrid_transformer_config

    arch = GPTArchitecture(
        num_layers=4, linear_attention_freq=[1, 1, 1, 0], attention_output_gate=True
    )
    with pytest.raises(ValueError, match=r"DeltaNet layers \[0, 1, 2\]") as cp:
        hybrid_transformer_config(arch, context_parallel_size=2)
    assert "\n" not in str(cp.value)
    assert hybrid_transformer_config(arch, 1)["linear_attention_freq"] == [1, 1, 1, 0]
