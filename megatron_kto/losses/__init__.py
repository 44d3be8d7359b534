"""Pure loss math for KTO and DPO: plain tensors in, per-example losses and metric sums out.

Nothing in this package calls a collective, reads a config object or picks a device; the model
code reduces the fixed-size metric tensors and the KL sums across ranks and passes results in.
"""

from megatron_kto.losses.dpo import (
    DPO_LOSS_TYPES,
    DPOLossOutput,
    DPOTotalLossOutput,
    dpo_loss,
    dpo_total_loss,
)
from megatron_kto.losses.dpo_types import DPO_LOSSES, DPOPairs, check_loss_mixture
from megatron_kto.losses.kto import (
    KTO_LOSS_TYPES,
    KTOLossOutput,
    KTOTotalLossOutput,
    kl_reference_point,
    kto_loss,
    kto_total_loss,
    sft_nll,
)
from megatron_kto.losses.metrics import (
    DPO_METRICS,
    KTO_METRICS,
    MetricSums,
    dpo_metric_sums,
    finalize_dpo_metrics,
    finalize_kto_metrics,
    kto_metric_sums,
)

__all__ = [
    "DPO_LOSSES",
    "DPO_LOSS_TYPES",
    "DPO_METRICS",
    "DPOLossOutput",
    "DPOPairs",
    "DPOTotalLossOutput",
    "KTO_LOSS_TYPES",
    "KTO_METRICS",
    "KTOLossOutput",
    "KTOTotalLossOutput",
    "MetricSums",
    "check_loss_mixture",
    "dpo_loss",
    "dpo_metric_sums",
    "dpo_total_loss",
    "finalize_dpo_metrics",
    "finalize_kto_metrics",
    "kl_reference_point",
    "kto_loss",
    "kto_metric_sums",
    "kto_total_loss",
    "sft_nll",
]
