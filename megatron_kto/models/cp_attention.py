"""Context-parallel causal attention on torch SDPA: keys and values all-gathered over the CP group.

Each CP rank holds two chunks of every row (`models.context_parallel`: chunks r and 2·CP−1−r of
2·CP). Its queries need the keys and values of every earlier position of their row, which live
on other ranks. This is the all-gather form of context parallelism (Transformer Engine's
`cp_comm_type="all_gather"`): every rank gathers the whole rows' keys and values, puts them back
in row order, and attends with its own queries only:

* a query chunk k of a row (global positions [k·c, (k+1)·c)) sees the row's first (k+1)·c keys,
  causally aligned at the bottom right (`prefix_causal_attention`): the earlier chunks in full,
  its own chunk causally — the CP=1 causal mask restricted to these queries, so outputs equal
  CP=1;
* the gather is megatron-core's sequence all-gather (`gather_from_sequence_parallel_region`
  over the CP group): its backward reduce-scatters the key/value gradients, so each rank gets
  the sum over all ranks' queries of the gradient of its own keys and values;
* work is balanced: rank r's two chunks see (r+1) + (2·CP−r) = 2·CP+1 chunks of keys;
* a sliding window (`SDPAttention.window`) keeps only the keys a chunk's queries can see (from
  its first query's position − window + 1 on) and masks the band within them.

Memory: the gathered keys and values are whole rows (2 × groups/TP × d per token — with GQA a
small fraction of the hidden size); the scores, the large part, stay per local query. Packed
micro-batches use the whole segments of `PackedRows.seqlens`; a padded micro-batch [s, b, ...]
is one segment of length s·CP per row. The gathered keys are put in row order with an index
built once per micro-batch on the device (`context_parallel.SplitIndex.order`): a packed one's
`PackedRows.cp_order`, a padded one's shape's `padded_split_index`.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from torch.nn.attention.bias import causal_lower_right

from megatron_kto.models.attention_masks import additive_mask, window_mask
from megatron_kto.models.context_parallel import padded_split_index


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    packed_seq_params: PackedSeqParams | None,
    cp_group: torch.distributed.ProcessGroup,
    sdpa: Any,
) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole rows.

    Args:
        query: [s, b, heads/TP, d] (padded) or [t, heads/TP, d] (packed) — this rank's tokens.
        key, value: the same layout with groups/TP heads.
        attention_mask: must be None (causality comes from the positions).
        packed_seq_params: the micro-batch's context-parallel `PackedRows`, or None (padded).
        cp_group: the context-parallel group.
        sdpa: the `SDPAttention` module (its SDPA call, GQA handling and dropout stream).

    Returns:
        [s, b, heads/TP · d] ([t, heads/TP · d] when packed), in the query's dtype.
    """
    if attention_mask is not None:
        raise NotImplementedError("context-parallel SDPA attention takes no attention_mask")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    packed = packed_seq_params is not None
    if packed:
        if packed_seq_params.qkv_format != "thd" or getattr(packed_seq_params, "cp_size", 1) != (
            cp_size
        ):
            raise NotImplementedError(
                "context-parallel SDPA attention takes packed micro-batches as split by "
                "models.context_parallel (thd, PackedRows with cp_size set)"
            )
        seqlens = tuple(packed_seq_params.seqlens)
        # [t, n, d] -> [t, 1, n, d]: the padded layout with one batch row.
        query, key, value = (t.unsqueeze(1) for t in (query, key, value))
    else:
        seqlens = (query.shape[0] * cp_size,)
    local = query.shape[0]
    if sum(seqlens) != local * cp_size:
        raise ValueError(f"segments of {sum(seqlens)} tokens, but {local} × CP {cp_size} given")
    # Built once per micro-batch on the device (`context_parallel.split_micro_batch`), never
    # per layer, and never copied from the host.
    order = (
        packed_seq_params.cp_order
        if packed
        else padded_split_index(seqlens[0], cp_size, cp_rank, query.device).order
    )
    if order is None:
        raise ValueError("a context-parallel PackedRows without cp_order (split_micro_batch)")
    # Whole rows in order: [S, b, groups, d] (all-gather forward, reduce-scatter backward).
    key, value = (
        tensor_parallel.gather_from_sequence_parallel_region(
            t, tensor_parallel_output_grad=True, group=cp_group
        ).index_select(0, order)
        for t in (key, value)
    )
    # [s, b, n, d] -> [b, n, s, d] views.
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    # The lower-right causal variant is a causal mask flash/efficient kernels take, so the
    # grouped-KV choice is the one for an unmasked call.
    k, v, native_gqa = sdpa._grouped_kv(q, k, v, None)

    def attend(dropout_p: float) -> list[torch.Tensor]:
        outputs, local_start, whole_start = [], 0, 0
        for n in seqlens:
            c = n // (2 * cp_size)
            for j, chunk in enumerate((cp_rank, 2 * cp_size - 1 - cp_rank)):
                qc = q[:, :, local_start + j * c : local_start + (j + 1) * c]
                visible = (chunk + 1) * c
                kc = k[:, :, whole_start : whole_start + visible]
                vc = v[:, :, whole_start : whole_start + visible]
                outputs.append(
                    prefix_causal_attention(
                        sdpa, qc, kc, vc, dropout_p, native_gqa, window=sdpa.window
                    )
                )
            local_start += 2 * c
            whole_start += n
        return outputs

    # [b, n, s, d] -> [s, b, n·d] (or [t, n·d])
    context = torch.cat(sdpa._in_dropout_stream(attend), dim=2).permute(2, 0, 1, 3)
    context = context.reshape(local, query.shape[1], -1)
    return context[:, 0] if packed else context


