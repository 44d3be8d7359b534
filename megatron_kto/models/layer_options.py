"""Architecture options layered onto the attention-backend's local layer spec: per-head Q/K norms
(Qwen3) and a mixture-of-experts MLP (Qwen3-MoE, Mixtral).

`layer_specs.local_layer_spec` decides the attention modules; this module only swaps the Q/K norm
slots and the MLP, so both evolve independently. The MoE MLP is megatron-core's `MoELayer` with
its router and local experts (`SequentialMLP`: one megatron MLP per expert) — the spec megatron's
`get_gpt_layer_local_spec(num_experts=..., moe_grouped_gemm=False)` builds; with Transformer
Engine, `get_gpt_layer_with_transformer_engine_spec(num_experts=..., moe_grouped_gemm=True)`
builds TE's grouped experts instead (see `layer_specs.decoder_block_spec`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.models.norms import LocalNorm


def moe_transformer_config(
    arch: GPTArchitecture,
    expert_parallel_size: int,
    expert_tensor_parallel_size: int | None = None,
    expert_bias_update_rate: float = 0.0,
) -> dict[str, Any]:
    """The `TransformerConfig` fields of an architecture's MoE layers (empty when dense).

    `expert_tensor_parallel_size` (None: the attention's TP) splits each expert's linears over
    megatron-core's expert-tensor-parallel group; the all-to-all dispatcher gathers a rank's
    tokens over that group and reduce-scatters the experts' outputs back, so any ETP works with it.

    Routing is dropless (no capacity factor, no token dropping) through the all-to-all token
    dispatcher, as Hugging Face's MoE blocks compute every routed token. The load-balancing loss
    is not wired through megatron's auxiliary-loss path (`moe_router_load_balancing_type='none'`):
    megatron's formula is per layer and divides by top-k, while Hugging Face's
    `load_balancing_loss_func` averages token fractions and router probabilities over all layers'
    tokens jointly, so it cannot be reproduced from megatron's per-layer losses; ours comes from
    hooks on these routers (`models.router_stats`). The router is deterministic (no jitter).

    Sigmoid routing (GLM-4.5, DeepSeek-V3) may carry an expert bias (`expert_bias`, a persistent
    fp32 buffer: HF's `e_score_correction_bias`) that only steers the choice of experts.
    megatron-core moves it after every step in `finalize_model_grads` by
    `expert_bias_update_rate` x sign(mean load - expert load) (aux-loss-free balancing); the
    default rate 0 keeps it as the checkpoint has it (`model.moe_router_bias_update_rate`).
    A sigmoid router computes its logits in fp32 whatever the run's precision, as `transformers`
    does (Glm4Moe keeps `mlp.gate` in fp32): in bf16 a score near 0.5 has a resolution of
    0.004, coarser than the correction biases that steer the choice.
    """
    if not arch.num_moe_experts:
        if expert_parallel_size != 1:
            raise ValueError(
                f"model.expert_model_parallel_size {expert_parallel_size} needs a mixture-of-"
                "experts model (this one is dense)"
            )
        # A dense model's TransformerConfig keeps megatron's default (ETP = TP): nothing to split.
        return {}
    if arch.add_bias_linear and (expert_tensor_parallel_size or 1) != 1:
        # megatron-core 0.16 asserts this in TransformerConfig; said here with the key to set.
        raise ValueError(
            "model.expert_tensor_parallel_size: experts with biases (GPT-OSS) run only unsplit "
            "(megatron-core supports MoE biases at expert tensor parallel size 1); set "
            "model.expert_tensor_parallel_size=1"
        )
    return dict(
        num_moe_experts=arch.num_moe_experts,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size or arch.ffn_hidden_size,
        moe_router_topk=arch.moe_router_topk,
        moe_router_pre_softmax=arch.moe_router_pre_softmax,
        moe_router_score_function=arch.moe_router_score_function,
        moe_router_enable_expert_bias=arch.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=expert_bias_update_rate,
        moe_router_num_groups=arch.moe_router_num_groups,
        moe_router_group_topk=arch.moe_router_group_topk,
        moe_router_topk_scaling_factor=arch.moe_router_topk_scaling_factor,
        moe_router_dtype="fp32" if arch.moe_router_score_function == "sigmoid" else None,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall",
        moe_expert_capacity_factor=None,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        moe_shared_expert_intermediate_size=arch.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=arch.moe_shared_expert_gate,
        moe_layer_freq=arch.moe_layer_freq or 1,  # a 0/1 list: the dense layers of the model
        expert_model_parallel_size=expert_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
    )


def _define_te_gemm_when_absent() -> None:
    """megatron-core 0.16.1 bug (not CPU-specific): `moe_utils.RouterGatingLinearFunction` tests
    `te_general_gemm is not None`, but the name only exists when Transformer Engine imported, so
    every router forward raises NameError without TE. Define it as None: the router then uses
    its own `torch.mm` path, as intended."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class ExpertRowParallelLinear(RowParallelLinear):
    """megatron-core's `RowParallelLinear` for biased experts: a fresh output tensor, and a bias
    that is not reduced over TP under sequence parallelism and counts in the gradient norm on
    every TP rank (three megatron-core 0.16.1 bugs with expert biases).

    megatron-core 0.16.1's `MLP.forward` adds an expert's fc2 bias in place
    (`output += output_bias * per_token_scale`), but at expert TP 1 (the only size biased experts
    run at) the linear's reduction returns its input as a view of a custom autograd function,
    and autograd forbids modifying that in place: every training step with biased experts
    (GPT-OSS) raised. A copy of the [tokens, hidden] output per expert makes the add legal.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.bias is not None:
            # megatron-core 0.16.1 marks every RowParallelLinear bias `sequence_parallel` under
            # SP, experts' too, so finalize_model_grads all-reduced each local expert's fc2 bias
            # gradient over TP — summing different experts' (at ETP 1 each TP rank holds its
            # own): measured TP2 x SP x EP2 step-1 grad norm 1.2857 vs EP2's 1.2753. An
            # expert's tokens all reach its one rank, so its gradient needs no TP reduction.
            self.bias.sequence_parallel = False
            # And megatron-core's expert optimizer skips a parameter as a "TP duplicate" by the
            # dense TP group's rank: TP rank 1's expert fc2 biases were left out of the gradient
            # norm (measured 1.2038 vs EP2's 1.2753), though its norm is reduced over the
            # expert group only. Each rank's experts are its own: count them.
            self.bias.tensor_model_parallel = True

    def forward(self, input_, *args, **kwargs):  # noqa: D102 — RowParallelLinear's
        output, bias = super().forward(input_, *args, **kwargs)
        if bias is not None and torch.is_grad_enabled():
            output = output.clone()
        return output, bias


def _with_biased_expert_fc2(mlp: ModuleSpec) -> ModuleSpec:
    """The MoE spec `mlp` with `ExpertRowParallelLinear` as its routed experts' fc2."""
    experts = mlp.submodules.experts
    linears = dataclasses.replace(experts.submodules, linear_fc2=ExpertRowParallelLinear)
    experts = dataclasses.replace(experts, submodules=linears)
    return dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules, experts=experts))


