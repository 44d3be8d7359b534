"""Which attention backend a run uses, decided once, before any model is built.

`choose_attention_backend` is a pure function of the request (`model.attention_backend`), the
precision, packing, the machine (`gpu_settings.Accelerator`: CUDA, Transformer Engine version),
the context-parallel size, sequence parallelism and the model's attention
(`attention_features.AttentionFeatures`: head dimension, sliding windows, attention sinks,
multi-latent attention, gated DeltaNet layers), so tests can state any machine. `auto` never
returns a backend that cannot run the configuration; an explicit choice that cannot run is a
`ValueError` whose one-line message names the key and what to set.

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

Sliding-window attention (`model.sliding_window`, megatron-core's `window_size` (W − 1, 0) and
per-layer `window_attn_skip_freq`, which megatron-core's `TEDotProductAttention` turns into each
windowed layer's TE `window_size`): `sdpa` runs it everywhere (band masks, packed rows and context
parallelism included). TE (2.9–2.12, `get_attention_backend`'s sliding-window filter) runs
(left, 0) windows in flash-attn 2.3+, in cuDNN's fused attention only without attention dropout
(cuDNN 9.2+ for `sbhd`, 9.6+ for packed `thd`: `nvte_get_fused_attn_backend`; the image's cuDNN
is newer), and in its unfused attention as a mask; so with `model.attention_dropout` > 0 and no
flash-attn only the unfused path is left (not chosen by `auto`). Shown on CPU through
megatron-core's real `TEDotProductAttention` over a TE stand-in (`tests/test_te_sliding_window.py`),
not yet on a GPU. TE's context parallelism takes a window only with `cp_comm_type` "a2a" or
"all_gather" (an assertion in `attn_forward_func_with_cp`), we use "p2p": windows + CP is
`sdpa` under `auto` and an error for an explicit `te`. megatron's `local` attention builds its
window mask on CUDA only and ignores a padding mask with it: refused.

Gemma 3 (post-norms, a RoPE base per layer kind, (1 + w) norms, `query_pre_attn_scalar`) runs on
TE through `layer_specs.te_gemma_layer` (TE's fused norm + linear and attention, our post-norms
and local RoPE), so only TE's attention rules apply: with head dim 256 `auto` keeps `sdpa` (a
kernel for 256 is not sure on every GPU, see below), an explicit `te` runs.

Attention sinks (`model.attention_sinks`, GPT-OSS: megatron-core's `softmax_type="learnable"`,
one logit αₕ per head: exp(sᵢⱼ) / (exp(αₕ) + Σⱼ exp(sᵢⱼ)), αₕ unscaled): `sdpa` computes them (an
extra key column, `models/attention.py`), checked against `transformers`. TE has the same
softmax from 2.8 (`DotProductAttention(softmax_type="learnable")`, which megatron-core 0.16.1's
`TEDotProductAttention` passes from the config and asserts TE >= 2.8 for): a [heads / TP]
parameter `softmax_offset` TE registers itself, which megatron-core checkpoints sharded by heads
over TP (`{'softmax_offset': 0}`) under `self_attention.core_attention.softmax_offset` — the key
and layout of our `SDPAttention` and of the GPT-OSS conversion's `self_attn.sinks`, so checkpoints
and HF weights move across backends. Where TE runs it (`get_attention_backend`'s softmax filter
and `nvte_get_fused_attn_backend`, read at v2.8–v2.12):

| input         | flash-attn | fused (cuDNN)                      | unfused          |
|---------------|------------|------------------------------------|------------------|
| sbhd (padded) | never      | cuDNN >= 9.13.1, not FP8 attention | yes (any dtype)  |
| thd (packed)  | never      | 2.12+ with cuDNN >= 9.18           | 2.12+ (not 2.11) |
| under CP      | never      | only cp_comm_type "a2a" (we: p2p)  | never            |

So an explicit `te` with sinks runs padded micro-batches from 2.8 and packed ones from 2.12;
`auto` takes TE where the fused kernel surely exists (the rule below, plus cuDNN >= 9.13.1 as
torch reports it, and for packed input 2.12 + cuDNN 9.18), else `sdpa` with the reason at
start-up. Sinks under context parallelism are refused on every backend (`sdpa` has none). The TE
path is shown on CPU through megatron-core's real `TEDotProductAttention` over a stand-in that
computes TE's unfused learnable softmax (`tests/test_te_families.py`), not yet on a GPU. GPT-OSS's
biased experts stay the local spec's inside the TE layer (`layer_specs.te_layer_with_local_experts`).

Multi-latent attention (DeepSeek-V3: qk head dim nope + rope, value head dim `v_head_dim`, a
YaRN softmax scale) runs on TE's `DotProductAttention` (`models/mla.py`) from TE 1.10, under
context parallelism from 2.5; flash-attn 2 never takes it, cuDNN's fused attention per its own
head-dim rules, the unfused path any dims (`te_latent_attention` has the table and the sources).
`auto` takes TE where a fused kernel surely exists (both dims <= 128, or 192 / 128 on Hopper with
cuDNN >= 9.5 / Blackwell with 9.11 once the builder knows the GPU), else `sdpa` with the reason;
megatron's `local` attention has no value head dim of its own: refused.

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

from dataclasses import dataclass, replace

from packaging.version import InvalidVersion, Version

from megatron_kto.runtime.attention_features import AttentionFeatures
from megatron_kto.runtime.gpu_settings import Accelerator
from megatron_kto.runtime.te_latent_attention import latent_head_dims, latent_refusal

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionChoice",
    "AttentionFeatures",
    "CONFIG_NAMES",
    "SettingNames",
    "choose_attention_backend",
    "deltanet_kernels",
]

#: `model.attention_backend` values.
ATTENTION_BACKENDS = ("auto", "te", "sdpa", "local")
#: First TE release whose unfused attention takes THD (packed) input.
TE_UNFUSED_THD_SINCE = Version("2.11.0")
#: First TE release with learnable softmax (attention sinks; megatron-core asserts it too) ...
TE_SINKS_SINCE = Version("2.8.0")
#: ... and with any backend for it on packed (THD) input (2.11's unfused THD refuses sinks).
TE_SINKS_THD_SINCE = Version("2.12.0")
#: cuDNN (torch's `backends.cudnn.version()` number) whose fused attention takes learnable
#: softmax (`nvte_get_fused_attn_backend`: 9.13.1) ...
CUDNN_SINKS_SINCE = 91301
#: ... and with packed (THD) input (TE 2.12's `get_attention_backend`: 9.18).
CUDNN_SINKS_THD_SINCE = 91800
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
    deltanet: str | None = None
    """Kernels of the gated DeltaNet layers: 'fla' or 'torch' (`deltanet_kernels`); None for a
    model without them."""
    deltanet_reason: str = ""

    def describe(self) -> str:
        """'sdpa (<reason>)', and '; gated DeltaNet: fla (<reason>)' for a hybrid model."""
        out = f"{self.backend} ({self.reason})"
        if self.deltanet:
            out += f"; gated DeltaNet: {self.deltanet} ({self.deltanet_reason})"
        return out

    def note(self, request: str) -> str:
        """'model.attention_backend=auto: sdpa (<reason>)' — one start-up line."""
        return f"{_KEY}={request}: {self.describe()}"


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
    fixable: bool = True
    """Another precision or packing could make it run."""


def _te_capability(
    accelerator: Accelerator, precision: str, packed: bool, cp: int, features: AttentionFeatures
) -> _TECapability:
    """What TE (usable on this machine) can do for the configuration; see the module tables
    (a sliding window with attention dropout only flash-attn fuses; learnable softmax, for
    sinks, never is in flash-attn)."""
    head_dim, sinks = features.head_dim, features.attention_sinks
    version = _te_version(accelerator)
    named = f"Transformer Engine {accelerator.transformer_engine}"
    if sinks and (version is None or version < TE_SINKS_SINCE):
        why = f"attention sinks (softmax_type 'learnable') need Transformer Engine >= {TE_SINKS_SINCE}"
        return _TECapability(False, False, f"{named}: {why}", fixable=False)
    latent = features.latent_attention
    refusal = latent_refusal(version, cp) if latent else None
    if refusal:
        return _TECapability(False, False, f"{named}: {refusal}", fixable=False)
    half = precision in _HALF
    if latent:  # te_latent_attention: the value head dim counts too; no flash-attn 2
        dims_possible, dims_sure, dims_why = latent_head_dims(accelerator, features)
    else:
        dims_possible = head_dim % KERNEL_HEAD_DIM_MULTIPLE == 0 and head_dim <= KERNEL_HEAD_DIM_MAX
        dims_sure, dims_why = head_dim <= KERNEL_HEAD_DIM_EVERY_GPU, ""
    capability = accelerator.compute_capability
    flash = accelerator.flash_attn and not sinks and not latent
    # Packed input: cuDNN's THD kernels need sm90+, flash-attn takes it on sm80+. An unread GPU
    # (start-up check, before CUDA is initialised) is assumed able; the builder checks again.
    packed_kernel = not packed or flash or capability is None or capability >= HOPPER
    window_kernel = not features.window_dropout or flash
    sink_kernel, no_sink_kernel = (
        _sink_kernel(accelerator, version, packed) if sinks else (True, "")
    )
    kernel_possible = half and dims_possible and packed_kernel and window_kernel and sink_kernel
    kernel_sure = kernel_possible and dims_sure
    thd_since = TE_SINKS_THD_SINCE if sinks else TE_UNFUSED_THD_SINCE
    unfused_thd = version is not None and version >= thd_since
    unfused_runs = cp == 1 and (not packed or unfused_thd)
    if not half:
        no_kernel = "its flash and fused attention need bf16 or fp16"
    elif not packed_kernel:
        no_kernel = (
            f"its fused attention takes packed (THD) input only on Hopper (sm90) or newer, this "
            f"GPU is sm{capability[0]}{capability[1]}, and flash-attn is not installed"
        )
    elif not sink_kernel:
        no_kernel = no_sink_kernel
    elif not window_kernel:
        no_kernel = (
            "its fused attention takes a sliding window only without attention dropout "
            "(model.attention_dropout), and flash-attn is not installed"
        )
    elif dims_why:
        no_kernel = dims_why
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
        why_unfused = f"its unfused attention takes packed (THD) input only from {thd_since}"
        if sinks:
            why_unfused += " with attention sinks"
    why_not = no_kernel if kernel_possible or unfused_runs else f"{no_kernel}, {why_unfused}"
    return _TECapability(kernel_sure, kernel_possible or unfused_runs, f"{named}: {why_not}")


def _sink_kernel(
    accelerator: Accelerator, version: Version | None, packed: bool
) -> tuple[bool, str]:
    """Whether cuDNN's fused attention takes learnable softmax here, and if not why."""
    cudnn = accelerator.cudnn
    if cudnn is None or cudnn < CUDNN_SINKS_SINCE:
        return False, (
            f"its fused attention takes attention sinks only with cuDNN >= 9.13.1 (cuDNN "
            f"{_cudnn_text(cudnn)}), flash-attn never"
        )
    if packed and (
        version is None or version < TE_SINKS_THD_SINCE or cudnn < CUDNN_SINKS_THD_SINCE
    ):
        return False, (
            f"its fused attention takes attention sinks with packed (THD) input only from "
            f"{TE_SINKS_THD_SINCE} with cuDNN >= 9.18 (cuDNN {_cudnn_text(cudnn)})"
        )
    return True, ""