def prefix_causal_attention(
    sdpa: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float,
    native_gqa: bool,
    lower_right_mask: bool | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of the last `c` positions of a sequence (`query` [b, n, c, d]) over all of it
    (`key`/`value` [b, g, s, d], s >= c), causally: query i sees keys 0 .. s − c + i.

    Two equal ways (`lower_right_mask`; None: by device):

    * CUDA: torch's lower-right causal bias (`causal_lower_right`), which SDPA dispatches to its
      flash / memory-efficient kernels without materialising a mask;
    * CPU: those kernels do not exist there and the bias would be materialised as an [c, s] mask
      (measured: +54 MiB for one call at c = 1024, s = 4096, 8 heads — more than the scores the
      split saves). Instead the queries are left-padded with zeros to length s and run with
      SDPA's plain causal flag (the fused CPU kernel, no mask); the padded rows' outputs are
      dropped. It costs up to s/c times the attention work of this chunk, on the CPU only.

    With a sliding `window`, query i sees keys s − c + i − window + 1 .. s − c + i: the keys
    before the first query's window are dropped, and a band mask is used when the window still
    cuts the rest (`attention.window_mask`).
    """
    c, s = query.shape[2], key.shape[2]
    if window is not None:
        first = max(0, s - c - window + 1)
        key, value = key[:, :, first:], value[:, :, first:]
        s -= first
        if window < s:
            mask = additive_mask(window_mask(c, s, window, query.device), query.dtype)
            return sdpa._sdpa(query, key, value, mask, dropout_p, False, native_gqa)
    if s == c:
        return sdpa._sdpa(query, key, value, None, dropout_p, True, native_gqa)
    if lower_right_mask is None:
        lower_right_mask = query.device.type != "cpu"
    if lower_right_mask:
        mask = causal_lower_right(c, s)
        return sdpa._sdpa(query, key, value, mask, dropout_p, False, native_gqa)
    padded = torch.nn.functional.pad(query, (0, 0, s - c, 0))
    return sdpa._sdpa(padded, key, value, None, dropout_p, True, native_gqa)[:, :, s - c :]
