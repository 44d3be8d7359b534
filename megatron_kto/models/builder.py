"""Build megatron-core `GPTModel` chunks for this rank from a `GPTArchitecture`.

Handles the pipeline split (pre/post-process per stage, virtual pipeline chunks), the layer spec
(`model.attention_backend` as `runtime.attention_backend` decides it, see `layer_specs.py`),
the Llama-family options (RMSNorm, SwiGLU, RoPE with optional Llama-3 scaling, GQA, QKV bias,
Q/K norms) and mixture-of-experts layers (`layer_options.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.activations import quick_gelu
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.models.gemma_layers import LayerExtras
from megatron_kto.models.hybrid import (
    hybrid_block_spec,
    hybrid_transformer_config,
    uses_hybrid_spec,
)
from megatron_kto.models.layer_options import moe_transformer_config
from megatron_kto.models.layer_specs import decoder_block_spec
from megatron_kto.models.mla import mla_transformer_config
from megatron_kto.runtime.attention_backend import (
    AttentionChoice,
    AttentionFeatures,
    choose_attention_backend,
)
from megatron_kto.runtime.gpu_settings import Accelerator, fusion_settings
from megatron_kto.runtime.precision import precision_dtype

logger = logging.getLogger(__name__)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GeLU with the tanh approximation (`transformers`' gelu_pytorch_tanh; Gemma's GeGLU gate)."""
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS = {
    "swiglu": F.silu,
    "geglu": gelu_tanh,
    "quick_geglu": quick_gelu,
    "gelu": F.gelu,
    "relu": F.relu,
}


@dataclass
class YarnTransformerConfig(TransformerConfig):
    """`TransformerConfig` with the YaRN fields megatron-core 0.16 reads by `getattr` (its
    `GPTModel` and attention take them from MLA's config class otherwise)."""

    yarn_rotary_scaling_factor: float = 1.0
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float | None = None
    yarn_mscale_all_dim: float | None = None
    yarn_correction_range_round_to_int: bool = False


def _yarn_fields(arch: GPTArchitecture) -> dict:
    """YaRN's config fields as `transformers` computes them (`truncate: false`: the correction
    range is not rounded; attention factor 0.1·ln(factor) + 1, megatron's default mscale)."""
    if arch.position_embedding_type != "yarn":
        return {}
    return dict(
        yarn_rotary_scaling_factor=arch.rope_scaling_factor,
        yarn_original_max_position_embeddings=arch.yarn_original_max_position_embeddings
        or arch.encoder_seq_length,
        yarn_beta_fast=arch.yarn_beta_fast,
        yarn_beta_slow=arch.yarn_beta_slow,
    )


@dataclass
class ParallelLayout:
    """How the model is split across ranks, and how it computes."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    """Ranks every row is split over along the sequence (`models.context_parallel`); weights are
    not sharded by it."""
    expert_model_parallel_size: int = 1
    """Ranks the routed experts of each MoE layer are spread over (within DP x CP)."""
    expert_tensor_parallel_size: int | None = None
    """Ranks each routed expert's linears are split over; None = tensor_model_parallel_size."""
    virtual_pipeline_model_parallel_size: int | None = None
    num_layers_in_first_pipeline_stage: int | None = None
    """Layers of the first (last) pipeline stage; None = megatron-core's even split. The model's
    layers and their global `layer_number`s follow megatron-core's own offsets either way."""
    num_layers_in_last_pipeline_stage: int | None = None
    sequence_parallel: bool = False
    precision: str = "32"
    """'32' (fp32 params and compute), 'bf16' or '16' (half-precision params and compute, fp32
    main weights in the optimizer; '16' with dynamic loss scaling)."""
    activations_checkpoint_granularity: str | None = None
    """None, 'full' (whole layers) or 'selective' (core attention only)."""
    activations_checkpoint_method: str | None = None
    """'full' only: 'uniform' (recompute blocks of num_layers layers) or 'block' (the first
    num_layers layers of each model chunk); None means 'uniform'."""
    activations_checkpoint_num_layers: int | None = None
    """'full' only: layers per recompute block ('uniform') or recomputed layers per model chunk
    ('block'); None means 1."""
    attention_backend: str = "auto"
    """'auto', 'te', 'sdpa' or 'local' (see `layer_specs.py`)."""
    moe_router_bias_update_rate: float = 0.0
    """Per-step update rate of the sigmoid routers' expert bias (megatron-core's aux-loss-free
    balancing, in `finalize_model_grads`); 0 keeps the bias as restored."""
    pack_sequences: bool = False
    """The model will be fed packed (THD) micro-batches (`model.data.pack_sequences`): the
    attention backend must take them ('local' cannot; TE < 2.11 cannot in fp32). Callers that
    pack say so; `auto` decides the same either way."""