def extend_local_layer(spec: ModuleSpec, config: TransformerConfig, moe: bool = True) -> ModuleSpec:
    """`spec` (a local-spec transformer layer) with `LocalNorm` Q/K norms when
    `config.qk_layernorm` and megatron's MoE MLP when `config.num_moe_experts` (and `moe`: False
    keeps the dense MLP, for the dense layers of an MoE model).

    An MoE layer's pre-MLP norm is never fused into a linear layer (in TE's spec neither), so its
    checkpoint key stays `pre_mlp_layernorm.*`: the local spec's rename to TE's fused
    `mlp.linear_fc1.layer_norm_*` is dropped for it.
    """
    layer = spec.submodules
    if config.qk_layernorm:
        attention = layer.self_attention
        attn_submodules = dataclasses.replace(
            attention.submodules, q_layernorm=LocalNorm, k_layernorm=LocalNorm
        )
        layer = dataclasses.replace(
            layer, self_attention=dataclasses.replace(attention, submodules=attn_submodules)
        )
    if config.num_moe_experts and moe:
        _define_te_gemm_when_absent()
        mlp = get_moe_module_spec_for_backend(
            LocalSpecProvider(), num_experts=config.num_moe_experts, moe_grouped_gemm=False
        )
        if config.add_bias_linear:
            mlp = _with_biased_expert_fc2(mlp)
        keys = {
            k: v for k, v in (layer.sharded_state_dict_keys_map or {}).items() if "pre_mlp" not in k
        }
        layer = dataclasses.replace(layer, mlp=mlp, sharded_state_dict_keys_map=keys)
    return dataclasses.replace(spec, submodules=layer)
