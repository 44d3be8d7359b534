"""Where Transformer Engine runs multi-latent attention (DeepSeek-V3: a value head dim of its own).

megatron-core 0.16.1's `MultiLatentAttention` builds its core attention with
`k_channels` = the query/key head dim (nope + rope), `v_channels` = `v_head_dim` and
`softmax_scale` = mscale(factor, mscale_all_dim)² / √(nope + rope) (YaRN); its
`TEDotProductAttention` hands TE `kv_channels=(k_channels, v_channels)` and the scale only from
TE 1.10 (`is_te_min_version("1.10.0")`, `extensions/transformer_engine.py`) — older TE would get
one head dim and its default scale, so it is refused. What TE does with head_dim_qk != head_dim_v,
read from its sources (`pytorch/attention/dot_product_attention/utils.py::get_attention_backend`,
"Filter: Head dimension" / "Filter: Context parallelism", and `common/fused_attn/fused_attn.cpp::
nvte_get_fused_attn_backend`, tags v2.9-v2.12; the MLA filters are the same from v1.10):

| TE backend    | MLA                                                                        |
|---------------|----------------------------------------------------------------------------|
| flash-attn 2  | never ("Disabling FlashAttention 2 as it does not support MLA")            |
| flash-attn 3  | (128, 192] x (96, 128] on Hopper — not modelled (flash_attn_3 not checked) |
| fused (cuDNN) | separate q/k/v tensors (`hd_hd_hd`: megatron's MLA passes them so), both   |
|               | dims multiples of 8, training: both <= 128 on sm80+; <= 256 on sm90 with   |
|               | cuDNN >= 9.5 but not (cuDNN >= 9.11: both >= 128, unequal, not 192/128);   |
|               | 192/128 on sm100 with cuDNN >= 9.11; packed (THD) as for equal dims (sm90+)|
| unfused       | any dims (it reads the value dim from the value tensor); THD from 2.11     |
| under CP      | fused only, from 2.5 (`AttnFuncWithCPAndKVP2P` gained MLA in TE PR #1729;  |
|               | `attn_forward_func_with_cp` asserts cp_comm_type "p2p" or "a2a+p2p");      |
|               | before 2.5 `get_attention_backend` disables fused attention for CP + MLA   |

So DeepSeek-V3's 192 / 128 has a fused kernel on Hopper (cuDNN >= 9.5) and Blackwell (sm100,
cuDNN >= 9.11), and only the unfused path on an A100; tiny test dims (<= 128) everywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from packaging.version import Version

if TYPE_CHECKING:
    from megatron_kto.runtime.attention_features import AttentionFeatures
    from megatron_kto.runtime.gpu_settings import Accelerator

__all__ = ["TE_MLA_CP_SINCE", "TE_MLA_SINCE", "latent_head_dims", "latent_refusal"]

#: First TE whose DotProductAttention takes (k, v) head dims and a softmax scale from megatron.
TE_MLA_SINCE = Version("1.10.0")
#: First TE whose context parallelism (p2p) takes a value head dim of its own.
TE_MLA_CP_SINCE = Version("2.5.0")
#: cuDNN (torch's number) from which Hopper trains head dims up to 256 ...
CUDNN_HOPPER_256 = 90500
#: ... and from which Blackwell trains 192 / 128 (and Hopper refuses other unequal dims >= 128).
CUDNN_MLA_192_128 = 91100
_MULTIPLE, _EVERY_GPU, _MAX = 8, 128, 256


def latent_refusal(version: Version | None, cp: int) -> str | None:
    """Why no TE backend runs multi-latent attention at this version (None: some may)."""
    if version is None or version < TE_MLA_SINCE:
        return (
            f"multi-latent attention (a value head dim of its own) reaches its attention only "
            f"from {TE_MLA_SINCE} (megatron-core passes k/v head dims and the softmax scale there)"
        )
    if cp > 1 and version < TE_MLA_CP_SINCE:
        return f"its context parallelism takes multi-latent attention only from {TE_MLA_CP_SINCE}"
    return None


def latent_head_dims(
    accelerator: Accelerator, features: AttentionFeatures
) -> tuple[bool, bool, str]:
    """(a fused kernel may exist, it surely exists on this GPU, why not) for MLA's head dims.

    Sure means on every GPU (both dims <= 128), or on the GPU generation read by the builder
    (`Accelerator.compute_capability`): Hopper or Blackwell per the module table."""
    qk, v = features.head_dim, features.value_head_dim or features.head_dim
    dims = f"head dims {qk} / {v}"
    if qk % _MULTIPLE or v % _MULTIPLE or max(qk, v) > _MAX:
        return False, False, f"its fused attention needs {dims} multiples of 8 up to {_MAX}"
    if max(qk, v) <= _EVERY_GPU:
        return True, True, ""
    cudnn, capability = accelerator.cudnn or 0, accelerator.compute_capability
    hopper_bug = (  # fused_attn.cpp: "9.11+ bug"
        cudnn >= CUDNN_MLA_192_128 and min(qk, v) >= 128 and qk != v and (qk, v) != (192, 128)
    )
    hopper = capability == (9, 0) and cudnn >= CUDNN_HOPPER_256 and not hopper_bug
    blackwell = (
        capability is not None
        and capability[0] == 10
        and (qk, v) == (192, 128)
        and cudnn >= CUDNN_MLA_192_128
    )
    why = (
        f"its fused attention trains {dims} only on Hopper (cuDNN >= 9.5), or as 192 / 128 on "
        "Blackwell (cuDNN >= 9.11); flash-attn 2 never runs a value head dim of its own"
    )
    return True, hopper or blackwell, "" if hopper or blackwell else why
