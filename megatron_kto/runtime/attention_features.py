"""What of a model's attention the backend decision reads, as one value.

`runtime.attention_backend.choose_attention_backend` decides from the run's layout (precision,
packing, context parallelism), the machine and this record. Every caller (the start-up check,
the model builder, the evaluation tool) builds it with `AttentionFeatures.of` from the model's
`GPTArchitecture`, so a new attention kind is one field here and one line in `of`, not a new
argument at every call site.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_kto.config.architecture import GPTArchitecture

__all__ = ["AttentionFeatures", "head_dim_of"]


def head_dim_of(model: Any) -> int:
    """Per-head dimension of anything with the GPTArchitecture fields."""
    return model.kv_channels or model.hidden_size // model.num_attention_heads


@dataclass(frozen=True)
class AttentionFeatures:
    """The model's attention, as far as the choice of backend and kernels goes."""

    head_dim: int
    """Per-head (query/key) dimension (`head_dim_of`)."""
    sliding_window: bool = False
    """Some layers attend within a sliding window (`model.sliding_window`)."""
    attention_sinks: bool = False
    """A learned sink logit per head (`model.attention_sinks`, GPT-OSS): `sdpa`, or TE where its
    learnable softmax runs; never under context parallelism."""
    attention_dropout: float = 0.0
    """`model.attention_dropout`; with a sliding window, TE's fused attention needs it 0
    (flash-attn takes either)."""
    latent_attention: bool = False
    """Multi-latent attention (DeepSeek-V3, `models.mla`): `sdpa`, or TE where it runs a value
    head dim of its own (`te_latent_attention`)."""
    value_head_dim: int | None = None
    """Per-head value dimension where it differs from `head_dim` (MLA's `v_head_dim`)."""
    linear_attention: bool = False
    """Gated DeltaNet layers (Qwen3-Next, Qwen3.5): the choice also names their kernels
    (`attention_backend.deltanet_kernels`)."""

    @property
    def window_dropout(self) -> bool:
        """A sliding window with attention dropout, which only flash-attn fuses in TE."""
        return self.sliding_window and self.attention_dropout > 0

    @classmethod
    def of(cls, arch: GPTArchitecture) -> AttentionFeatures:
        """The features of a model (`config.schema.architecture_of` gives a config's)."""
        return cls(
            head_dim=head_dim_of(arch),
            sliding_window=bool(arch.sliding_window),
            attention_sinks=bool(arch.attention_sinks),
            attention_dropout=float(arch.attention_dropout or 0.0),
            latent_attention=bool(arch.multi_latent_attention),
            value_head_dim=arch.v_head_dim if arch.multi_latent_attention else None,
            linear_attention=arch.has_linear_attention(),
        )