def make_transformer_config(arch: GPTArchitecture, layout: ParallelLayout) -> TransformerConfig:
    """Translate architecture + layout into megatron-core's `TransformerConfig`.

    Args:
        arch: model shape.
        layout: parallel layout and precision.

    Returns:
        The config every chunk of this model is built with.
    """
    if arch.activation not in _ACTIVATIONS:
        raise ValueError(
            f"model.activation must be one of {sorted(_ACTIVATIONS)}, got {arch.activation!r}"
        )
    dtype = precision_dtype(layout.precision)
    bf16, fp16 = layout.precision == "bf16", layout.precision == "16"
    on_gpu = torch.cuda.is_available()
    recompute = layout.activations_checkpoint_granularity
    mla = mla_transformer_config(arch)  # MLA states its RoPE / YaRN in its own fields
    yarn = {} if mla else _yarn_fields(arch)
    config_class = (
        MLATransformerConfig if mla else YarnTransformerConfig if yarn else TransformerConfig
    )
    return config_class(
        **yarn,
        **mla,
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.kv_channels,
        hidden_dropout=arch.hidden_dropout,
        attention_dropout=arch.attention_dropout,
        layernorm_epsilon=arch.layernorm_epsilon,
        normalization=arch.normalization,
        add_bias_linear=arch.add_bias_linear,
        add_qkv_bias=arch.add_qkv_bias,
        qk_layernorm=arch.qk_layernorm,
        # Sliding windows as megatron-core states them (TE and our SDPA read the same two
        # fields): (left, right) keys around each query, and a 1/0 per layer (1 = windowed).
        window_size=(arch.sliding_window - 1, 0) if arch.sliding_window else None,
        window_attn_skip_freq=(
            list(arch.window_layers) if arch.sliding_window and arch.window_layers else None
        ),
        gated_linear_unit=arch.gated_mlp,
        layernorm_zero_centered_gamma=arch.zero_centered_norms,
        softmax_scale=arch.softmax_scale,
        activation_func=_ACTIVATIONS[arch.activation],
        glu_linear_offset=arch.glu_linear_offset,
        activation_func_clamp_value=arch.activation_clamp,
        softmax_type="learnable" if arch.attention_sinks else "vanilla",
        init_method_std=arch.init_method_std,
        tensor_model_parallel_size=layout.tensor_model_parallel_size,
        pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage=layout.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=layout.num_layers_in_last_pipeline_stage,
        sequence_parallel=layout.sequence_parallel,
        context_parallel_size=layout.context_parallel_size,
        # Transformer Engine's context parallelism takes packed (THD) input only with "p2p"
        # (v2.9-v2.12: "all_gather" and "a2a" refuse THD); our SDPA attention always gathers.
        cp_comm_type="p2p" if layout.context_parallel_size > 1 else None,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=bf16,
        fp16=fp16,
        # CPU init builds the full master weight and slices it, so TP=1 and TP=2 start identical.
        use_cpu_initialization=not on_gpu,
        # Fused kernels where this machine has them (runtime.gpu_settings); all off on CPU.
        **fusion_settings(Accelerator.detect(), arch),
        recompute_granularity=recompute,
        # megatron-core requires method and count for 'full' and no count for 'selective'.
        recompute_method=(layout.activations_checkpoint_method or "uniform")
        if recompute == "full"
        else None,
        recompute_num_layers=(layout.activations_checkpoint_num_layers or 1)
        if recompute == "full"
        else None,
        # Megatron frees pipeline outputs after sending them; needs CUDA-style storage handling.
        deallocate_pipeline_outputs=on_gpu,
        # The interleaved schedule's steady state exchanges an activation (send_next) and a
        # gradient (send_prev) of the same shape with the same peer when PP=2 (prev == next).
        # megatron's batched path posts them as [send_prev, recv_prev, send_next, recv_next] on
        # both ranks, so the sender's order (grad, act) is not the receiver's (act, grad), and a
        # FIFO-matching backend silently swaps them: measured on gloo, PP2xVPP2 training gave
        # wrong losses from the 3rd micro-batch on (grad norm 420 vs 99). megatron's unbatched
        # path orders ops by even/odd rank and uses separate groups for the two directions, as
        # Megatron-LM does for interleaving (overlap_p2p_comm). Non-interleaved 1F1B sends at
        # most one message per direction, so it keeps the batched path.
        batch_p2p_comm=layout.virtual_pipeline_model_parallel_size is None,
        # No CUDA graphs; megatron's default scope "full" only triggers a deprecation warning.
        cuda_graph_scope=[],
        **moe_transformer_config(
            arch,
            layout.expert_model_parallel_size,
            layout.expert_tensor_parallel_size,
            layout.moe_router_bias_update_rate,
        ),
        # Gated DeltaNet / gated attention / offset norms (Qwen3-Next, Qwen3.5): models/hybrid.py
        **hybrid_transformer_config(arch, layout.context_parallel_size),
    )


