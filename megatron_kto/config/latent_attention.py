"""Run-config checks of multi-latent attention models (DeepSeek-V3, `models/mla.py`)."""

from __future__ import annotations

from typing import Any

from megatron_kto.config.errors import need


def check_latent_attention(m: Any) -> None:
    """Multi-latent attention (DeepSeek-V3): the combinations not built yet, and the sizes
    megatron-core splits over TP — before its asserts."""
    if not m.multi_latent_attention:
        return
    need(
        m.context_parallel_size == 1,
        "model.context_parallel_size",
        f"{m.context_parallel_size}: multi-latent attention (DeepSeek-V3) is not split over "
        "context-parallel ranks yet (set it to 1)",
    )
    need(
        str(m.peft.peft_scheme) == "none",
        "model.peft.peft_scheme",
        "LoRA on multi-latent attention (DeepSeek-V3: q_a_proj, q_b_proj / q_proj, "
        "kv_a_proj_with_mqa, kv_b_proj, o_proj) is not supported yet",
    )
    need(
        str(m.attention_backend) in ("auto", "sdpa"),
        "model.attention_backend",
        f"{m.attention_backend!r} cannot run multi-latent attention (DeepSeek-V3: a value head "
        "dim of its own); set model.attention_backend=sdpa (or auto)",
    )
    # megatron-core 0.16.1's local MLA splits the key/value down projection over TP and gathers
    # its output; the gather's backward only splits, so the shared rotated key's gradient keeps
    # this rank's heads' part and drops the others' (measured: TP2 x SP step-1 gradient norm
    # 1.29703 against TP1's 1.29751 on a tiny DeepSeek-V3). Forward passes are exact at TP2.
    need(
        m.tensor_model_parallel_size == 1,
        "model.tensor_model_parallel_size",
        f"{m.tensor_model_parallel_size}: multi-latent attention (DeepSeek-V3) trains at tensor "
        "parallel size 1 only for now (megatron-core's TP-split latent projections lose part of "
        "the rotated key's gradient); use expert / pipeline / data parallelism",
    )
