"""RoPE on packed (THD) micro-batches without reading `cu_seqlens` on the host.

megatron-core 0.16.1 rotates the queries and keys of a packed micro-batch in one of two ways
(`rope_utils.apply_rotary_pos_emb`, called by `Attention.forward` with `cu_seqlens`):

* `config.apply_rope_fusion` (Transformer Engine present; decided once, in
  `runtime.gpu_settings.fusion_settings`): TE's fused THD kernel, which reads `cu_seqlens` on the
  device and only shapes on the host;
* otherwise `_apply_rotary_pos_emb_thd`, which splits the rows with `cu_seqlens.tolist()` and
  branches in Python on `freqs.size(0) == cu_seqlens[-1]`: two device-to-host copies per call
  (plus one `.item()` per segment when the table has one row per token), so four per layer
  (queries and keys) and micro-batch on a GPU without TE.

What the unfused path computes: for a segment i of length lᵢ starting at sᵢ it takes the table
rows `freqs[0:lᵢ]` (or `freqs[sᵢ:sᵢ+lᵢ]` when the table has exactly one row per packed token),
concatenates them over the segments and rotates with the [s, b, h, d] formula. That is the table
gathered at each token's position within its segment — token index minus the start of its
segment, found on the device with `torch.searchsorted(cu_seqlens, token index)` — so the same
result needs no host copy. `PackedRoPESelfAttention` (the self-attention of our non-TE layer
specs) does that gather and rotation itself for packed micro-batches on the unfused path, and
leaves everything else, including every fused case, to megatron's `SelfAttention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_get_concentration_factor_from_config,
)
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.transformer_config import TransformerConfig


def segment_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of each packed token within its segment, on the device (no host copy).

    Args:
        cu_seqlens: [segments + 1] non-decreasing segment bounds, 0 first, `total` last.
        total: packed length (a host int: the packed tensor's first dimension).

    Returns:
        [total] positions (`cu_seqlens`' dtype): token index − start of its segment.
    """
    tokens = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    # right=True: a token at a segment's start belongs to that segment, also after empty ones.
    segment = torch.searchsorted(cu_seqlens, tokens, right=True) - 1
    return tokens - cu_seqlens.index_select(0, segment)