def _cudnn_text(cudnn: int | None) -> str:
    """91301 -> '9.13.1' (torch's cuDNN 9 numbering: major·10000 + minor·100 + patch)."""
    if cudnn is None:
        return "unknown"
    return f"{cudnn // 10000}.{cudnn // 100 % 100}.{cudnn % 100}"


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


def deltanet_kernels(accelerator: Accelerator) -> tuple[str, str]:
    """(kernels, reason) of gated DeltaNet layers: `fla`'s (flash-linear-attention: Triton
    chunked delta rule and causal convolution, variable-length through `cu_seqlens`) on an
    accelerator where it is installed (`pip install .[fla]`), else ours in PyTorch
    (`models.delta_rule`), which run everywhere."""
    if accelerator.cuda and accelerator.fla:
        return "fla", "flash-linear-attention's Triton kernels, packed rows by cu_seqlens"
    missing = "no accelerator" if not accelerator.cuda else "fla is not installed"
    return "torch", f"our PyTorch delta rule and convolution; {missing}"


def choose_attention_backend(
    request: str,
    *,
    precision: str,
    packed: bool,
    accelerator: Accelerator,
    features: AttentionFeatures,
    context_parallel_size: int = 1,
    sequence_parallel: bool = False,
    names: SettingNames = CONFIG_NAMES,
) -> AttentionChoice:
    """The attention backend for a configuration on a machine.

    Args:
        request: `model.attention_backend`: 'auto', 'te', 'sdpa' or 'local'.
        precision: canonical `trainer.precision`: '32', 'bf16' or '16'.
        packed: micro-batches are packed (`model.data.pack_sequences`; THD for TE).
        accelerator: the machine (`Accelerator.detect()`, or stated by a test).
        features: the model's attention (`AttentionFeatures.of(arch)`).
        context_parallel_size: CP degree (`model.context_parallel_size`).
        sequence_parallel: megatron sequence parallelism; no backend restricts it (the module
            docstring says why), taken so that callers state the whole layout.
        names: how messages spell the settings (config keys by default).

    Returns:
        The backend and a one-clause reason; with gated DeltaNet layers also their kernels
        (`deltanet_kernels`), so one start-up note says both.

    Raises:
        ValueError: one line starting with the setting's name: an unknown backend, an explicit
            choice that cannot run here, or a configuration no backend can run; it says what to
            set instead.
    """
    del sequence_parallel  # restricts no backend (module docstring)
    choice = _choose(
        request, precision, packed, accelerator, features, context_parallel_size, names
    )
    if not features.linear_attention:
        return choice
    kernels, why = deltanet_kernels(accelerator)
    return replace(choice, deltanet=kernels, deltanet_reason=why)


