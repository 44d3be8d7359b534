"""Transformer Engine stand-ins, so megatron-core's TE layer spec builds and runs on CPU (no tests).

Transformer Engine cannot be imported here, but megatron-core's TE wrappers
(`extensions/transformer_engine.py`: `TELayerNormColumnParallelLinear`, `TERowParallelLinear`,
`TEColumnParallelLinear` over `TELinear`) can run: their classes are compiled from megatron-core's
source with `te.pytorch.{Linear, LayerNormLinear}` bound to the stand-ins below, so the wrappers'
own constructor arguments, CPU initialisation, `(output, bias)` convention and
`sharded_state_dict` are megatron-core's. The stand-ins follow TE 2.9's interfaces (the image's
TE, `Dockerfile`'s `NGC_TRANSFORMER_ENGINE`), read from TE's
`transformer_engine/pytorch/module/{linear,layernorm_linear}.py`:

* parameters `weight` ([out/tp, in] column, [out, in/tp] row), `bias`, and for `LayerNormLinear`
  `layer_norm_weight` (+ `layer_norm_bias` for LayerNorm); an `_extra_state` entry (an empty
  uint8 tensor without FP8);
* `forward(inp, is_first_microbatch=None)` returns `out`, `(out, bias)` with `return_bias`, and —
  `LayerNormLinear` with `return_layernorm_output` — `(out, ln_out)` / `(out, bias, ln_out)`,
  where `ln_out` is the norm's output in the input's dtype, this rank's sequence chunk under
  sequence parallelism (TE gathers it into a buffer of its own for the GEMM);
* the norm is computed in fp32 (`zero_centered_gamma`: weight + 1), column-parallel input is
  all-gathered along the sequence under SP (else its gradient all-reduced), row-parallel output
  all-reduced (reduce-scattered under SP).

`return_layernorm_output_gathered` is refused: TE 2.9's backward adds the gradient of a returned
norm output to the input gradient only when it is not the gathered one (`layernorm_linear.py`,
`if ctx.return_layernorm_output and not ctx.return_layernorm_output_gathered`), so a consumer of
the gathered output would lose its input gradient.

Core attention (`TEDotProductAttention`) is replaced by our `SDPAttention` (it has no parameters),
or — `te_spec_models(attention="te")` — is megatron-core's `TEDotProductAttention` compiled over
`te_attention_standin.DotProductAttention`, which checks TE's context-parallel contract. A
multi-latent attention model gets the product's own MLA layers for 'te'
(`layer_specs.decoder_block_spec`) with that compiled attention in them.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

REPO = Path(__file__).resolve().parents[1]
TE_EMPTY_EXTRA_STATE = torch.empty(0, dtype=torch.uint8)
#: megatron-core's TE wrappers compiled over the stand-ins, base classes first.
WRAPPERS = (
    "TELinear",
    "TELayerNormColumnParallelLinear",
    "TEColumnParallelLinear",
    "TERowParallelLinear",
    "TEDotProductAttention",
)


def image_te_version() -> str:
    """The Transformer Engine version the image ships (`Dockerfile`)."""
    text = (REPO / "Dockerfile").read_text()
    return re.search(r"^ARG NGC_TRANSFORMER_ENGINE=(\S+)$", text, re.M)[1]


def te_spec(te_version: str):
    """megatron-core's TE layer spec and its module of TE classes, built without TE."""
    from megatron.core import utils as mcore_utils
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
    from megatron.core.models.gpt import gpt_layer_specs
    from packaging.version import Version

    mcore_utils._te_version = Version(te_version)  # what get_te_version() reads with TE present
    # The names gpt_layer_specs imports inside its `try: import transformer_engine` block.
    gpt_layer_specs.TESpecProvider = TESpecProvider
    gpt_layer_specs.TENorm, gpt_layer_specs.TEFusedMLP = te_ext.TENorm, te_ext.TEFusedMLP
    return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(), te_ext


def real_method(te_ext, class_name: str, method: str = "sharded_state_dict"):
    """A method of one of megatron-core's TE classes, compiled from megatron-core's source in
    that module's namespace (the classes themselves subclass a stand-in without TE)."""
    path = Path(te_ext.__file__)
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == method)
    namespace = dict(vars(te_ext))
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), namespace)
    return namespace[method]


