"""What Gemma 3's layers add to megatron-core's local layer: post-norms and a RoPE base per
layer kind.

* Post-norms (`GPTArchitecture.post_norms`): an RMSNorm on the attention output and on the MLP
  output, before each residual add (`transformers`' `post_attention_layernorm` /
  `post_feedforward_layernorm`; the pre-norms are megatron's own `input_layernorm` /
  `pre_mlp_layernorm`). megatron-core 0.16.1's `TransformerLayer` has no slot for them, so they
  live in the attention and MLP modules (`self_attention.post_norm`, `mlp.post_norm`) and apply
  to those modules' outputs — the same place, since the layer's bias-dropout-add follows. Our
  linear layers have no biases here (checked), so normalising the output alone is exact.
* A RoPE base per layer kind (`GPTArchitecture.rotary_base_local`): `GPTModel` computes one
  table of angles, position × inv_freq(global base) (positions divided by the linear scaling
  factor, `rotary_interpolation_factor`), and hands it to every layer. A sliding-window layer
  multiplies it per dimension by inv_freq(local) / inv_freq(global) × factor, which gives
  position × inv_freq(local) — per dimension, so it holds whatever rows the table has (packed
  micro-batches, context-parallel chunks). The product is formed in float64 from the fp32 table:
  within one fp32 rounding of the angle computed directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    is_layer_window_attention,
    make_sharded_tensors_for_checkpoint,
)

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.models.norms import LocalNorm
from megatron_kto.models.packed_rope import PackedRoPESelfAttention


@dataclass(frozen=True)
class LayerExtras:
    """What a model's local layer spec adds to megatron's layer (from its `GPTArchitecture`)."""

    post_norms: bool = False
    local_rotary: tuple[float, float, float | None, float] | None = None
    """(local base, global base, linear scaling factor, rotary percent) when sliding-window
    layers use their own RoPE base."""

    @classmethod
    def of(cls, arch: GPTArchitecture) -> LayerExtras:
        local = None
        if arch.rotary_base_local is not None and arch.sliding_window:
            local = (
                float(arch.rotary_base_local),
                float(arch.rotary_base),
                arch.rotary_interpolation_factor,
                arch.rotary_percent,
            )
        return cls(post_norms=arch.post_norms, local_rotary=local)

    def __bool__(self) -> bool:
        return self.post_norms or self.local_rotary is not None


class PostNorm(LocalNorm):
    """A `LocalNorm` that states its own checkpoint entries: megatron's `MLP` asks every child
    for `sharded_state_dict`, which plain modules lack. The entries are those megatron gives any
    plain module (`sharded_state_dict_default`: replicated tensors)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            {},
            sharded_offsets,
            tp_group=parallel_state.get_tensor_model_parallel_group(),
            dp_cp_group=ensure_metadata_has_dp_cp_group(metadata)["dp_cp_group"],
        )


def _post_norm(config: TransformerConfig) -> PostNorm:
    if config.add_bias_linear:
        raise ValueError("post-norms (model.post_norms) need linear layers without biases")
    return PostNorm(config, config.hidden_size, eps=config.layernorm_epsilon)


def local_rope_ratio(
    config: TransformerConfig,
    local_base: float,
    global_base: float,
    factor: float | None,
    rotary_percent: float,
) -> torch.Tensor:
    """Per-dimension factor [rotary dim] turning the global RoPE table into the local one
    (megatron's non-interleaved layout: the half-dim frequencies twice)."""
    dim = int(config.kv_channels * rotary_percent)
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim

    def inv_freq(base: float) -> torch.Tensor:  # as megatron's RotaryEmbedding computes it
        return 1.0 / (base**exponents)

    ratio = inv_freq(local_base).double() / inv_freq(global_base).double() * (factor or 1.0)
    if config.rotary_interleaved:
        return ratio.repeat_interleave(2)
    return torch.cat([ratio, ratio])


class GemmaSelfAttention(PackedRoPESelfAttention):
    """`PackedRoPESelfAttention` with an optional post-norm on its output and, in sliding-window
    layers, the local RoPE base."""

    def __init__(
        self,
        *args,
        post_norm: bool = False,
        local_rotary: tuple[float, float, float | None, float] | None = None,
        **kwargs,
    ):
        """
        Args:
            post_norm: normalise the output (`self.post_norm`).
            local_rotary: (local base, global base, linear scaling factor of the global table,
                rotary percent) when sliding-window layers use their own base; None otherwise.
        """
        super().__init__(*args, **kwargs)
        self.post_norm = _post_norm(self.config) if post_norm else None
        windowed = is_layer_window_attention(
            self.config.window_size, self.config.window_attn_skip_freq, self.layer_number
        )
        self.rope_ratio: torch.Tensor | None = None
        if local_rotary is not None and windowed:
            self.rope_ratio = local_rope_ratio(self.config, *local_rotary)

    def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
        """`SelfAttention.forward`; (output, bias) with the output post-normed."""
        if self.rope_ratio is not None and rotary_pos_emb is not None:
            rotary_pos_emb = (
                tuple(self._local(t) for t in rotary_pos_emb)
                if isinstance(rotary_pos_emb, tuple)
                else self._local(rotary_pos_emb)
            )
        output, bias = super().forward(
            hidden_states, attention_mask, *args, rotary_pos_emb=rotary_pos_emb, **kwargs
        )
        if self.post_norm is not None:
            output = self.post_norm(output)
        return output, bias

    def _local(self, freqs: torch.Tensor) -> torch.Tensor:
        ratio = self.rope_ratio.to(freqs.device)
        return (freqs.double() * ratio).to(freqs.dtype)


class PostNormMLP(MLP):
    """megatron-core's `MLP` with an RMSNorm on its output (`self.post_norm`)."""

    def __init__(self, config: TransformerConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.post_norm = _post_norm(config)

    def forward(self, hidden_states, *args, **kwargs):
        """`MLP.forward`; (output, bias) with the output post-normed."""
        output, bias = super().forward(hidden_states, *args, **kwargs)
        return self.post_norm(output), bias


__all__ = ["GemmaSelfAttention", "LayerExtras", "PostNormMLP", "local_rope_ratio"]
