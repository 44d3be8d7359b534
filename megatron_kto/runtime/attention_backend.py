"""Which attention backend a run uses, decided once, before any model is built.

`choose_attention_backend` is a pure function of the request (`model.attention_backend`), the
precision, packing, the machine (`gpu_settings.Accelerator`: CUDA, Transformer Engine version),
the context-parallel size, sequence parallelism and the head dimension, so tests can state
any machine. `auto` never returns a backend that cannot run the configuration; an explicit
choice that cannot run is a `ValueError` whose one-line message names the key and what to set.

What Transformer Engine can run, from its `get_attention_backend`
(`pytorch/attention/dot_product_attention/utils.py`) and cuDNN's support check
(`common/fused_attn/fused_attn.cpp`, `nvte_get_fused_attn_backend`), read at tags v2.9–v2.12.
Packed micro-batches reach TE as `qkv_format="thd"` (megatron-core's `TEDotProductAttention`,
mask `padding_causal`, no padding between sequences):

| TE backend    | dtypes         | packed (THD)                   | CP  | head dim, training         |
|---------------|----------------|--------------------------------|-----|----------------------------|
| flash-attn 2  | bf16, fp16     | yes                            | yes | multiple of 8, <= 256      |
| fused (cuDNN) | bf16, fp16     | on sm90+ only                  | yes | multiple of 8, <= 128;     |
|               |                |                                |     | <= 256 on sm90, cuDNN 9.5+ |
| unfused       | fp32/bf16/fp16 | refused before 2.11, then yes  | no  | any                        |

(All four tags agree except the unfused THD row, which changed in 2.11.)
So on TE 2.9 and 2.10 nothing runs fp32 + packing (TE raises "No dot product attention
backend is available" at the first forward), and nothing in TE runs fp32 under context
parallelism (2.9–2.12). GQA restricts nothing here: flash-attn and the unfused path take any
group count, cuDNN's THD path takes GQA from cuDNN 9.6 (an older cuDNN is not modelled).
Sequence parallelism touches only the linear layers; every backend sees whole sequences.

Outside TE: `sdpa` (ours, `models/attention.py`) and `local` (megatron's `DotProductAttention`)
run any precision and head dim on CPU and CUDA; `local` cannot keep packed rows apart and has no
context parallelism; `sdpa` has its own (keys and values all-gathered over the CP group,
`models/cp_attention.py`), for padded and packed micro-batches.

Sliding-window attention (`model.sliding_window`, megatron-core's `window_size`): `sdpa` runs
it everywhere (band masks, packed rows and context parallelism included); TE takes `window_size`
in its own attention (not run on a GPU by our tests yet). Whether TE's context parallelism with
our `cp_comm_type="p2p"` honours a window is not established here, so windows + CP is `sdpa`
under `auto` and an error for an explicit `te`. megatron's `local` attention builds its window
mask on CUDA only and ignores a padding mask with it: refused.

Attention sinks (`model.attention_sinks`, GPT-OSS): `sdpa` computes them (an extra key column,
`models/attention.py`), checked against `transformers`; `auto` chooses it, an explicit `te` or
`local` is refused (neither is verified with sinks here), and so is context parallelism.

How `auto` decides: TE when it is usable and one of its fused kernels surely exists for the
configuration (bf16/fp16, head dim a multiple of 8 up to 128); otherwise `sdpa` — in fp32 TE
would only have its unfused attention, which materialises the [b, h, s, s] scores, where torch's
SDPA has a memory-efficient kernel. Context parallelism changes nothing in that rule: TE's CP
attention (megatron-core's, `cp_comm_type="p2p"`) where a fused kernel surely exists, else our
SDPA CP attention; only an explicit `te` that cannot run, or `local`, is an error. Packed half precision has a kernel on Hopper or newer
(cuDNN's THD kernels) or with flash-attn installed: the GPU generation is read only once the
device is set (reading it initialises CUDA), so the start-up check, which runs before that,
assumes it, and the model builder decides again with the GPU known (`Accelerator.detect(
read_device=True)`): on an A100 without flash-attn, packed `auto` becomes `sdpa` there and an
explicit `te` is an error (on TE < 2.11) — never a crash at the first forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from packaging.version import InvalidVersion, Version

from megatron_kto.runtime.gpu_settings import Accelerator

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionChoice",
    "CONFIG_NAMES",
    "SettingNames",
    "choose_attention_backend",
    "head_dim_of",
    "local_layers_only_of",
]

#: `model.attention_backend` values.
ATTENTION_BACKENDS = ("auto", "te", "sdpa", "local")
#: First TE release whose unfused attention takes THD (packed) input.
TE_UNFUSED_THD_SINCE = Version("2.11.0")
#: Head dims TE's flash and fused kernels take: multiples of this ...
KERNEL_HEAD_DIM_MULTIPLE = 8
#: ... up to this on every supported GPU (cuDNN on sm80+; packed input needs sm90+ or
#: flash-attn, which is not modelled: see the module docstring) ...
KERNEL_HEAD_DIM_EVERY_GPU = 128
#: ... and up to this with flash-attn 2, or cuDNN >= 9.5 on Hopper.
KERNEL_HEAD_DIM_MAX = 256
#: Compute capability from which cuDNN's fused attention takes packed (THD) input.
HOPPER = (9, 0)

_HALF = {"bf16": "bf16", "16": "fp16"}
_KEY = "model.attention_backend"


@dataclass(frozen=True)
class AttentionChoice:
    """The backend a run uses and why, for the start-up note."""

    backend: str
    """'te', 'sdpa' or 'local'."""
    reason: str
    """One clause saying why."""

    def describe(self) -> str:
        """'sdpa (<reason>)'."""
        return f"{self.backend} ({self.reason})"

    def note(self, request: str) -> str:
        """'model.attention_backend=auto: sdpa (<reason>)' — one start-up line."""
        return f"{_KEY}={request}: {self.describe()}"


def head_dim_of(model: Any) -> int:
    """Per-head dimension of anything with the GPTArchitecture fields."""
    return model.kv_channels or model.hidden_size // model.num_attention_heads


def local_layers_only_of(model: Any) -> bool:
    """Whether anything with the GPTArchitecture fields has layers only the local spec builds
    (post-norms, or a RoPE base of its own in sliding-window layers: `models.gemma_layers`;
    multi-latent attention: `models.mla`)."""
    if getattr(model, "multi_latent_attention", False):
        return True
    return bool(model.post_norms) or (
        model.rotary_base_local is not None and bool(model.sliding_window)
    )


def _te_version(accelerator: Accelerator) -> Version | None:
    try:
        return Version(accelerator.transformer_engine or "")
    except InvalidVersion:
        return None  # unknown: assume the older, stricter behaviour


@dataclass(frozen=True)
class _TECapability:
    kernel_sure: bool
    """A flash or fused kernel exists on any supported GPU."""
    runs: bool
    """Some TE backend may run it (a kernel on some GPUs, or the unfused path)."""
    why_not: str
    """Why it cannot run (when `runs` is False) or has no kernel (when `kernel_sure` is False)."""


def _te_capability(
    accelerator: Accelerator, precision: str, packed: bool, head_dim: int, cp: int
) -> _TECapability:
    """What TE (usable on this machine) can do for the configuration; see the module table."""
    version = _te_version(accelerator)
    named = f"Transformer Engine {accelerator.transformer_engine}"
    half = precision in _HALF
    aligned = head_dim % KERNEL_HEAD_DIM_MULTIPLE == 0
    capability = accelerator.compute_capability
    # Packed input: cuDNN's THD kernels need sm90+, flash-attn takes it on sm80+. An unread GPU
    # (start-up check, before CUDA is initialised) is assumed able; the builder checks again.
    packed_kernel = (
        not packed or accelerator.flash_attn or capability is None or capability >= HOPPER
    )
    kernel_possible = half and aligned and head_dim <= KERNEL_HEAD_DIM_MAX and packed_kernel
    kernel_sure = kernel_possible and head_dim <= KERNEL_HEAD_DIM_EVERY_GPU
    unfused_thd = version is not None and version >= TE_UNFUSED_THD_SINCE
    unfused_runs = cp == 1 and (not packed or unfused_thd)
    if not half:
        no_kernel = "its flash and fused attention need bf16 or fp16"
    elif not packed_kernel:
        no_kernel = (
            f"its fused attention takes packed (THD) input only on Hopper (sm90) or newer, this "
            f"GPU is sm{capability[0]}{capability[1]}, and flash-attn is not installed"
        )
    elif not kernel_possible:
        no_kernel = (
            f"its flash and fused attention need a head dim that is a multiple of "
            f"{KERNEL_HEAD_DIM_MULTIPLE} up to {KERNEL_HEAD_DIM_MAX}, got {head_dim}"
        )
    else:
        no_kernel = (
            f"its fused attention takes head dim {head_dim} only on Hopper (cuDNN >= 9.5) or "
            f"with flash-attn; up to {KERNEL_HEAD_DIM_EVERY_GPU} on every GPU"
        )
    if cp > 1:
        why_unfused = "its unfused attention has no context parallelism"
    else:
        why_unfused = (
            f"its unfused attention takes packed (THD) input only from {TE_UNFUSED_THD_SINCE}"
        )
    why_not = no_kernel if kernel_possible or unfused_runs else f"{no_kernel}, {why_unfused}"
    return _TECapability(kernel_sure, kernel_possible or unfused_runs, f"{named}: {why_not}")


def _describe(precision: str, packed: bool, cp: int) -> str:
    parts = [{"32": "fp32"}.get(precision, _HALF.get(precision, precision))]
    if packed:
        parts.append("packed sequences")
    if cp > 1:
        parts.append(f"context parallel size {cp}")
    return " + ".join(parts)


def _te_missing(accelerator: Accelerator) -> str:
    return "no CUDA device" if not accelerator.cuda else "Transformer Engine is not installed"


@dataclass(frozen=True)
class SettingNames:
    """How the settings are spelt in messages: config keys, or a tool's flags."""

    backend: str = _KEY
    precision: str = "trainer.precision"
    packing: str | None = "model.data.pack_sequences"
    """None: the caller always packs (the message does not offer to turn it off)."""

    def set(self, name: str, value: str) -> str:
        """'key=value' for a config key, '--flag value' for a flag."""
        return f"{name} {value}" if name.startswith("--") else f"{name}={value}"