def packed_rotary_freqs(freqs: torch.Tensor, cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Rotary angles of every packed token, the rows megatron's unfused THD RoPE picks (CP = 1).

    Args:
        freqs: [max_s, 1, 1, d] table (`RotaryEmbedding`'s output for the micro-batch).
        cu_seqlens: [segments + 1] segment bounds on the device.
        total: packed length; megatron's THD contract makes it `cu_seqlens[-1]`.

    Returns:
        [total, 1, 1, d] angles of each token.
    """
    if freqs.size(0) == total:
        # megatron's "exact mapping" case (a table of one row per packed token): segment i reads
        # freqs[sᵢ : sᵢ + lᵢ], i.e. token t reads row t. The comparison with cu_seqlens[-1] it
        # makes on the device is one of host ints here.
        return freqs
    return freqs.index_select(0, segment_positions(cu_seqlens, total))


@dataclass(frozen=True)
class PackedRoPE:
    """What rotating one packed micro-batch's queries and keys needs: megatron's angle tables
    and the segment bounds megatron would pass with them."""

    q_freqs: torch.Tensor
    k_freqs: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    positions: torch.Tensor | None = None
    """Under context parallelism: [t] position of each of this rank's tokens in its segment
    (`PackedRows.positions`); the angles are then read there."""

    def rotate(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        config: TransformerConfig,
        cp_group: torch.distributed.ProcessGroup | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated (query, key), each [t, 1, n, d] (megatron's unfused THD path rotates the same
        [t, 1, n, d] view, `t.unsqueeze(1)`, with the same [s, b, n, d] formula).

        Args:
            query: [t, 1, heads, d]; key: [t, 1, groups, d] (t packed tokens).
            config: the model's config (`apply_rope_fusion` off).
            cp_group: the context-parallel group (one rank).
        """
        total = query.shape[0]
        if self.positions is not None:
            # This rank's tokens are chunks of whole segments (`models.context_parallel`); the
            # table has a row for every position of the longest segment.
            q_freqs = self.q_freqs.index_select(0, self.positions)
            k_freqs = (
                q_freqs
                if self.k_freqs is self.q_freqs
                else (self.k_freqs.index_select(0, self.positions))
            )
            mscale = _yarn_get_concentration_factor_from_config(config)
            return tuple(
                apply_rotary_pos_emb(t, f, config, mscale=mscale, cp_group=cp_group)
                for t, f in ((query, q_freqs), (key, k_freqs))
            )
        q_freqs = packed_rotary_freqs(self.q_freqs, self.cu_seqlens_q, total)
        k_freqs = (
            q_freqs
            if self.k_freqs is self.q_freqs and self.cu_seqlens_kv is self.cu_seqlens_q
            else packed_rotary_freqs(self.k_freqs, self.cu_seqlens_kv, key.shape[0])
        )
        # With apply_rope_fusion off and no cu_seqlens, megatron's dispatcher takes its unfused
        # [s, b, n, d] rotation (interleaving, rotary_percent < 1 and mscale included).
        mscale = _yarn_get_concentration_factor_from_config(config)
        return tuple(
            apply_rotary_pos_emb(t, f, config, mscale=mscale, cp_group=cp_group)
            for t, f in ((query, q_freqs), (key, k_freqs))
        )


def own_packed_rope(
    config: TransformerConfig,
    rotary_pos_emb: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None,
    packed_seq_params: PackedSeqParams | None,
    cp_size: int,
) -> PackedRoPE | None:
    """The packed RoPE this module applies in megatron's place, or None (megatron's own path).

    Ours only where megatron would take its unfused THD path: RoPE on a `thd` micro-batch
    without `apply_rope_fusion`. With fusion TE's kernel reads nothing on the host. Under context
    parallelism only micro-batches split by `models.context_parallel` (`PackedRows.positions`
    set) are ours: the angles are read at each token's position in its segment.
    """
    if (
        rotary_pos_emb is None
        or packed_seq_params is None
        or packed_seq_params.qkv_format != "thd"
        or config.apply_rope_fusion
    ):
        return None
    positions = getattr(packed_seq_params, "positions", None)
    if cp_size != 1 and positions is None:
        return None
    q_freqs, k_freqs = (
        rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
    )
    if q_freqs is None or k_freqs is None:
        return None
    # megatron's choice of bounds (Attention.forward): the `_padded` variants when given.
    p = packed_seq_params
    cu_q = p.cu_seqlens_q_padded if p.cu_seqlens_q_padded is not None else p.cu_seqlens_q
    cu_kv = p.cu_seqlens_kv_padded if p.cu_seqlens_kv_padded is not None else p.cu_seqlens_kv
    return PackedRoPE(q_freqs, k_freqs, cu_q, cu_kv, positions if cp_size != 1 else None)


class PackedRoPESelfAttention(SelfAttention):
    """megatron-core's `SelfAttention`; on packed micro-batches without fused RoPE it rotates
    queries and keys from per-token angles (no host copy) instead of from `cu_seqlens`."""

    _packed_rope: PackedRoPE | None = None

    def forward(
        self,
        hidden_states,
        attention_mask,
        key_value_states=None,
        inference_context=None,
        rotary_pos_emb=None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        rotary_pos_cos_sin=None,
        attention_bias=None,
        packed_seq_params=None,
        sequence_len_offset=None,
        *,
        inference_params=None,
    ):
        """`SelfAttention.forward` (same arguments and result)."""
        # Layers megatron runs without RoPE (`no_rope_freq`) stay megatron's (it drops the angles).
        no_rope = bool(self.config.no_rope_freq) and self.config.no_rope_freq[self.layer_number - 1]
        rope = None
        if inference_context is None and inference_params is None and not no_rope:
            rope = own_packed_rope(
                self.config, rotary_pos_emb, packed_seq_params, self.pg_collection.cp.size()
            )
        if rope is not None:
            # megatron sees no RoPE to apply; `get_query_key_value_tensors` (called once per
            # forward, also when full activation recompute replays the layer) applies ours.
            rotary_pos_emb, self._packed_rope = None, rope
        try:
            return super().forward(
                hidden_states,
                attention_mask,
                key_value_states=key_value_states,
                inference_context=inference_context,
                rotary_pos_emb=rotary_pos_emb,
                rotary_pos_cos=rotary_pos_cos,
                rotary_pos_sin=rotary_pos_sin,
                rotary_pos_cos_sin=rotary_pos_cos_sin,
                attention_bias=attention_bias,
                packed_seq_params=packed_seq_params,
                sequence_len_offset=sequence_len_offset,
                inference_params=inference_params,
            )
        finally:
            self._packed_rope = None

    def get_query_key_value_tensors(self, *args, **kwargs):
        """`SelfAttention.get_query_key_value_tensors`, queries and keys rotated when this module
        owns the packed RoPE — after the optional q/k norms, where megatron rotates too. The
        queries hold all t packed tokens here, also under sequence parallelism (the QKV
        projection gathers them)."""
        out = super().get_query_key_value_tensors(*args, **kwargs)
        if self._packed_rope is None:
            return out
        query, key = self._packed_rope.rotate(out[0], out[1], self.config, self.pg_collection.cp)
        return (query, key, *out[2:])
