"""Core attention on `torch.nn.functional.scaled_dot_product_attention` (SDPA).

megatron-core's local spec computes attention with `DotProductAttention`, which materialises
the [b, heads, s, s] score and probability tensors (plus a causal mask) in memory. Without
Transformer Engine that is the only attention it has. `SDPAttention` is a drop-in replacement
for the `core_attention` submodule of megatron's `SelfAttention`: same constructor keywords
(`CoreAttentionBuilder`), same call signature (`CoreAttention`), same shapes, and it lets torch
pick a fused kernel (flash / memory-efficient on CUDA, the fused flash kernel on CPU) — never
cuDNN's (`CUDA_SDPA_BACKENDS`: it returned wrong gradients for these calls on an H200).

What it keeps from megatron's contract:

* inputs are this TP rank's heads: query [sq, b, heads/TP, d], key/value [sk, b, groups/TP, d]
  (GQA: each group serves heads/groups consecutive query heads, as in megatron's
  `repeat_interleave`); output [sq, b, heads/TP · d]; the value head dim may differ from the
  query/key one (multi-latent attention, `models.mla`: megatron's `k_channels` / `v_channels`),
  the output then [sq, b, heads/TP · d_v];
* causal masking from `attn_mask_type` when no mask is given; a given `attention_mask` is
  megatron's boolean "True = masked out" tensor broadcastable to [b, heads, sq, sk] and is used
  as is (megatron's masks already contain the causal part, e.g. `get_ltor_masks_and_position_ids`);
* attention dropout drawn from megatron's tensor-parallel RNG stream (forked here, or already
  active under sequence parallelism), so each TP rank draws independent masks for its own heads
  and activation recomputation replays them exactly;
* packed micro-batches (`packed_seq_params` with ``qkv_format='thd'``, see `models.packing`):
  megatron's attention hands over [t, heads, d] tensors of concatenated rows (RoPE already
  applied per row, `models.packed_rope`); each row attends causally within itself, one SDPA call per
  row. Per-row calls, not one call with a block-diagonal [t, t] mask: the mask would make SDPA
  compute (and, on CPU, allocate) all t² scores — more work than the padding it replaces, and
  ~64 MiB of fp32 mask per layer at t = 4k — whereas per-row calls cost Σ lᵢ², and the fused
  kernel (is_causal, no mask) stays usable. Row lengths come from the host
  (`PackedRows.seqlens`), so no device-to-host copy is needed; plain `PackedSeqParams` fall
  back to reading `cu_seqlens`;
* context parallelism (`config.context_parallel_size` > 1): this rank holds two chunks of every
  row (`models.context_parallel`); `models.cp_attention` all-gathers keys and values over the
  CP group and masks causally by each token's position in its row;
* sliding windows (megatron-core's `window_size` = (W − 1, 0) and `window_attn_skip_freq`, read
  per layer as TE reads them): a query sees itself and the W − 1 keys before it, as
  `transformers`' sliding-window masks. A row (padded batch, packed row, CP chunk) no longer
  than W needs nothing beyond causality and keeps the fused causal call; a longer one is
  attended in query blocks of W over their windows' keys with one shared band mask
  (`_windowed`: O(s·W) work and memory, not s²; a CP chunk: one band-masked call over the keys
  its window reaches).
* attention sinks (megatron-core's `softmax_type='learnable'`, GPT-OSS): a learned logit sᵢ per
  query head joins every softmax denominator, p_j = exp(z_j) / (exp(sᵢ) + Σ_k exp(z_k)), and its
  value is zero. It is one extra key column, exactly: every call gets a sink position in front —
  a key with a zero value whose score is sᵢ (an extra channel: queries carry sᵢ / scale, real keys
  0, the sink key 1) and a dropped query in front of the queries, so query t sees the sink and
  keys 0..t, which is SDPA's own causal mask on the lengthened call (the fused causal kernel
  stays usable; explicit masks get the sink column unmasked). The parameter is megatron's
  `core_attention.softmax_offset` [heads/TP], sharded by heads like megatron's own.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import (
    is_layer_window_attention,
    make_sharded_tensors_for_checkpoint,
)
from megatron.core.utils import divide
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron_kto.models.attention_masks import additive_mask, window_band, window_mask
from megatron_kto.models.cp_attention import context_parallel_attention


class SDPAttention(MegatronModule):
    """Scaled dot-product core attention for megatron-core's `SelfAttention` (no parameters)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        """
        Args:
            config: the model's transformer config (attention sizes, dropout, TP size).
            layer_number: 1-based layer index (megatron's convention; kept for the interface).
            attn_mask_type: default mask type (`causal` for GPT self-attention).
            attention_type: 'self' or 'cross' (only the shapes matter here).
            attention_dropout: overrides `config.attention_dropout` when given.
            softmax_scale: overrides 1/sqrt(head dim) when given.
            k_channels, v_channels: query/key and value head dims when they differ
                (multi-latent attention, `models.mla`); None: `config.kv_channels` both.
            cp_comm_type: context-parallel communication; ours is always the all-gather of keys
                and values (`models.cp_attention`), whatever is asked.
            pg_collection: process groups; megatron's global TP group when None.
        """
        super().__init__(config=config)
        unsupported = {
            "softmax_type 'off-by-one'": config.softmax_type == "off-by-one",
            "window_size other than (left, 0) (a non-causal window)": config.window_size is not None
            and (config.window_size[1] != 0 or config.window_size[0] < 0),
        }
        bad = [name for name, on in unsupported.items() if on]
        if bad:
            raise ValueError(
                f"model.attention_backend=sdpa does not support {', '.join(bad)}; "
                "use model.attention_backend=te"
            )
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.tp_group = pg_collection.tp
        tp_size = pg_collection.tp.size()
        self.cp_group = pg_collection.cp if config.context_parallel_size > 1 else None
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.groups_per_partition = divide(config.num_query_groups, tp_size)
        self.head_dim = k_channels or config.kv_channels
        # megatron's apply_query_key_layer_scaling divides the scale by the layer number and
        # multiplies the fp32 softmax input back by it: mathematically the plain 1/sqrt(d).
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        )
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        # `layer_number` is the global 1-based layer (pipeline offset included), as TE reads it.
        windowed = is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, self.layer_number
        )
        self.window: int | None = config.window_size[0] + 1 if windowed else None
        """Keys a query sees (itself included) in this layer; None: full causal attention."""
        self.softmax_offset: torch.nn.Parameter | None = None
        if config.softmax_type == "learnable":
            if self.cp_group is not None:
                raise ValueError(
                    "model.context_parallel_size > 1 does not support attention sinks "
                    "(GPT-OSS) with model.attention_backend=sdpa"
                )
            self.softmax_offset = torch.nn.Parameter(
                torch.empty(self.heads_per_partition, dtype=config.params_dtype)
            )
            if config.perform_initialization:
                config.init_method(self.softmax_offset.data)
            # Sharded by heads: every TP rank's slice counts in the gradient norm.
            set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """Attention of this rank's heads.

        Args:
            query: [sq, b, heads/TP, d].
            key, value: [sk, b, groups/TP, d].
            attention_mask: None, or bool broadcastable to [b, heads/TP, sq, sk], True = masked.
            attn_mask_type: overrides the constructor's mask type (used when no mask is given).
            attention_bias: unsupported (must be None).
            packed_seq_params: THD parameters of a packed micro-batch (query [t, heads/TP, d],
                key/value [t, groups/TP, d]); causal attention within each row.

        Returns:
            [sq, b, heads/TP · d] context, in the query's dtype ([t, heads/TP · d] when packed).
        """
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by SDPAttention")
        if self.cp_group is not None:
            return context_parallel_attention(
                query, key, value, attention_mask, packed_seq_params, self.cp_group, self
            )
        if packed_seq_params is not None:
            return self._packed(query, key, value, attention_mask, packed_seq_params)
        sq, batch = query.shape[0], query.shape[1]
        sk = key.shape[0]
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        attn_mask = None
        is_causal = False
        banded = self.window is not None and sk > self.window
        if banded and attention_mask is None:
            if mask_type != AttnMaskType.causal or sq != sk:
                raise ValueError("a sliding window needs causal self-attention with sq == sk")
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            k, v, native_gqa = self._grouped_kv(q, k, v, True)
            context = self._in_dropout_stream(lambda p: self._windowed(q, k, v, p, native_gqa))
            return context.permute(2, 0, 1, 3).reshape(sq, batch, -1)
        if banded:  # an explicit mask: the band on top of it, in one call
            attention_mask = attention_mask | window_mask(sq, sk, self.window, query.device)
        if attention_mask is not None:
            attn_mask = additive_mask(attention_mask, query.dtype)
        elif mask_type == AttnMaskType.causal and sq > 1:
            # Right padding needs no mask: real tokens precede padding, so causal attention
            # never lets a real token see one (and padded positions carry no loss).
            if sq != sk:
                raise ValueError(f"causal self-attention needs sq == sk, got {sq} and {sk}")
            is_causal = True
        # [s, b, n, d] -> [b, n, s, d]: a view; SDPA takes strided inputs (last dim contiguous).
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        k, v, native_gqa = self._grouped_kv(q, k, v, attn_mask)
        context = self._in_dropout_stream(
            lambda p: self._sdpa(q, k, v, attn_mask, p, is_causal, native_gqa)
        )
        # [b, n, sq, d] -> [sq, b, n·d]
        return context.permute(2, 0, 1, 3).reshape(sq, batch, -1)

    def _packed(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        params: PackedSeqParams,
    ) -> torch.Tensor:
        """Causal attention within each row of a packed (THD) micro-batch: [t, heads/TP · d]."""
        if params.qkv_format != "thd":
            raise NotImplementedError(
                f"SDPAttention takes packed sequences in the 'thd' format, got {params.qkv_format!r}"
            )
        if attention_mask is not None:
            raise NotImplementedError("SDPAttention: packed sequences take no attention_mask")
        seqlens = getattr(params, "seqlens", None)
        if not seqlens:
            # Plain PackedSeqParams: the lengths are only on the device (one host copy).
            seqlens = (params.cu_seqlens_q[1:] - params.cu_seqlens_q[:-1]).tolist()
        if sum(seqlens) != query.shape[0]:
            raise ValueError(f"packed rows of {sum(seqlens)} tokens, but {query.shape[0]} given")
        # [t, n, d] -> [1, n, t, d] (a view), split into rows along t.
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        banded = self.window is not None and max(seqlens) > self.window
        # (A windowed row longer than the window is a masked call: choose the KV layout for it.)
        k, v, native_gqa = self._grouped_kv(q, k, v, True if banded else None)

        def row(qi, ki, vi, dropout_p: float) -> torch.Tensor:
            n = qi.shape[2]
            if self.window is None or n <= self.window:
                return self._sdpa(qi, ki, vi, None, dropout_p, n > 1, native_gqa)
            return self._windowed(qi, ki, vi, dropout_p, native_gqa)

        def rows(dropout_p: float) -> list[torch.Tensor]:
            return [
                row(qi, ki, vi, dropout_p)
                for qi, ki, vi in zip(*(t.split(list(seqlens), dim=2) for t in (q, k, v)))
                if qi.shape[2] > 0
            ]

        # [1, n, l_i, d] per row -> [1, n, t, d] -> [t, n·d]
        context = torch.cat(self._in_dropout_stream(rows), dim=2)[0]
        return context.transpose(0, 1).reshape(query.shape[0], -1)

    def _windowed(self, q, k, v, dropout_p: float, native_gqa: bool) -> torch.Tensor:
        """Causal attention within `self.window` (W) of rows [b, n, s, d] longer than W, in query
        blocks of W: a block's queries see the keys from its first position − W + 1 on, the band
        masked; the first block is plainly causal. Work is O(s·W), not s², and every block of
        every layer takes (a corner of) one cached [W, 2W − 1] mask (`window_band`)."""
        s, w = q.shape[2], self.window
        band = window_band(w, q.dtype, q.device)
        out = []
        for start in range(0, s, w):
            stop, first = min(start + w, s), max(0, start - w + 1)
            qb, kb, vb = q[:, :, start:stop], k[:, :, first:stop], v[:, :, first:stop]
            c, sk = stop - start, stop - first
            if sk == c:  # the first block: its window reaches back to the row's start
                out.append(self._sdpa(qb, kb, vb, None, dropout_p, c > 1, native_gqa))
            else:  # sk = c + w − 1: the block's queries are the last c of its keys
                out.append(self._sdpa(qb, kb, vb, band[:c, :sk], dropout_p, False, native_gqa))
        return torch.cat(out, dim=2)

    def _grouped_kv(self, q, k, v, attn_mask) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Key and value for SDPA ([b, groups or heads, s, d]) and whether SDPA broadcasts the
        groups itself (`native_gqa_is_fast`)."""
        groups = self.heads_per_partition // self.groups_per_partition
        native_gqa = groups > 1 and native_gqa_is_fast(q, attn_mask)
        if groups > 1 and not native_gqa:
            # Each KV group serves `groups` consecutive query heads (megatron's layout; SDPA's
            # enable_gqa uses the same one).
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        return k, v, native_gqa

    def _in_dropout_stream(self, attend):
        """`attend(dropout_p)` with attention dropout drawn from the right RNG stream."""
        dropout_p = self.dropout_p if self.training else 0.0
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            # Heads are TP-sharded: each rank draws its masks from its own tensor-parallel stream.
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return attend(dropout_p)
        # Under sequence parallelism megatron's TransformerBlock already runs every layer inside
        # that stream. Forking again (as megatron's own attention also avoids) would break
        # activation recomputation: the nested fork reads the tracker's saved state, which does
        # not include the hidden-dropout draws made since the outer fork began, while
        # recomputation restores the live generator state — measured on TP=2 with dropout 0.1,
        # the recomputed gradients then differed.
        return attend(dropout_p)

    def _sdpa(self, q, k, v, attn_mask, dropout_p, is_causal, native_gqa) -> torch.Tensor:
        if self.softmax_offset is None:
            return self._sdpa_call(q, k, v, attn_mask, dropout_p, is_causal, native_gqa)
        q, k, v, attn_mask = with_sink(q, k, v, attn_mask, self.softmax_offset, self.softmax_scale)
        out = self._sdpa_call(q, k, v, attn_mask, dropout_p, is_causal, native_gqa)
        return out[..., 1:, : self.head_dim]

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The sink logits, sharded by heads over TP (megatron's `DotProductAttention` layout)."""
        if self.softmax_offset is None:
            return {}
        return make_sharded_tensors_for_checkpoint(
            {"softmax_offset": self.softmax_offset},
            prefix,
            {"softmax_offset": 0},
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=(metadata or {}).get("dp_cp_group"),
        )

    def _sdpa_call(self, q, k, v, attn_mask, dropout_p, is_causal, native_gqa) -> torch.Tensor:
        def attend() -> torch.Tensor:
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=self.softmax_scale,
                enable_gqa=native_gqa,
            )

        backends = sdpa_backends(q.device)
        if backends is None:
            return attend()
        with sdpa_kernel(backends):
            return attend()


def with_sink(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One SDPA call's inputs with the sink position in front (see the module docstring).

    Args:
        q: [b, heads, sq, d]; k, v: [b, heads or groups, sk, d].
        attn_mask: None or additive [.., sq, sk].
        sinks: [heads] sink logits.
        scale: the call's softmax scale.

    Returns:
        q [b, heads, sq + 1, d + c], k and v [b, ., sk + 1, d + c] (c extra channels, 8 so that
        CUDA kernels keep an aligned head dim; the sink channel first) and the mask
        [.., sq + 1, sk + 1] (sink column open, the dropped query sees only the sink). The caller
        keeps the output's positions 1.. and channels ..d.
    """
    b, heads, _, d = q.shape
    extra = 8
    sink_channel = (sinks / scale).to(q.dtype).view(1, heads, 1, 1).expand(b, heads, q.shape[2], 1)
    q = torch.cat([q, sink_channel, q.new_zeros(*q.shape[:3], extra - 1)], dim=-1)
    k = F.pad(k, (0, extra))
    v = F.pad(v, (0, extra))
    sink_key = k.new_zeros(*k.shape[:2], 1, d + extra)
    sink_key[..., d] = 1.0
    k = torch.cat([sink_key, k], dim=2)
    v = F.pad(v, (0, 0, 1, 0))
    q = F.pad(q, (0, 0, 1, 0))
    if attn_mask is not None:
        # Sink column open for every query; the dropped front query sees the sink only.
        attn_mask = F.pad(attn_mask, (1, 0, 1, 0), value=torch.finfo(attn_mask.dtype).min)
        attn_mask[..., :, 0] = 0.0
    return q, k, v, attn_mask


#: The SDPA kernels this module lets torch choose from on CUDA: not cuDNN's. Measured on an
#: H200 (torch 2.11+cu130, 2026-11-27), where torch picks cuDNN attention for our bf16 calls:
#: the bundled example's step-1 gradient norm was 17.26 in bf16 against 0.268 in fp32 on the
#: same weights, it changed with unrelated memory layout (4.77 with a second reference model,
#: NaN with the bias-dropout fusion off), and runs stopped on non-finite gradients within 4
#: steps; with cuDNN excluded the bf16 norms were 0.2681 / 0.2490 / 0.3139 against fp32's
#: 0.2684 / 0.2493 / 0.3142, at 0.18 s/step. The forward pass was right either way. An isolated
#: causal GQA call on permuted [b, n, s, d] views with a contiguous output gradient was right
#: under every backend, so what in the model's calls trips cuDNN is not established. Flash
#: (bf16/fp16), memory-efficient and the math kernel remain, in torch's order.
CUDA_SDPA_BACKENDS = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


def sdpa_backends(device: torch.device) -> list[SDPBackend] | None:
    """The kernels SDPA may use for tensors on `device`: `CUDA_SDPA_BACKENDS` on CUDA, None
    (torch's own choice) elsewhere."""
    return CUDA_SDPA_BACKENDS if device.type == "cuda" else None


def native_gqa_is_fast(query: torch.Tensor, attn_mask: torch.Tensor | None) -> bool:
    """Whether to let SDPA broadcast KV groups itself (`enable_gqa`) instead of expanding them.

    Both give identical results. On CPU the fused kernel takes grouped KV directly (measured
    ~10% faster fwd+bwd than expanding, b=4, s=256, 8 heads / 2-4 groups, d=64, one thread).
    On CUDA only the flash kernel accepts grouped KV; flash needs fp16/bf16 and no explicit mask,
    otherwise SDPA would fall back to the [s x s] math kernel, where expanded KV keeps the
    memory-efficient kernel usable.
    """
    if query.device.type == "cpu":
        return True
    return attn_mask is None and query.dtype in (torch.float16, torch.bfloat16)