class _TEModule(torch.nn.Module):
    """What TE's modules share: TP facts, an `_extra_state` entry, the row/column collectives."""

    def _setup(self, parallel_mode, tp_size, sequence_parallel, return_bias, bias) -> None:
        # The megatron wrapper sets attributes (config, tp_size, ...) before calling us.
        torch.nn.Module.__init__(self)
        self.parallel_mode = parallel_mode
        self.tp_size = tp_size
        self.sequence_parallel = tp_size > 1 and sequence_parallel
        self.return_bias = return_bias
        self.use_bias = bias

    def _weight(self, in_features, out_features, params_dtype, device, init_method) -> None:
        self.in_features, self.out_features = in_features, out_features
        out_local = out_features // self.tp_size if self.parallel_mode == "column" else out_features
        in_local = in_features // self.tp_size if self.parallel_mode == "row" else in_features
        dtype = params_dtype or torch.float32
        self.weight = torch.nn.Parameter(
            torch.empty(out_local, in_local, dtype=dtype, device=device)
        )
        if init_method is not None:
            init_method(self.weight)
        if self.parallel_mode in ("column", "row"):
            axis = 0 if self.parallel_mode == "column" else 1
            set_tensor_model_parallel_attributes(self.weight, True, axis, 1)
        self.bias = None
        if self.use_bias:
            self.bias = torch.nn.Parameter(torch.zeros(out_local, dtype=dtype, device=device))

    def get_extra_state(self) -> torch.Tensor:
        return TE_EMPTY_EXTRA_STATE.clone()

    def set_extra_state(self, state: Any) -> None:
        pass

    def _gemm_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel_mode == "column" and self.sequence_parallel:
            return gather_from_sequence_parallel_region(x)
        if self.parallel_mode == "column" and self.tp_size > 1:
            return copy_to_tensor_model_parallel_region(x)
        return x

    def _gemm(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = F.linear(self._gemm_input(x), self.weight)
        if self.parallel_mode == "row" and self.tp_size > 1:
            out = (
                reduce_scatter_to_sequence_parallel_region(out)
                if self.sequence_parallel
                else reduce_from_tensor_model_parallel_region(out)
            )
        if self.bias is not None and not self.return_bias:
            out = out + self.bias
        return out, self.bias


class Linear(_TEModule):
    """TE's `te.pytorch.Linear`, as megatron-core's `TELinear` constructs and calls it."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        sequence_parallel: bool = False,
        tp_group=None,
        tp_size: int = 1,
        init_method=None,
        bias: bool = True,
        return_bias: bool = False,
        parallel_mode: str | None = None,
        params_dtype: torch.dtype | None = None,
        device: str | torch.device = "cuda",
        **options: Any,  # fusion / overlap / rng options: no effect on the math
    ) -> None:
        self._setup(parallel_mode, tp_size, sequence_parallel, return_bias, bias)
        self._weight(in_features, out_features, params_dtype, device, init_method)

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None):
        out, bias = self._gemm(inp)
        return (out, bias) if self.return_bias else out


class LayerNormLinear(_TEModule):
    """TE's `te.pytorch.LayerNormLinear`, as megatron-core's `TELayerNormColumnParallelLinear`
    constructs and calls it."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        *,
        sequence_parallel: bool = False,
        tp_group=None,
        tp_size: int = 1,
        init_method=None,
        bias: bool = True,
        normalization: str = "LayerNorm",
        return_bias: bool = False,
        params_dtype: torch.dtype | None = None,
        parallel_mode: str | None = None,
        return_layernorm_output: bool = False,
        return_layernorm_output_gathered: bool = False,
        zero_centered_gamma: bool = False,
        device: str | torch.device = "cuda",
        **options: Any,  # fusion / overlap / rng options: no effect on the math
    ) -> None:
        self._setup(parallel_mode, tp_size, sequence_parallel, return_bias, bias)
        self.eps, self.normalization = eps, normalization
        self.zero_centered_gamma = zero_centered_gamma
        self.return_layernorm_output = return_layernorm_output
        self.return_layernorm_output_gathered = (
            return_layernorm_output_gathered if return_layernorm_output else False
        )
        dtype = params_dtype or torch.float32
        start = 0.0 if zero_centered_gamma else 1.0
        self.layer_norm_weight = torch.nn.Parameter(
            torch.full((in_features,), start, dtype=dtype, device=device)
        )
        self.layer_norm_weight.sequence_parallel = self.sequence_parallel
        self.layer_norm_bias = None
        if normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(
                torch.zeros(in_features, dtype=dtype, device=device)
            )
            self.layer_norm_bias.sequence_parallel = self.sequence_parallel
        self._weight(in_features, out_features, params_dtype, device, init_method)
        #: The last returned norm output (a test's record; TE keeps none).
        self.last_layernorm_output: torch.Tensor | None = None

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        w = self.layer_norm_weight.float()
        w = w + 1 if self.zero_centered_gamma else w
        xf, shape = x.float(), x.shape[-1:]
        if self.normalization == "RMSNorm":
            y = F.rms_norm(xf, shape, w, self.eps)
        else:
            y = F.layer_norm(xf, shape, w, self.layer_norm_bias.float(), self.eps)
        return y.to(x.dtype)

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None):
        if self.return_layernorm_output and self.return_layernorm_output_gathered:
            raise NotImplementedError(
                "TE 2.9 drops the gradient of a gathered layer-norm output (see te_standin)"
            )
        ln_out = self._norm(inp)
        out, bias = self._gemm(ln_out)
        result = (out, bias) if self.return_bias else (out,)
        if self.return_layernorm_output:
            self.last_layernorm_output = ln_out
            return (*result, ln_out)
        return result[0] if len(result) == 1 else result


