"""Run logging: metrics.jsonl / TensorBoard / W&B, a rank-0 progress display, throughput & MFU."""

from megatron_kto.logging.metrics_logger import MetricsLogger
from megatron_kto.logging.progress import ProgressReporter
from megatron_kto.logging.throughput import (
    ModelFlops,
    ThroughputMeter,
    ThroughputStats,
    architecture_flops,
    dpo_pass_tokens,
    gpt_flops_per_token,
    kto_pass_tokens,
    measure_peak_flops,
)

__all__ = [
    "MetricsLogger",
    "ModelFlops",
    "ProgressReporter",
    "ThroughputMeter",
    "ThroughputStats",
    "architecture_flops",
    "dpo_pass_tokens",
    "gpt_flops_per_token",
    "kto_pass_tokens",
    "measure_peak_flops",
]
