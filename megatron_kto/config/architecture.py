"""The GPT architecture record: what defines a model's shape, independent of parallel layout.

It is written into every checkpoint we save (training or conversion), so that
`pretrained_checkpoint.restore_from_path` can rebuild the model without the user restating it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


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
    """MLP activation: 'swiglu', 'gelu' or 'relu'."""
    position_embedding_type: str = "rope"
    """'rope' or 'learned_absolute'."""
    rotary_base: int = 10000
    """RoPE theta."""
    rotary_percent: float = 1.0
    """Fraction of head dims rotated."""
    rope_scaling: bool = False
    """Llama-3.1-style RoPE frequency scaling."""
    rope_scaling_factor: float = 8.0
    """Scale factor for rope_scaling."""
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

    def __post_init__(self) -> None:
        if self.moe_layer_freq is not None:  # plain ints (a config gives a ListConfig)
            self.moe_layer_freq = [int(v) for v in self.moe_layer_freq]

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

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` (0-based, global) has routed experts."""
        if not self.num_moe_experts:
            return False
        return self.moe_layer_freq is None or bool(self.moe_layer_freq[layer])

    def has_dense_layers(self) -> bool:
        """An MoE model with some dense-MLP layers (`moe_layer_freq` with a 0)."""
        return bool(self.num_moe_experts) and not all(self.moe_layer_freq or [1])

    def layer_architecture(self, layer: int) -> GPTArchitecture:
        """The architecture layer `layer` is built and converted as: this one for an MoE
        layer (or a dense model), a dense copy (no experts, no shared expert) for a dense layer
        of an MoE model."""
        if self.is_moe_layer(layer) or not self.num_moe_experts:
            return self
        return dataclasses.replace(
            self,
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
