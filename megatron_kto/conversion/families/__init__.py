"""One module per Hugging Face model family; each defines `FAMILIES` (see `conversion/registry.py`).

`mismatch` is the shared check of what a family's checkpoints can hold.
"""

from __future__ import annotations

from megatron_kto.models.architecture import GPTArchitecture

_FEATURES = {
    "qkv_bias": ("qkv biases", lambda a: a.add_qkv_bias),
    "qk_norm": ("per-head Q/K norms", lambda a: a.qk_layernorm),
    "moe": ("mixture-of-experts layers", lambda a: bool(a.num_moe_experts)),
}


def mismatch(arch: GPTArchitecture, **has: bool) -> str | None:
    """Why `arch` differs from a family that has exactly the features `has` (qkv_bias, qk_norm,
    moe): one phrase, or None when it matches."""
    for key, wanted in has.items():
        label, test = _FEATURES[key]
        if test(arch) != wanted:
            return f"the model {'has' if test(arch) else 'lacks'} {label}"
    return None