def _choose(
    request: str,
    precision: str,
    packed: bool,
    accelerator: Accelerator,
    features: AttentionFeatures,
    cp: int,
    names: SettingNames,
) -> AttentionChoice:
    """`choose_attention_backend` without the gated DeltaNet kernels."""
    key = names.backend
    if request not in ATTENTION_BACKENDS:
        raise ValueError(f"{key}: must be one of {list(ATTENTION_BACKENDS)}, got {request!r}")
    sliding_window, attention_sinks = features.sliding_window, features.attention_sinks
    what = _describe(precision, packed, cp)
    te_usable = accelerator.has_transformer_engine
    te = _te_capability(accelerator, precision, packed, cp, features) if te_usable else None

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
    if features.latent_attention and request == "local":
        raise ValueError(
            f"{key}: 'local' cannot run multi-latent attention (megatron's unfused attention has "
            f"no value head dim of its own); set {names.set(key, 'sdpa')} (or auto)"
        )
    if attention_sinks and cp > 1:
        raise ValueError(
            f"model.context_parallel_size: attention sinks (model.attention_sinks, GPT-OSS) have "
            f"no context-parallel attention here (context parallel size {cp}); set "
            "model.context_parallel_size=1"
        )
    if attention_sinks and request == "local":
        raise ValueError(
            f"{key}: 'local' (megatron's unfused attention) is not used for attention sinks "
            f"(model.attention_sinks, GPT-OSS); set {names.set(key, 'sdpa')} (or auto)"
        )
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
        if not te.runs and not te.fixable:
            raise ValueError(
                f"{key}: 'te' cannot run this model ({te.why_not}); set "
                f"{names.set(key, 'sdpa')} (or auto)"
            )
        if not te.runs:
            raise ValueError(
                f"{key}: 'te' cannot run {what} ({te.why_not}); "
                f"{_fix_for_te(names, precision, cp, attention_sinks and packed)}"
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


def _fix_for_te(names: SettingNames, precision: str, cp: int, packed_sinks: bool = False) -> str:
    """What to set instead (`packed_sinks`: no precision makes TE take packed sinks)."""
    half = precision in _HALF or packed_sinks
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