def attention_choice(arch: GPTArchitecture, layout: ParallelLayout) -> AttentionChoice:
    """The attention backend this model is built with on this machine (and why).

    The same decision as the start-up check, now with the GPU generation known (the device is
    set by the time models are built); where that changes an `auto` choice, a warning says so.

    Raises:
        ValueError: the layout's explicit backend cannot run here (one line naming the key).
    """

    features = AttentionFeatures.of(arch)

    def choose(accelerator: Accelerator) -> AttentionChoice:
        return choose_attention_backend(
            layout.attention_backend,
            precision=layout.precision,
            packed=layout.pack_sequences,
            accelerator=accelerator,
            features=features,
            sequence_parallel=layout.sequence_parallel,
            context_parallel_size=layout.context_parallel_size,
        )

    accelerator = Accelerator.detect(read_device=True)
    choice = choose(accelerator)
    if accelerator.compute_capability is not None:
        assumed = choose(dataclasses.replace(accelerator, compute_capability=None))
        if assumed.backend != choice.backend:
            logger.warning("%s", choice.note(layout.attention_backend))
    return choice


def build_gpt_chunks(
    arch: GPTArchitecture, layout: ParallelLayout, device: torch.device
) -> list[torch.nn.Module]:
    """Build this rank's model chunks (one per virtual pipeline stage).

    Args:
        arch: model shape (its vocab_size must be set).
        layout: parallel layout; must match the initialised megatron parallel state.
        device: where parameters live.

    Returns:
        A list of `GPTModel` chunks (wrapped in `Float16Module` for bf16/fp16), each with
        `pre_process`/`post_process` set for its pipeline position.
    """
    config = make_transformer_config(arch, layout)
    choice = attention_choice(arch, layout)
    backend = choice.backend
    vocab = arch.padded_vocab(layout.tensor_model_parallel_size)
    extras = LayerExtras.of(arch)
    vpp = layout.virtual_pipeline_model_parallel_size
    chunks: list[torch.nn.Module] = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        with _quiet_about_our_mlp():
            model = GPTModel(
                config=config,
                transformer_layer_spec=hybrid_block_spec(
                    config, backend, vp_stage=stage, deltanet=choice.deltanet or "torch"
                )
                if uses_hybrid_spec(arch)
                else decoder_block_spec(
                    config, arch.normalization, backend, vp_stage=stage, extras=extras
                ),
                vocab_size=vocab,
                max_sequence_length=arch.encoder_seq_length,
                pre_process=parallel_state.is_pipeline_first_stage(
                    ignore_virtual=False, vp_stage=stage
                ),
                post_process=parallel_state.is_pipeline_last_stage(
                    ignore_virtual=False, vp_stage=stage
                ),
                parallel_output=True,
                share_embeddings_and_output_weights=arch.share_embeddings_and_output_weights,
                # MLA applies its own (decoupled) RoPE; megatron's GPTModel then builds none.
                position_embedding_type="rope"
                if arch.multi_latent_attention
                else arch.position_embedding_type,
                rotary_percent=arch.rotary_percent,
                rotary_base=arch.rotary_base,
                rope_scaling=arch.rope_scaling,
                rope_scaling_factor=arch.rope_scaling_factor,
                seq_len_interpolation_factor=arch.rotary_interpolation_factor,
                vp_stage=stage,
            )
        if arch.embedding_multiplier is not None and model.pre_process:
            model.embedding.register_forward_hook(_scale_output(arch.embedding_multiplier))
        model.to(device)
        if arch.attention_sinks:
            _init_te_sinks(model, config)
        if config.bf16 or config.fp16:
            model = Float16Module(config, model)
            _keep_fp32_expert_bias(model)
        chunks.append(model)
    return chunks


