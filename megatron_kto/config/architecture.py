"""The GPT architecture record: what defines a model's shape, independent of parallel layout.

It is written into every checkpoint we save (training or conversion), so that
`pretrained_checkpoint.restore_from_path` can rebuild the model without the user restating it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

#: Activations whose MLP input projection holds a gate and an up half (fc1 = [gate; up]).
GATED_ACTIVATIONS = ("swiglu", "geglu", "quick_geglu")
#: Hugging Face's DeltaNet input projections by `GPTArchitecture.linear_in_proj`, in the order
#: `conversion.deltanet.hybrid_fuse` takes them.
IN_PROJ_NAMES: dict[str, tuple[str, ...]] = {
    "qkvz_ba": ("in_proj_qkvz", "in_proj_ba"),
    "qkv_z_b_a": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
}


@dataclass
class GPTArchitecture:
    """Shape and numerics of a GPT/Llama-family decoder (dense or mixture-of-experts)."""

    num_layers: int = 2
    """Number of transformer layers."""
    hidden_size: int = 64
    """Model width."""
    ffn_hidden_size: int = 256
    """MLP inner width (per branch for SwiGLU)."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention; None means num_attention_heads (MHA)."""
    kv_channels: int | None = None
    """Per-head dimension; None means hidden_size // num_attention_heads."""
    encoder_seq_length: int = 512
    """Maximum sequence length (also the learned-position table size)."""
    vocab_size: int | None = None
    """Tokenizer vocabulary size; None means take it from the tokenizer."""
    make_vocab_size_divisible_by: int = 128
    """Embedding rows are padded up to a multiple of this times the TP size."""
    padded_vocab_size: int | None = None
    """Exact embedding rows (set by conversion to keep an HF checkpoint's rows); overrides padding."""
    normalization: str = "RMSNorm"
    """'RMSNorm' or 'LayerNorm'."""
    layernorm_epsilon: float = 1e-5
    """Norm epsilon."""
    activation: str = "swiglu"
    """MLP activation: 'swiglu', 'geglu' (gated tanh-approximated GeLU, Gemma),
    'quick_geglu' (gated, x·sigmoid(1.702x): GPT-OSS), 'gelu' or 'relu'."""
    position_embedding_type: str = "rope"
    """'rope' or 'learned_absolute'."""
    rotary_base: int = 10000
    """RoPE theta."""
    rotary_percent: float = 1.0
    """Fraction of head dims rotated."""
    rope_scaling: bool = False
    """Llama-3.1-style RoPE frequency scaling."""
    rope_scaling_factor: float = 8.0
    """Scale factor for rope_scaling (and for YaRN, `position_embedding_type: yarn`)."""
    yarn_original_max_position_embeddings: int | None = None
    """YaRN (`position_embedding_type: yarn`, GPT-OSS): the context length the model was trained
    with before scaling (HF `rope_parameters.original_max_position_embeddings`)."""
    yarn_beta_fast: float = 32.0
    """YaRN: rotations per context above which a frequency is kept as is (HF `beta_fast`)."""
    yarn_beta_slow: float = 1.0
    """YaRN: rotations per context below which a frequency is fully interpolated (`beta_slow`)."""
    add_bias_linear: bool = False
    """Biases on all linear layers (GPT-2 style)."""
    add_qkv_bias: bool = False
    """Bias on the QKV projection only (Qwen2)."""
    qk_layernorm: bool = False
    """Per-head RMSNorm/LayerNorm of queries and keys before RoPE (Qwen3)."""
    share_embeddings_and_output_weights: bool = False
    """Tie the input embedding and the output layer."""
    init_method_std: float = 0.02
    """Std of the normal weight initialisation."""
    hidden_dropout: float = 0.0
    """Dropout after attention/MLP."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    rotary_base_local: float | None = None
    """RoPE theta of the sliding-window layers (Gemma 3's local layers); None means
    `rotary_base` in every layer."""
    rotary_interpolation_factor: float | None = None
    """Linear RoPE scaling of the full-attention layers (positions divided by it; HF rope_type
    'linear'); None means none."""
    zero_centered_norms: bool = False
    """Every RMSNorm scales by (1 + weight), computed in fp32 (Gemma)."""
    post_norms: bool = False
    """An RMSNorm on the attention output and on the MLP output before each residual add
    (Gemma's post_attention / post_feedforward norms)."""
    embedding_multiplier: float | None = None
    """Input embeddings are multiplied by this, rounded to the model's dtype (Gemma:
    sqrt(hidden_size)); None means 1."""
    softmax_scale: float | None = None
    """Attention score scale; None means 1/sqrt(head dim) (Gemma: query_pre_attn_scalar^-0.5)."""
    attention_sinks: bool = False
    """A learned logit per query head in every softmax denominator (GPT-OSS `self_attn.sinks`;
    megatron-core's `softmax_type='learnable'`)."""
    glu_linear_offset: float = 0.0
    """Added to the linear half of a gated MLP before the product (GPT-OSS: 1.0)."""
    activation_clamp: float | None = None
    """Gated MLP clamp (GPT-OSS `swiglu_limit`): the gate half at most this, the linear half
    within ±this; None: no clamp."""
    sliding_window: int | None = None
    """Sliding-window attention: a query sees itself and the `sliding_window - 1` positions
    before it (HF `sliding_window`); None means full causal attention in every layer."""
    window_layers: list[int] | None = None
    """Which layers use `sliding_window`: one 1 (sliding) or 0 (full attention) per layer
    (megatron-core's `window_attn_skip_freq` list; HF `layer_types`); None means every layer."""

    num_moe_experts: int | None = None
    """Routed experts per MoE layer; None means a dense MLP in every layer."""
    moe_ffn_hidden_size: int | None = None
    """Inner width of one expert (per branch for SwiGLU); None means ffn_hidden_size."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before the top-k (weights not renormalised); False means the
    softmax over the k selected logits (= softmax, top-k, renormalise)."""
    moe_shared_expert_intermediate_size: int | None = None
    """Inner width of the shared expert every token also goes through (Qwen2-MoE); None: none."""
    moe_shared_expert_gate: bool = False
    """Scale the shared expert's output by sigmoid(x · w) with a learned [1, hidden] w."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the router load-balancing loss in the training loss (HF `router_aux_loss_coef`)."""
    moe_layer_freq: list[int] | None = None
    """Which layers of an MoE model are MoE layers: one 1 (MoE) or 0 (a dense MLP of
    `ffn_hidden_size`) per layer, megatron-core's list form (HF Qwen-MoE `mlp_only_layers` /
    `decoder_sparse_step`); None means every layer (of a model with `num_moe_experts`)."""
    moe_router_score_function: str = "softmax"
    """Router scores: 'softmax' (Qwen-MoE, Mixtral) or 'sigmoid' (GLM-4.5, DeepSeek-V3: each
    expert's sigmoid score, the top-k renormalised to sum to 1)."""
    moe_router_enable_expert_bias: bool = False
    """A per-expert bias added to the sigmoid scores for the choice of experts only (HF
    `e_score_correction_bias`, megatron-core's `expert_bias` buffer)."""
    moe_router_num_groups: int | None = None
    """Group-limited routing: experts form this many equal groups (HF `n_group`); None: none."""
    moe_router_group_topk: int | None = None
    """Groups each token may pick experts from (HF `topk_group`), ranked by the sum of their
    top-(topk / group_topk) scores; None: no group limit."""
    moe_router_topk_scaling_factor: float | None = None
    """Routing weights are multiplied by this (HF `routed_scaling_factor`); None: 1."""

    multi_latent_attention: bool = False
    """Multi-latent attention (DeepSeek-V2/V3; megatron-core's `MLASelfAttention`): queries
    (through a rank-`q_lora_rank` bottleneck when set) and one compressed key/value latent of
    rank `kv_lora_rank` per token; a query/key head is `qk_nope_head_dim` un-rotated dims then
    `qk_rope_head_dim` rotated ones (the rotated key shared by every head), a value head
    `v_head_dim`. `kv_channels` is then the query/key head dim (nope + rope)."""
    q_lora_rank: int | None = None
    """MLA: rank of the query bottleneck (HF `q_a_proj`); None: one query projection (`q_proj`)."""
    kv_lora_rank: int = 512
    """MLA: rank of the compressed key/value latent (HF `kv_a_proj_with_mqa`)."""
    qk_nope_head_dim: int = 128
    """MLA: un-rotated query/key dims per head."""
    qk_rope_head_dim: int = 64
    """MLA: rotated (decoupled RoPE) query/key dims per head."""
    v_head_dim: int = 128
    """MLA: value dims per head."""
    yarn_mscale: float | None = None
    """MLA YaRN: `mscale` (HF `rope_parameters.mscale`); with `yarn_mscale_all_dim` the RoPE
    attention factor is mscale(factor, yarn_mscale) / mscale(factor, yarn_mscale_all_dim)."""
    yarn_mscale_all_dim: float | None = None
    """MLA YaRN: `mscale_all_dim`; the softmax scale is multiplied by mscale(factor, it)^2."""

    linear_attention_freq: list[int] | None = None
    """Which layers are gated DeltaNet (linear attention) layers: one 1 (DeltaNet) or 0 (full
    attention) per layer, megatron-core's list form (HF `layer_types` / `full_attention_interval`,
    Qwen3-Next / Qwen3.5); None means full attention in every layer."""
    linear_conv_kernel_dim: int = 4
    """DeltaNet short causal convolution width (HF `linear_conv_kernel_dim`)."""
    linear_key_head_dim: int = 128
    """DeltaNet query/key head dim (HF `linear_key_head_dim`)."""
    linear_value_head_dim: int = 128
    """DeltaNet value head dim (HF `linear_value_head_dim`)."""
    linear_num_key_heads: int = 16
    """DeltaNet query/key heads (HF `linear_num_key_heads`)."""
    linear_num_value_heads: int = 32
    """DeltaNet value heads, a multiple of the key heads (HF `linear_num_value_heads`)."""
    linear_in_proj: str = "qkvz_ba"
    """How Hugging Face splits a DeltaNet layer's input projection (the LoRA target names):
    'qkvz_ba' (Qwen3-Next: `in_proj_qkvz`, `in_proj_ba`, grouped per key head) or 'qkv_z_b_a'
    (Qwen3.5: `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`)."""
    attention_output_gate: bool = False
    """Full attention's output scaled by sigmoid of a per-head gate projected with the queries
    (Qwen3-Next / Qwen3.5 gated attention)."""

    def __post_init__(self) -> None:
        if self.moe_layer_freq is not None:  # plain ints (a config gives a ListConfig)
            self.moe_layer_freq = [int(v) for v in self.moe_layer_freq]
        if self.window_layers is not None:
            self.window_layers = [int(v) for v in self.window_layers]
        if self.linear_attention_freq is not None:
            self.linear_attention_freq = [int(v) for v in self.linear_attention_freq]

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form, for checkpoints and JSON."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPTArchitecture:
        """Build from a dict, rejecting unknown keys with a message naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown model architecture keys: {unknown}")
        return cls(**{k: v for k, v in data.items() if k in names})

    def is_linear_attention_layer(self, layer: int) -> bool:
        """Whether layer `layer` (0-based, global) is a gated DeltaNet layer."""
        return bool(self.linear_attention_freq) and bool(self.linear_attention_freq[layer])

    def has_linear_attention(self) -> bool:
        """A hybrid model with gated DeltaNet layers."""
        return any(self.linear_attention_freq or [])

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` (0-based, global) has routed experts."""
        if not self.num_moe_experts:
            return False
        return self.moe_layer_freq is None or bool(self.moe_layer_freq[layer])

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (0-based, global), None for full attention."""
        if not self.sliding_window:
            return None
        if self.window_layers is None or self.window_layers[layer]:
            return self.sliding_window
        return None

    @property
    def gated_mlp(self) -> bool:
        """The MLP's first linear layer holds a gate and an up projection (SwiGLU, GeGLU, GPT-OSS's clamped quick GeGLU)."""
        return self.activation in GATED_ACTIVATIONS

    def has_dense_layers(self) -> bool:
        """An MoE model with some dense-MLP layers (`moe_layer_freq` with a 0)."""
        return bool(self.num_moe_experts) and not all(self.moe_layer_freq or [1])

    def layer_architecture(self, layer: int) -> GPTArchitecture:
        """The architecture layer `layer` is built and converted as: this one for an MoE
        layer (or a dense model), a dense copy (no experts, no shared expert) for a dense layer
        of an MoE model; in a hybrid model, with every layer of this layer's attention kind."""
        arch = self
        if self.linear_attention_freq is not None:  # hybrid: this layer's attention kind
            kind = int(self.is_linear_attention_layer(layer))
            arch = dataclasses.replace(self, linear_attention_freq=[kind] * self.num_layers)
        if self.is_moe_layer(layer) or not self.num_moe_experts:
            return arch
        return dataclasses.replace(
            arch,
            num_moe_experts=None,
            moe_ffn_hidden_size=None,
            moe_shared_expert_intermediate_size=None,
            moe_shared_expert_gate=False,
            moe_layer_freq=None,
        )

    @classmethod
    def field_names(cls) -> list[str]:
        """Names of all architecture fields."""
        return [f.name for f in dataclasses.fields(cls)]

    def padded_vocab(self, tensor_parallel_size: int) -> int:
        """Embedding rows: `padded_vocab_size` if fixed, else vocab rounded up for TP."""
        if self.padded_vocab_size is not None:
            if self.padded_vocab_size % tensor_parallel_size:
                raise ValueError(
                    f"padded_vocab_size {self.padded_vocab_size} is not divisible by "
                    f"tensor_model_parallel_size {tensor_parallel_size}"
                )
            return self.padded_vocab_size
        if self.vocab_size is None:
            raise ValueError("model.vocab_size is unset (it is normally read from the tokenizer)")
        multiple = self.make_vocab_size_divisible_by * tensor_parallel_size
        return -(-self.vocab_size // multiple) * multiple
