"""Run-config checks of multi-latent attention models (DeepSeek-V3, `models/mla.py`)."""

from __future__ import annotations

from typing import Any

from megatron_kto.config.errors import need


def check_latent_attention(m: Any) -> None:
    """Multi-latent attention (DeepSeek-V3): the combinations not built yet, and the sizes
    megatron-core splits over TP — before its asserts. Context parallelism is not among them
    (`models/mla.py`, tests/test_mla_context_parallel.py)."""
    if not m.multi_latent_attention:
        return
    need(
        str(m.attention_backend) != "local",
        "model.attention_backend",
        f"{m.attention_backend!r} cannot run multi-latent attention (DeepSeek-V3: a value head "
        "dim of its own); set model.attention_backend=sdpa (or auto, te)",
    )
    # The rotated key's gradient is summed over TP (`models/mla.py`), proven equal to TP=1's
    # with sequence parallelism (tests/test_deepseek_v3.py); MoE at TP > 1 requires SP anyway.
    need(
        m.tensor_model_parallel_size == 1 or m.sequence_parallel,
        "model.sequence_parallel",
        f"false: multi-latent attention (DeepSeek-V3) at tensor parallel size "
        f"{m.tensor_model_parallel_size} runs with sequence parallelism only; set "
        "model.sequence_parallel=true",
    )