def _init_te_sinks(model: torch.nn.Module, config: TransformerConfig) -> None:
    """Initialise Transformer Engine's sink logits as our SDPA attention does (`init_method`).

    TE's `DotProductAttention` registers `softmax_offset` as `torch.empty` and never fills it
    (TE 2.8-2.12, `dot_product_attention.py`), nor does megatron-core 0.16.1's
    `TEDotProductAttention`; a checkpoint or HF load overwrites it, but no model is built with
    uninitialised memory in it."""
    if not config.perform_initialization:
        return
    for module in model.modules():
        if type(module).__name__ == "TEDotProductAttention" and module.softmax_offset is not None:
            with torch.no_grad():
                config.init_method(module.softmax_offset)


class _OurMLPFilter(logging.Filter):
    """Drops megatron's "Unknown MLP type" warning: `TransformerLayer` says it (once per layer)
    for any MLP class other than its own, here `gemma_layers.PostNormMLP`, whose default
    construction (megatron's TP group) is the one we want."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Unknown MLP type" not in record.getMessage()


@contextlib.contextmanager
def _quiet_about_our_mlp():
    layer_logger = logging.getLogger("megatron.core.transformer.transformer_layer")
    quiet = _OurMLPFilter()
    layer_logger.addFilter(quiet)
    try:
        yield
    finally:
        layer_logger.removeFilter(quiet)


def _scale_output(multiplier: float):
    """A forward hook multiplying a module's output by `multiplier` rounded to the output's dtype
    (as `transformers`' Gemma scales its embeddings: the factor cast to the weights' dtype)."""

    def hook(module: torch.nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        return output * torch.tensor(multiplier, dtype=output.dtype, device=output.device)

    return hook


#: The persistent buffers that are model weights: a sigmoid router's expert bias (megatron-core's
#: `TopKRouter.expert_bias`, HF's `e_score_correction_bias`). Checkpoints hold them (megatron's
#: state dict) and so do the Hugging Face loader and writer, which read weights off this.
WEIGHT_BUFFERS = ("router.expert_bias",)


def named_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A (unwrapped) model's parameters and weight buffers (`WEIGHT_BUFFERS`), by local name,
    in `named_parameters()` order with the buffers after them."""
    out: dict[str, torch.Tensor] = dict(model.named_parameters())
    for name, buffer in model.named_buffers():
        if name.endswith(WEIGHT_BUFFERS):
            out[name] = buffer
    return out


def _keep_fp32_expert_bias(model: torch.nn.Module) -> None:
    """Undo `Float16Module`'s cast of the routers' expert bias to half precision at once.

    megatron-core casts it back to fp32 only at a router's first forward (and before its own
    state-dict loads); the Hugging Face loader fills the buffer before that, so a bf16 buffer
    would round `e_score_correction_bias` (measured: 2.3e-4 off in a bf16 run's `hf/`)."""
    for module in model.modules():
        keep = getattr(module, "_maintain_float32_expert_bias", None)
        if keep is not None:
            keep()


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / Float16Module wrappers down to the `GPTModel`."""
    while hasattr(module, "module"):
        module = module.module
    return module
