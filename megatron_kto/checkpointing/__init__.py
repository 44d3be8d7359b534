"""Checkpoints: model-only (conversion, `restore_from_path`) and full training state (resume).

Modules (import them directly; this package imports nothing so that light users such as
`preemption` do not pull in megatron-core):

- `manager`: `CheckpointManager` (save / load_latest / load), re-exports `restore_pretrained`.
- `pretrained`: `resolve_pretrained_dir`, `restore_pretrained`.
- `model_io`: model-only checkpoints (conversion tool format).
- `optimizer_state`: optimizer sharded state + megatron-core 0.16.1 workarounds.
- `rng`: per-rank RNG state. `files`: on-disk layout, atomic commit, manifest, retention.
- `preemption`: `PreemptionHandler` (`trainer.max_time`: `config.max_time`). `errors`: `CheckpointError`.
"""
