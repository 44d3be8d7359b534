"""megatron-core's gated DeltaNet layer, runnable without `fla` / `causal_conv1d` and on packed rows.

`megatron.core.ssm.gated_delta_net.GatedDeltaNet` (0.16.1) refuses to construct without `fla`,
allocates its parameters on the current CUDA device and raises on packed micro-batches.
`PortableGatedDeltaNet` keeps its parameters, their names, shapes and tensor-parallel layout,
and its `sharded_state_dict` (so checkpoints are megatron's), and replaces construction and the
forward: the short convolution and the gated delta rule are ours (`models/delta_rule.py`), and a
packed micro-batch's rows (`PackedSeqParams`, with `PackedRows.seqlens` on the host) each start
from a zero recurrence state and an empty convolution window.

Parameter layout (per tensor-parallel rank, heads split over TP as megatron does):
    in_proj.weight   [q | k | v | z | beta | alpha] rows of this rank's heads
    conv1d.weight    [q | k | v] channels, [channels, 1, K]
    A_log, dt_bias   this rank's value heads
    out_norm.weight  [value_head_dim] (RMSNorm before the SiLU output gate z)
    out_proj.weight  row-parallel [hidden, this rank's value dims]
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_kto.models.delta_rule import causal_depthwise_conv as ours_conv
from megatron_kto.models.delta_rule import chunk_gated_delta_rule as ours_rule
from megatron_kto.models.fla_kernels import fla_conv, fla_delta_rule


def packed_row_lengths(packed_seq_params: Any) -> list[int] | None:
    """Host lengths of a packed micro-batch's segments (None when not packed).

    Our `PackedRows` carries them on the host; a plain megatron `PackedSeqParams` costs one
    device-to-host read of `cu_seqlens_q`.
    """
    if packed_seq_params is None:
        return None
    if getattr(packed_seq_params, "cp_size", 1) != 1:
        raise ValueError(
            "gated DeltaNet layers cannot run under context parallelism "
            "(model.context_parallel_size must be 1)"
        )
    seqlens = getattr(packed_seq_params, "seqlens", None)
    if seqlens:
        return list(seqlens)
    bounds = packed_seq_params.cu_seqlens_q.tolist()
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


class PortableGatedDeltaNet(GatedDeltaNet):
    """megatron-core's `GatedDeltaNet` parameters with our portable forward (see module doc)."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: GatedDeltaNetSubmodules,
        layer_number: int | None = None,
        bias: bool = False,
        conv_bias: bool = False,
        conv_init: float | None = None,
        use_qk_l2norm: bool = True,
        A_init_range: tuple[float, float] = (1, 16),
        pg_collection: Any = None,
        kernels: str = "torch",
        **_: Any,
    ):
        # GatedDeltaNet.__init__ raises without fla and allocates on the current CUDA device:
        # set up the same attributes (its sharded_state_dict reads them) without either.
        MegatronModule.__init__(self, config)
        if pg_collection is None:
            raise ValueError("PortableGatedDeltaNet needs the layer's pg_collection")
        if config.activation_func is not F.silu:
            raise ValueError(
                "gated DeltaNet layers need model.activation=swiglu (SiLU convolution)"
            )
        if kernels not in ("torch", "fla"):
            raise ValueError(f"gated DeltaNet kernels: 'torch' or 'fla', got {kernels!r}")
        # 'fla': flash-linear-attention's kernels (`models.fla_kernels`), decided once with the
        # attention backend (`runtime.attention_backend.deltanet_kernels`).
        self.kernels = kernels
        self.layer_number = layer_number
        self.bias, self.conv_bias, self.conv_init = bias, conv_bias, conv_init
        self.A_init_range = A_init_range
        self.use_qk_l2norm = use_qk_l2norm
        self.pg_collection = pg_collection
        self.tp_size = pg_collection.tp.size()
        self.sp_size = self.tp_size if config.sequence_parallel else 1
        self.config = config
        self.hidden_size = config.hidden_size
        self.act_fn = config.activation_func
        self.activation = self.act_fn.__name__
        self.conv_kernel_dim = config.linear_conv_kernel_dim
        self.key_head_dim = config.linear_key_head_dim
        self.value_head_dim = config.linear_value_head_dim
        self.num_key_heads = config.linear_num_key_heads
        self.num_value_heads = config.linear_num_value_heads
        self.qk_dim = self.key_head_dim * self.num_key_heads
        self.v_dim = self.value_head_dim * self.num_value_heads
        self.in_proj_dim = self.qk_dim * 2 + self.v_dim * 2 + self.num_value_heads * 2
        self.in_proj = build_module(
            submodules.in_proj,
            self.hidden_size,
            self.in_proj_dim,
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=bias,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name="fc1",
            tp_group=pg_collection.tp,
        )
        self.conv_dim = self.qk_dim * 2 + self.v_dim
        self.conv_dim_local_tp = self.conv_dim // self.tp_size
        self.conv1d = torch.nn.Conv1d(
            self.conv_dim_local_tp,
            self.conv_dim_local_tp,
            kernel_size=self.conv_kernel_dim,
            groups=self.conv_dim_local_tp,
            padding=self.conv_kernel_dim - 1,
            bias=conv_bias,
            dtype=config.params_dtype,
        )
        self.num_v_heads_local_tp = self.num_value_heads // self.tp_size
        self.dt_bias = torch.nn.Parameter(
            torch.ones(self.num_v_heads_local_tp, dtype=config.params_dtype)
        )
        self.A_log = torch.nn.Parameter(
            torch.empty(self.num_v_heads_local_tp, dtype=config.params_dtype)
            .uniform_(*A_init_range)
            .log()
        )
        for param in (self.conv1d.weight, self.dt_bias, self.A_log, self.conv1d.bias):
            if param is not None:
                param.tensor_model_parallel = True
                param.partition_dim = 0
        self.out_norm = build_module(
            submodules.out_norm,
            config=config,
            hidden_size=self.value_head_dim,
            eps=config.layernorm_epsilon,
        )
        self.out_proj = build_module(
            submodules.out_proj,
            self.v_dim,
            self.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=bias,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=False,
            tp_comm_buffer_name="fc2",
            tp_group=pg_collection.tp,
        )
        if conv_init is not None:
            torch.nn.init.uniform_(self.conv1d.weight, -conv_init, conv_init)
        # One [value_head_dim] weight serves every value head, and TP ranks hold different heads:
        # its gradient is the sum over the TP ranks. megatron-core's gradient finalisation sums
        # only sequence-parallel norms and Q/K norms over TP, so the forward all-reduces this
        # gradient itself (`_gated_norm`) — and the norm is kept out of the sequence-parallel sum.
        self.out_norm.weight.sequence_parallel = False

    def reset_parameters(self) -> None:
        """Parameters are initialised in `__init__` (megatron's version needs CUDA)."""

    def _gated_norm(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm of every value head's output (one shared weight, plain scale) times SiLU(z),
        as Hugging Face computes it (normalised in fp32, scaled in the input dtype)."""
        weight = self.out_norm.weight
        if self.tp_size > 1:  # backward: the weight's gradient summed over the TP ranks
            weight = copy_to_tensor_model_parallel_region(weight, group=self.pg_collection.tp)
        normed = F.rms_norm(core.float(), (self.value_head_dim,), None, self.out_norm.eps)
        return (normed.to(core.dtype) * weight * F.silu(z.float())).to(core.dtype)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        key_value_states: torch.Tensor | None = None,
        inference_context: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
        sequence_len_offset: int | None = None,
        *,
        inference_params: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[s, b, hidden] (s this rank's share under sequence parallelism) -> (output, bias).

        A packed micro-batch ([T, 1, hidden] with `packed_seq_params`) runs its rows separately;
        padded rows ([s, b, hidden], right-padded) need nothing: everything here is causal.
        """
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("gated DeltaNet layers have no inference cache here")
        seqlens = packed_row_lengths(packed_seq_params)
        qkvzba, _ = self.in_proj(hidden_states)  # [s_full, b, in_proj_dim / tp]
        qkvzba = qkvzba.transpose(0, 1)  # [b, s, ...]
        b, s = qkvzba.shape[:2]
        tp = self.tp_size
        qk_local, v_local, heads = self.qk_dim // tp, self.v_dim // tp, self.num_v_heads_local_tp
        qkv, z, beta, alpha = torch.split(
            qkvzba, [2 * qk_local + v_local, v_local, heads, heads], -1
        )
        conv, rule = (fla_conv, fla_delta_rule) if self.kernels == "fla" else (ours_conv, ours_rule)
        qkv = conv(qkv, self.conv1d.weight.squeeze(1), self.conv1d.bias, seqlens=seqlens)
        query, key, value = torch.split(qkv, [qk_local, qk_local, v_local], dim=-1)
        query = query.reshape(b, s, -1, self.key_head_dim)
        key = key.reshape(b, s, -1, self.key_head_dim)
        value = value.reshape(b, s, -1, self.value_head_dim)
        # In fp32 as Hugging Face computes them (A_log in half precision could give -inf).
        g = -self.A_log.float().exp() * F.softplus(alpha.float() + self.dt_bias.float())
        core = rule(
            query, key, value, g, beta.sigmoid(), seqlens=seqlens, qk_l2norm=self.use_qk_l2norm
        )
        gated = self._gated_norm(core, z.reshape(b, s, -1, self.value_head_dim))
        gated = gated.reshape(b, s, -1).transpose(0, 1).contiguous()
        return self.out_proj(gated)