def te_wrappers() -> dict[str, type]:
    """megatron-core's TE wrapper classes (`WRAPPERS`), compiled from its source over the
    stand-ins: name -> class."""
    from megatron.core.extensions import transformer_engine as te_ext
    from te_attention_standin import CPStream, DotProductAttention

    te_spec(image_te_version())  # sets the TE version the wrappers' version checks read
    path = Path(te_ext.__file__)
    tree = ast.parse(path.read_text())
    namespace = dict(vars(te_ext))
    namespace["HAVE_TE"] = True
    namespace["te"] = SimpleNamespace(
        pytorch=SimpleNamespace(
            Linear=Linear, LayerNormLinear=LayerNormLinear, DotProductAttention=DotProductAttention
        )
    )
    for name in WRAPPERS:
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
        exec(compile(ast.Module(body=[cls], type_ignores=[]), str(path), "exec"), namespace)
    # The wrapper creates its class-wide CP stream with `torch.cuda.Stream()` when it has none.
    namespace["TEDotProductAttention"].cp_stream = CPStream()
    return {name: namespace[name] for name in WRAPPERS}


def te_layer_spec(attention: str = "sdpa"):
    """megatron-core's TE layer spec with its TE classes replaced by the compiled wrappers; core
    attention: `SDPAttention` ('sdpa') or the compiled `TEDotProductAttention` ('te'). Any other
    TE class in it is an error."""
    from megatron_kto.models.attention import SDPAttention

    spec, te_ext = te_spec(image_te_version())
    wrappers = te_wrappers()
    swap = {getattr(te_ext, name): cls for name, cls in wrappers.items()}
    if attention == "sdpa":
        swap[te_ext.TEDotProductAttention] = SDPAttention
    elif attention != "te":
        raise ValueError(f"attention must be 'sdpa' or 'te', got {attention!r}")

    def sub(module):
        if module in swap:
            return swap[module]
        assert isinstance(module, type), f"a TE class without a stand-in: {module}"
        return module

    layer = spec.submodules
    attn, mlp = layer.self_attention, layer.mlp
    attn_sub = {f.name: sub(getattr(attn.submodules, f.name))
                for f in dataclasses.fields(attn.submodules)}  # fmt: skip
    mlp_sub = {k: sub(getattr(mlp.submodules, k)) for k in ("linear_fc1", "linear_fc2")}
    layer = dataclasses.replace(
        layer,
        self_attention=dataclasses.replace(
            attn, submodules=dataclasses.replace(attn.submodules, **attn_sub)
        ),
        mlp=dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules, **mlp_sub)),
    )
    return dataclasses.replace(spec, submodules=layer)


def _standin_attention(block):
    """A block spec whose layers' TE core attention is the compiled `TEDotProductAttention`."""
    from megatron.core.extensions import transformer_engine as te_ext

    compiled = te_wrappers()["TEDotProductAttention"]

    def swap(layer):
        attn = layer.submodules.self_attention
        assert attn.submodules.core_attention is te_ext.TEDotProductAttention, attn.submodules
        attn = dataclasses.replace(
            attn, submodules=dataclasses.replace(attn.submodules, core_attention=compiled)
        )
        sub = dataclasses.replace(layer.submodules, self_attention=attn)
        return dataclasses.replace(layer, submodules=sub)

    return dataclasses.replace(block, layer_specs=[swap(spec) for spec in block.layer_specs])


@contextlib.contextmanager
def te_spec_models(attention: str = "sdpa") -> Iterator[None]:
    """Inside the scope, `models.builder.build_gpt_chunks` builds the stand-in TE spec (this
    process), with `attention` as core attention (`te_layer_spec`)."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    from megatron_kto.models import builder
    from megatron_kto.models.layer_specs import (
        decoder_block_spec,
        te_gemma_layer,
        te_layer_with_local_experts,
    )
    from megatron_kto.models.norms import LocalNorm

    layer = te_layer_spec(attention)

    def block_spec(config, normalization, backend, vp_stage, extras=None):
        if getattr(config, "multi_latent_attention", False):  # the product's MLA layer on TE
            return _standin_attention(decoder_block_spec(config, normalization, "te", vp_stage))
        # Gemma's layer extras (post-norms, per-layer RoPE): the product's own TE variant.
        spec = te_gemma_layer(layer, extras, config.qk_layernorm) if extras else layer
        if config.num_moe_experts:  # the product's TE layer for biased experts (GPT-OSS)
            assert config.add_bias_linear, "TE stand-in: TE's grouped experts are not modelled"
            spec = te_layer_with_local_experts(spec, config, normalization)
        # The final norm: megatron would pick TENorm with TE; ours has the same parameters.
        count = get_num_layers_to_build(config, vp_stage=vp_stage)
        return TransformerBlockSubmodules(layer_specs=[spec] * count, layer_norm=LocalNorm)

    original = builder.decoder_block_spec
    builder.decoder_block_spec = block_spec
    try:
        yield
    finally:
        builder.decoder_block_spec = original
