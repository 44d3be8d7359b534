"""A stand-in for Transformer Engine's `te.pytorch.DotProductAttention` (TE 2.9) that checks what
it is handed under context parallelism (CP) and computes what TE computes, in plain torch (no tests).

`te_standin` compiles megatron-core's real `TEDotProductAttention` over this class, so the
constructor arguments, the `qkv_format` / mask-type translation and the `PackedSeqParams` fields
it forwards are megatron-core's own. The contract checked is TE 2.9's, read from
`transformer_engine/pytorch/attention/dot_product_attention/{dot_product_attention,backends,
context_parallel}.py` at tag v2.9; a violation raises `TEContractError` naming what was wrong:

* CP state: `cp_group` a process group, `cp_global_ranks` its global ranks, a `cp_stream`, and a
  known `cp_comm_type` — given to the constructor or to `set_context_parallel_group`;
* tensors: one dtype, head dims = `kv_channels`, key/value heads = this TP rank's GQA groups;
  `sbhd`/`bshd` 4-D, `thd` 3-D with a `padding*` mask and int32 `cu_seqlens_q/kv` of one shape;
* under CP (`attn_forward_func_with_cp`): `thd` only with `cp_comm_type="p2p"` and with
  `cu_seqlens_*_padded`; every (padded) sequence a multiple of 2·CP, the local token count
  their sum / CP; `sbhd`/`bshd` local length even and no padding mask; no sliding window
  (`attn_forward_func_with_cp` asserts one only with `cp_comm_type` "a2a" or "all_gather", TE
  2.9–2.12), no attention bias;
* sliding windows: `window_size` (left, 0) or the no-window (-1, 0) / None, from the constructor
  or the call; a query at position i of its sequence sees keys i − left .. i ("in [i + s_k − s_q
  − left, i + s_k − s_q + right] inclusive", `utils.get_full_mask`, self-attention: s_k = s_q);
* masks: only the causal kinds GPT uses (`causal`, `padding_causal`) are modelled here;
* multi-latent attention: `kv_channels` a (k, v) pair (TE 1.10+), under CP only from TE 2.5
  with `cp_comm_type` "p2p" / "a2a+p2p"; each call records the `kv_channels` and `softmax_scale`
  the constructor received;
* learnable softmax (`softmax_type="learnable"`, TE 2.8+): a `softmax_offset` parameter
  [heads / TP] (`dot_product_attention.py`); each head's offset is one more score column after
  scaling and masking, its probability dropped (`backends.py`, unfused attention; the fused one
  computes the same), i.e. exp(s_ij) / (exp(α_h) + Σ_j exp(s_ij)). Refused as
  `get_attention_backend` leaves no backend: `thd` before 2.12 (the version megatron-core's
  `get_te_version()` reports), CP with a `cp_comm_type` other than "a2a".

The computation is TE's "DualChunkSwap" layout read back (`context_parallel.py`, the docstring
of `attn_forward_func_with_cp`, and `get_batch_on_this_cp_rank`): every sequence (a `thd`
segment of `cu_seqlens_*_padded`, or a `sbhd` row) is cut into 2·CP chunks and rank r holds
chunks r and 2·CP−1−r, segment after segment. Keys and values are all-gathered over the CP group
(megatron-core's sequence all-gather: its backward reduce-scatters), put back at their global
positions, and every local query attends causally within its segment to the segment's real
tokens (the first `cu_seqlens_q[i+1] − cu_seqlens_q[i]` of it); a padding query's output is 0,
as TE's `fast_zero_fill` leaves it. Nothing here reuses `megatron_kto.models.context_parallel`
or `cp_attention`: a wrong split there gives wrong numbers here. The [q, k] mask is dense —
fine for the tiny sequences of tests.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.utils import get_te_version
from packaging.version import Version

#: TE 2.9 `constants.AttnMaskTypes`.
ATTN_MASK_TYPES = (
    "no_mask",
    "padding",
    "causal",
    "padding_causal",
    "causal_bottom_right",
    "padding_causal_bottom_right",
    "arbitrary",
)
#: The mask types modelled (GPT self-attention; megatron turns `causal` into `padding_causal`
#: for `thd`).
MODELLED_MASKS = ("causal", "padding_causal")
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
#: What each forward was handed (a test's record; TE keeps none). Cleared by `reset_calls`.
CALLS: list[dict[str, Any]] = []


class TEContractError(ValueError):
    """An input Transformer Engine 2.9 would refuse or misread."""


class CPStream:
    """Marks the `torch.cuda.Stream` megatron-core creates for TE's CP overlap (none on CPU)."""

    def __repr__(self) -> str:
        return "CPStream()"


