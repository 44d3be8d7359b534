"""The validated config's loss keys as the settings `MegatronGPTKTOModel` / `MegatronGPTDPOModel`
take: one place that reads `model.kto.*` / `model.dpo.*` and the shared pass settings."""

from __future__ import annotations

from typing import Any

from megatron_kto.losses.dpo_types import averages_log_probs, loss_type_names
from megatron_kto.models.dpo_model import DPOSettings
from megatron_kto.models.kto_model import KTOSettings


def loss_settings(cfg: Any, algorithm: str, vocab_size: int) -> KTOSettings | DPOSettings:
    """The loss and pass settings of the model for `algorithm` ("kto" or "dpo").

    Args:
        cfg: the validated run config (`model.*` keys, `model.kto` or `model.dpo`).
        algorithm: "kto" or "dpo".
        vocab_size: the model's (padded) vocabulary size.
    """
    m = cfg.model
    loss_cfg = m.kto if algorithm == "kto" else m.dpo
    common = {
        "micro_batch_size": m.micro_batch_size,
        "forward_micro_batch_size": loss_cfg.log_prob_forward_micro_batch_size
        or m.micro_batch_size,
        "vocab_size": vocab_size,
        "beta": loss_cfg.ref_policy_kl_penalty,
        "loss_type": loss_cfg.loss_type,
        "sft_loss_weight": loss_cfg.sft_loss_weight,
        "sft_average_log_probs": loss_cfg.sft_average_log_probs,
        "preference_loss_weight": loss_cfg.preference_loss_weight,
        "average_log_probs": loss_cfg.preference_average_log_probs,
        "logprob_chunk_size": m.logprob_chunk_size,
        "pack_sequences": m.data.pack_sequences,
        "router_aux_loss_coeff": float(m.moe_aux_loss_coeff or 0.0) if m.num_moe_experts else 0.0,
    }
    if algorithm == "kto":
        return KTOSettings(
            desirable_weight=m.kto.desirable_loss_weight,
            undesirable_weight=m.kto.undesirable_loss_weight,
            **common,
        )
    common["loss_type"] = loss_type_names(m.dpo.loss_type)
    # SimPO and ORPO are defined on per-token means (TRL's trainers average unconditionally).
    common["average_log_probs"] |= averages_log_probs(common["loss_type"])
    return DPOSettings(
        label_smoothing=m.dpo.label_smoothing,
        loss_weights=None if m.dpo.loss_weights is None else tuple(m.dpo.loss_weights),
        discopop_tau=m.dpo.discopop_tau,
        f_divergence_type=m.dpo.f_divergence_type,
        f_alpha_divergence_coef=m.dpo.f_alpha_divergence_coef,
        simpo_gamma=m.dpo.simpo_gamma,
        cpo_alpha=m.dpo.cpo_alpha,
        gt_reward_scale=m.dpo.gt_reward_scale,
        prompt_nll=m.dpo.orpo_prompt_nll and "orpo" in common["loss_type"],
        ld_alpha=m.dpo.ld_alpha,
        **common,
    )
