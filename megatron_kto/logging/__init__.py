"""Run logging: metrics.jsonl / TensorBoard / W&B, a rank-0 progress display, throughput & MFU."""

from megatron_kto.logging.metrics_logger import MetricsLogger
from megatron_kto.logging.progress import ProgressReporter
from megatron_kto.logging.throughput import (
    ThroughputMeter,
    ThroughputStats,
    dpo_pass_tokens,
    gpt_flops_per_token,
    kto_pass_tokens,
    measure_peak_flops,
)

__all__ = [
    "MetricsLogger",
    "ProgressReporter",
    "ThroughputMeter",
    "ThroughputStats",
    "dpo_pass_tokens",
    "gpt_flops_per_token",
    "kto_pass_tokens",
    "measure_peak_flops",
]