CONFIG_NAMES = SettingNames()


def choose_attention_backend(
    request: str,
    *,
    precision: str,
    packed: bool,
    accelerator: Accelerator,
    head_dim: int,
    context_parallel_size: int = 1,
    sequence_parallel: bool = False,
    sliding_window: bool = False,
    local_layers_only: bool = False,
    attention_sinks: bool = False,
    names: SettingNames = CONFIG_NAMES,
) -> AttentionChoice:
    """The attention backend for a configuration on a machine.

    Args:
        request: `model.attention_backend`: 'auto', 'te', 'sdpa' or 'local'.
        precision: canonical `trainer.precision`: '32', 'bf16' or '16'.
        packed: micro-batches are packed (`model.data.pack_sequences`; THD for TE).
        accelerator: the machine (`Accelerator.detect()`, or stated by a test).
        head_dim: per-head dimension (`head_dim_of`).
        context_parallel_size: CP degree (`model.context_parallel_size`).
        sequence_parallel: megatron sequence parallelism; no backend restricts it (the module
            docstring says why), taken so that callers state the whole layout.
        sliding_window: some layers attend within a sliding window (`model.sliding_window`).
        local_layers_only: the model's layers exist in the local spec only (Gemma 3's post-norms
            and per-layer RoPE base, `models.gemma_layers`): never TE.
        attention_sinks: a learned sink logit per head (`model.attention_sinks`, GPT-OSS): only
            `sdpa` computes them (verified against `transformers`), and not under CP.
        names: how messages spell the settings (config keys by default).

    Returns:
        The backend and a one-clause reason.

    Raises:
        ValueError: one line starting with the setting's name: an unknown backend, an explicit
            choice that cannot run here, or a configuration no backend can run; it says what to
            set instead.
    """
    del sequence_parallel  # restricts no backend (module docstring)
    key = names.backend
    if request not in ATTENTION_BACKENDS:
        raise ValueError(f"{key}: must be one of {list(ATTENTION_BACKENDS)}, got {request!r}")
    cp = context_parallel_size
    what = _describe(precision, packed, cp)
    te_usable = accelerator.has_transformer_engine
    te = _te_capability(accelerator, precision, packed, head_dim, cp) if te_usable else None

    if request == "local" and packed:
        where = names.packing or key
        fix = f"set {names.set(names.packing, 'false')} or choose" if names.packing else "choose"
        raise ValueError(
            f"{where}: packed micro-batches need attention that keeps rows apart (te or sdpa); "
            f"{names.set(key, 'local')} (megatron's unfused attention) cannot take them: "
            f"{fix} another backend"
        )
    if request == "local" and sliding_window:
        raise ValueError(
            f"{key}: 'local' (megatron's unfused attention) cannot run sliding-window attention "
            f"(model.sliding_window) here; set {names.set(key, 'sdpa')} (or auto)"
        )
    if local_layers_only:
        if request == "te":
            raise ValueError(
                f"{key}: 'te' has no post-norms or per-layer RoPE base (Gemma 3) and does not "
                f"run our multi-latent attention (DeepSeek-V3); set {names.set(key, 'sdpa')} "
                "(or auto)"
            )
        if request == "auto":
            return AttentionChoice("sdpa", "the model's layers are built on the local spec only")
    if attention_sinks and cp > 1:
        raise ValueError(
            f"model.context_parallel_size: attention sinks (model.attention_sinks, GPT-OSS) have "
            f"no context-parallel attention here (context parallel size {cp}); set "
            "model.context_parallel_size=1"
        )
    if attention_sinks and request in ("te", "local"):
        raise ValueError(
            f"{key}: {request!r} is not used for attention sinks (model.attention_sinks, "
            f"GPT-OSS): only sdpa's sinks are verified against transformers; set "
            f"{names.set(key, 'sdpa')} (or auto)"
        )
    if attention_sinks:
        return AttentionChoice("sdpa", "attention sinks are computed by sdpa")
    if te is not None and sliding_window and cp > 1:
        te = _TECapability(
            False,
            False,
            f"Transformer Engine {accelerator.transformer_engine}: sliding windows under its "
            'context parallelism (cp_comm_type "p2p") are not established',
        )
    if request in ("sdpa", "local"):
        if cp > 1 and request == "local":
            raise ValueError(
                f"{key}: 'local' (megatron's unfused attention) has no context parallelism "
                f"(context parallel size {cp}): set {names.set(key, 'sdpa')} (or auto), or "
                "context parallel size 1"
            )
        return AttentionChoice(request, "as configured")
    if request == "te":
        if te is None:
            raise ValueError(
                f"{key}: 'te' needs Transformer Engine and a CUDA device "
                f"({_te_missing(accelerator)}); set {names.set(key, 'auto')} or sdpa"
            )
        if not te.runs and sliding_window and cp > 1:
            raise ValueError(
                f"{key}: 'te' cannot run {what} + sliding-window attention ({te.why_not}); set "
                f"{names.set(key, 'sdpa')} (or auto), or context parallel size 1"
            )
        if not te.runs:
            raise ValueError(
                f"{key}: 'te' cannot run {what} ({te.why_not}); {_fix_for_te(names, precision, cp)}"
            )
        return AttentionChoice(
            "te", "as configured" if te.kernel_sure else f"as configured; {te.why_not}"
        )

    # auto: the same rule with and without context parallelism (both backends have it).
    if te is None:
        return AttentionChoice("sdpa", _te_missing(accelerator))
    if te.kernel_sure:
        return AttentionChoice(
            "te", f"Transformer Engine {accelerator.transformer_engine}: fused attention for {what}"
        )
    return AttentionChoice("sdpa", te.why_not)


def _fix_for_te(names: SettingNames, precision: str, cp: int) -> str:
    half = precision in _HALF
    if cp > 1:
        # Only a head dim outside the kernels' range (half) or fp32 lands here.
        sdpa = f"{names.set(names.backend, 'sdpa')} (or auto; its context parallelism runs any)"
        if half:
            return f"no TE kernel takes this head dim under context parallelism; set {sdpa}"
        return (
            f"set {sdpa}, or {names.set(names.precision, 'bf16')} (TE's fused attention has "
            "context parallelism)"
        )
    fixes = [f"{names.set(names.backend, 'sdpa')} (or auto)"]
    if not half:
        fixes.append(names.set(names.precision, "bf16"))
    if names.packing:
        fixes.append(names.set(names.packing, "false"))
    return "set " + (
        ", or ".join(fixes) if len(fixes) < 3 else f"{fixes[0]}, {fixes[1]}, or {fixes[2]}"
    )
