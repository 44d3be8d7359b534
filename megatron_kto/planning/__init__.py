"""Will it fit — before launch: per-rank memory plans and layout recommendations.

`model_state` (weights, gradients, optimizer state, exact), `activations` (what a training step
keeps for its backward), `memory` (the plan of a run, its table), `layout` (enumerate layouts,
roofline step time, recommend), `measure` (the same quantities measured on real tensors).
"""