def reset_calls() -> None:
    """Forget the recorded calls."""
    CALLS.clear()


def _mask_type(name: str) -> str:
    name = name.replace(",", "_")
    return "padding_causal" if name == "causal_padding" else name


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise TEContractError(f"TE 2.9 DotProductAttention: {message}")


def dual_chunk_positions(starts: list[int], lengths: list[int], cp: int, rank: int) -> list[int]:
    """Global positions of the tokens CP rank `rank` holds, in its local order: for every
    sequence (start, length), its chunk `rank` then its chunk 2·CP−1−`rank` of 2·CP."""
    out: list[int] = []
    for start, n in zip(starts, lengths, strict=True):
        c = n // (2 * cp)
        for chunk in (rank, 2 * cp - 1 - rank):
            out += range(start + chunk * c, start + (chunk + 1) * c)
    return out


class DotProductAttention(torch.nn.Module):
    """TE's `te.pytorch.DotProductAttention`, as megatron-core's `TEDotProductAttention` constructs
    and calls it (module docstring). No parameters but `softmax_offset` (learnable softmax)."""

    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: int | tuple[int, int],
        num_gqa_groups: int | None = None,
        attention_dropout: float = 0.0,
        qkv_format: str = "sbhd",
        attn_mask_type: str = "causal",
        window_size: tuple[int, int] | None = None,
        sequence_parallel: bool = False,
        tp_size: int = 1,
        get_rng_state_tracker=None,
        tp_group=None,
        layer_number: int | None = None,
        attention_type: str = "self",
        cp_group=None,
        cp_global_ranks: list[int] | None = None,
        cp_stream: Any = None,
        cp_comm_type: str = "p2p",
        softmax_scale: float | None = None,
        softmax_type: str = "vanilla",
        return_max_logit: bool = False,
    ) -> None:
        # The megatron wrapper sets attributes (config, ...) before calling us.
        torch.nn.Module.__init__(self)
        self.qkv_format = qkv_format
        self.attn_mask_type = _mask_type(attn_mask_type)
        _require(self.attn_mask_type in ATTN_MASK_TYPES, f"mask type {attn_mask_type!r}")
        _require(attention_type == "self", f"only self-attention is modelled ({attention_type})")
        _require(
            softmax_type in ("vanilla", "learnable"),
            f"softmax_type {softmax_type!r} is not modelled",
        )
        _require(not return_max_logit, "return_max_logit is not modelled")
        self.window_size = window_size
        self.tp_size = tp_group.size() if tp_group is not None else tp_size
        self.num_attention_heads = num_attention_heads
        self.num_gqa_groups = num_gqa_groups or num_attention_heads
        _require(num_attention_heads % self.num_gqa_groups == 0, "heads % GQA groups != 0")
        self.num_gqa_groups_per_partition = self.num_gqa_groups // self.tp_size
        k, v = kv_channels if isinstance(kv_channels, tuple) else (kv_channels, kv_channels)
        self.head_dim_k, self.head_dim_v = k, v
        #: As received (a test's record): MLA's (k, v) head dims and YaRN scale come from megatron.
        self.received = {"kv_channels": kv_channels, "softmax_scale": softmax_scale}
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(k)
        self.attention_dropout = attention_dropout
        self.softmax_type = softmax_type
        self.softmax_offset: torch.nn.Parameter | None = None
        if softmax_type == "learnable":
            # TE: torch.empty(heads // tp) in the default dtype, never initialised; NaN here.
            heads = num_attention_heads // self.tp_size
            self.softmax_offset = torch.nn.Parameter(torch.full((heads,), float("nan")))
        self.cp_group = None
        self.cp_global_ranks = None
        self.cp_stream = None
        self.cp_comm_type = cp_comm_type
        if cp_group is not None:
            self.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def get_extra_state(self) -> torch.Tensor:
        """TE modules' FP8 metadata: an empty uint8 tensor without FP8 (in the module state dict;
        megatron-core shards it only with learnable softmax)."""
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state: Any) -> None:
        pass

    def set_context_parallel_group(
        self, cp_group, cp_global_ranks: list[int] | None, cp_stream: Any, cp_comm_type: str = "p2p"
    ) -> None:
        """TE's CP setter, checked: a process group, its global ranks, a stream, a known type."""
        if cp_group is not None:
            _require(
                cp_comm_type in CP_COMM_TYPES,
                f"cp_comm_type {cp_comm_type!r}, not one of {CP_COMM_TYPES}",
            )
            _require(
                isinstance(cp_group, torch.distributed.ProcessGroup),
                f"cp_group must be a ProcessGroup for cp_comm_type={cp_comm_type!r}",
            )
            ranks = torch.distributed.get_process_group_ranks(cp_group)
            _require(
                list(cp_global_ranks or []) == ranks,
                f"cp_global_ranks {cp_global_ranks} are not cp_group's global ranks {ranks}",
            )
            _require(cp_stream is not None, "context parallelism needs a cp_stream")
        self.cp_group, self.cp_global_ranks = cp_group, cp_global_ranks
        self.cp_stream, self.cp_comm_type = cp_stream, cp_comm_type

    def forward(
        self,
        query_layer: torch.Tensor,
        key_layer: torch.Tensor,
        value_layer: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        qkv_format: str | None = None,
        cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_kv: torch.Tensor | None = None,
        cu_seqlens_q_padded: torch.Tensor | None = None,
        cu_seqlens_kv_padded: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_kv: int | None = None,
        attn_mask_type: str | None = None,
        window_size: tuple[int, int] | None = None,
        checkpoint_core_attention: bool = False,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: torch.Tensor | None = None,
        alibi_slopes: torch.Tensor | None = None,
        fast_zero_fill: bool = True,
        inference_params: Any = None,
        pad_between_seqs: bool | None = None,
        fp8_output: bool = False,
    ) -> torch.Tensor:
        """TE's forward: [s, b, h·d] (`sbhd`), [b, s, h·d] (`bshd`) or [t, h·d] (`thd`)."""
        fmt = qkv_format or self.qkv_format
        mask = _mask_type(attn_mask_type) if attn_mask_type is not None else self.attn_mask_type
        q, k, v = query_layer, key_layer, value_layer
        _require(q.dtype == k.dtype == v.dtype, "queries, keys and values differ in dtype")
        _require(k.shape[:-1] == v.shape[:-1], "keys and values differ in shape")
        _require(q.shape[-1] == self.head_dim_k, f"query head dim {q.shape[-1]}")
        _require(v.shape[-1] == self.head_dim_v, f"value head dim {v.shape[-1]}")
        _require(
            k.shape[-2] == self.num_gqa_groups_per_partition,
            f"keys have {k.shape[-2]} heads, expected {self.num_gqa_groups_per_partition}",
        )
        _require(mask in ATTN_MASK_TYPES, f"mask type {attn_mask_type!r}")
        _require(mask in MODELLED_MASKS, f"mask type {mask!r} is not modelled here")
        _require(fmt in ("sbhd", "bshd", "thd"), f"qkv_format {fmt!r}")
        window = window_size if window_size is not None else self.window_size
        window = None if window == (-1, 0) else window
        _require(
            window is None or (window[0] >= 0 and window[1] == 0),
            f"sliding window {window} is not modelled (only (left, 0))",
        )
        _require(
            core_attention_bias_type == "no_bias" and core_attention_bias is None,
            "attention bias is not modelled",
        )
        _require(alibi_slopes is None and inference_params is None, "alibi / KV cache")
        if self.training and self.attention_dropout > 0:
            raise NotImplementedError("the TE attention stand-in has no dropout")
        cp = self.cp_group.size() if self.cp_group is not None else 1
        rank = self.cp_group.rank() if self.cp_group is not None else 0
        _require(
            window is None or cp == 1 or self.cp_comm_type in ("a2a", "all_gather"),
            f"Context parallelism does not support sliding window attention with "
            f"cp_comm_type={self.cp_comm_type!r}",
        )
        if self.softmax_type != "vanilla":
            # get_attention_backend (2.8-2.12): no flash-attn; THD has neither fused nor unfused
            # attention before 2.12; under CP only fused attention with cp_comm_type "a2a".
            _require(
                fmt != "thd" or get_te_version() >= Version("2.12"),
                f"No dot product attention backend is available (softmax_type "
                f"{self.softmax_type!r} with thd before 2.12; this is {get_te_version()})",
            )
            _require(
                cp == 1 or self.cp_comm_type == "a2a",
                f"No dot product attention backend is available (softmax_type "
                f"{self.softmax_type!r} under CP with cp_comm_type={self.cp_comm_type!r})",
            )
        # MLA (head_dim_qk != head_dim_v) under CP: TE 2.5+ (`attn_forward_func_with_cp`).
        _require(
            self.head_dim_k == self.head_dim_v
            or cp == 1
            or (get_te_version() >= Version("2.5") and self.cp_comm_type in ("p2p", "a2a+p2p")),
            f"Context parallelism does not support MLA with cp_comm_type={self.cp_comm_type!r} "
            f"(TE {get_te_version()})",
        )
        if fmt == "thd":
            starts, lengths, real = self._thd_segments(
                q, attention_mask, mask, cp, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
                cu_seqlens_kv_padded, max_seqlen_q,
            )  # fmt: skip
            q3, k3, v3 = q, k, v
        else:
            _require(all(t.dim() == 4 for t in (q, k, v)), f"{fmt} takes 4-D tensors")
            _require(attention_mask is None, "a causal mask takes no attention_mask")
            _require("padding" not in mask or cp == 1, "no padding mask under CP with sbhd/bshd")
            # [s, b, h, d] / [b, s, h, d] -> [b·s, h, d]: each row a sequence of s·CP tokens.
            rows_first = (t.transpose(0, 1) if fmt == "sbhd" else t for t in (q, k, v))
            q3, k3, v3 = (t.reshape(-1, *t.shape[2:]) for t in rows_first)
            rows, local = (q.shape[1], q.shape[0]) if fmt == "sbhd" else q.shape[:2]
            _require(cp == 1 or local % 2 == 0, f"{local} tokens per rank: not divisible by 2")
            starts = [i * local * cp for i in range(rows)]
            lengths = real = [local * cp] * rows
        CALLS.append(
            {
                "qkv_format": fmt,
                "attn_mask_type": mask,
                "cp_size": cp,
                "cp_global_ranks": self.cp_global_ranks,
                "cp_comm_type": self.cp_comm_type if cp > 1 else None,
                "cp_stream": self.cp_stream,
                "padded_lengths": list(lengths),
                "real_lengths": list(real),
                "local_tokens": q3.shape[0],
                "window_size": window,
                "softmax_type": self.softmax_type,
                **self.received,
            }
        )
        left = window[0] if window is not None else None
        out = self._attend(q3, k3, v3, starts, lengths, real, cp, rank, left)
        if fmt == "thd":
            return out
        rows_out = out.view(rows, local, -1)
        return rows_out.transpose(0, 1) if fmt == "sbhd" else rows_out

    def _thd_segments(
        self, q, attention_mask, mask, cp, cu_q, cu_kv, cu_q_pad, cu_kv_pad, max_seqlen_q
    ):
        """(starts, padded lengths, real lengths) of the `thd` segments, checked."""
        _require(q.dim() == 3, "thd takes 3-D tensors")
        _require(attention_mask is None, "thd takes its padding from cu_seqlens, no attention_mask")
        _require("padding" in mask, f"thd needs a padding mask type, got {mask!r}")
        _require(cu_q is not None and cu_kv is not None, "thd needs cu_seqlens_q and _kv")
        _require(cu_q.shape == cu_kv.shape and cu_q.dim() == 1, "cu_seqlens shapes differ")
        _require(cu_q.dtype == cu_kv.dtype == torch.int32, "cu_seqlens must be int32")
        if cp > 1:
            _require(
                self.cp_comm_type == "p2p",
                f"thd under CP needs cp_comm_type='p2p', got {self.cp_comm_type!r}",
            )
            _require(
                cu_q_pad is not None and cu_kv_pad is not None,
                "cu_seqlens_padded can not be None for context parallelism and thd",
            )
        pad_q = cu_q_pad if cu_q_pad is not None else cu_q
        pad_kv = cu_kv_pad if cu_kv_pad is not None else cu_kv
        _require(torch.equal(pad_q, pad_kv) and torch.equal(cu_q, cu_kv), "self-attention only")
        bounds, real_bounds = pad_q.tolist(), cu_q.tolist()
        lengths = [b - a for a, b in zip(bounds, bounds[1:])]
        real = [b - a for a, b in zip(real_bounds, real_bounds[1:])]
        _require(bounds[0] == 0 and min(lengths) >= 0, f"cu_seqlens_padded {bounds}")
        _require(
            all(0 <= r <= n for r, n in zip(real, lengths)),
            f"real lengths {real} exceed the padded ones {lengths}",
        )
        bad = [n for n in lengths if n % (2 * cp)]
        _require(not bad or cp == 1, f"padded sequences of {bad} tokens: not multiples of 2·CP")
        _require(
            bounds[-1] == q.shape[0] * cp,
            f"cu_seqlens_padded end at {bounds[-1]}, but {q.shape[0]} tokens × CP {cp} given",
        )
        _require(
            max_seqlen_q is None or max_seqlen_q >= max(lengths, default=0),
            f"max_seqlen_q {max_seqlen_q} < the longest sequence {max(lengths)}",
        )
        return bounds[:-1], lengths, real

    def _attend(self, q, k, v, starts, lengths, real, cp, rank, left=None) -> torch.Tensor:
        """[t, h·d]: local queries over the whole sequences' keys (module docstring); with
        `left`, only the keys at most `left` positions before the query."""
        device = q.device
        if cp > 1:
            gathered = [
                dual_chunk_positions(starts, lengths, cp, r) for r in range(cp)
            ]  # rank-major, the all-gather's order
            order = torch.tensor(gathered[0] + sum(gathered[1:], []), device=device).argsort()
            k, v = (
                gather_from_sequence_parallel_region(
                    t, tensor_parallel_output_grad=True, group=self.cp_group
                ).index_select(0, order)
                for t in (k, v)
            )
            q_pos = torch.tensor(gathered[rank], device=device, dtype=torch.long)
        else:
            q_pos = torch.arange(q.shape[0], device=device)
        total = sum(lengths)
        seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)
        start = torch.tensor(starts, device=device, dtype=torch.long)
        offset = torch.arange(total, device=device) - start[seg]
        is_real = offset < torch.tensor(real, device=device)[seg]
        q_seg, q_off = seg[q_pos], offset[q_pos]
        visible = (
            (q_seg[:, None] == seg[None, :])
            & (offset[None, :] <= q_off[:, None])
            & is_real[None, :]
            & is_real[q_pos][:, None]
        )
        if left is not None:
            visible &= offset[None, :] >= q_off[:, None] - left
        groups = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(groups, dim=1).float() for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q.float(), k) * self.softmax_scale
        # A finite fill: rows with no visible key (padding queries) stay finite, zeroed below.
        scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
        if self.softmax_offset is not None:
            # TE's unfused attention (backends.py): the fp32 offset as a last score column of
            # every head, after scaling and masking; its probability column is dropped.
            sink = self.softmax_offset.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
        else:
            probs = scores.softmax(dim=-1)
        context = torch.einsum("hqk,khd->qhd", probs, v)
        context = context * is_real[q_pos][:, None, None]
        return context.reshape(q.shape[0], -1).to(q.dtype)
