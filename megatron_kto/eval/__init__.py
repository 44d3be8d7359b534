"""Evaluation of trained policies: implicit rewards on labelled data and how well they classify."""

from megatron_kto.eval.classification import RewardReport, roc_auc, summarize

__all__ = ["RewardReport", "roc_auc", "summarize"]
