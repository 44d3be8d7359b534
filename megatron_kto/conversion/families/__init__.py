"""One module per Hugging Face model family; each defines `FAMILIES` (see `conversion/registry.py`).

`mismatch` is the shared check of what a family's checkpoints can hold.
"""

from __future__ import annotations

from megatron_kto.models.architecture import GPTArchitecture

_FEATURES = {
    "qkv_bias": ("qkv biases", lambda a: a.add_qkv_bias),
    "qk_norm": ("per-head Q/K norms", lambda a: a.qk_layernorm),
    "moe": ("mixture-of-experts layers", lambda a: bool(a.num_moe_experts)),
    "shared_expert": (
        "a gated shared expert",
        lambda a: bool(a.moe_shared_expert_intermediate_size) and a.moe_shared_expert_gate,
    ),
    "dense_layers": ("dense layers between MoE layers", lambda a: a.has_dense_layers()),
}


def mismatch(arch: GPTArchitecture, **has: bool) -> str | None:
    """Why `arch` differs from a family that has exactly the features `has` (qkv_bias, qk_norm,
    moe, shared_expert, dense_layers — absent means False): one phrase, or None when it matches."""
    if arch.moe_shared_expert_intermediate_size and not arch.moe_shared_expert_gate:
        return "the model has an ungated shared expert"
    for key in _FEATURES:
        wanted = has.get(key, False)
        label, test = _FEATURES[key]
        if bool(test(arch)) != wanted:
            return f"the model {'has' if test(arch) else 'lacks'} {label}"
    return None
