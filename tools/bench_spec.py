"""What `tools/bench_kto.py` hands its TRL side (and reports of a DPO run): one of our runs as
plain data — architecture, tokenizer, data files, loss, optimizer and LoRA settings (a KTO run:
`trl_spec`; a DPO-family `--objective` run: `preference_spec`, which `bench_trl` mirrors), and, when
the run starts from a Hugging Face directory, that directory, which the TRL side then loads as
its model (`tools/trl_baseline.py`): the same `transformers` model on both sides.

Imported only inside the bench's worker processes (it imports our package and torch).
"""

from __future__ import annotations

from typing import Any


def _resolved_architecture(cfg: Any, vocab_size: int):
    """The model shape a run of `cfg` builds (the pretrained checkpoint's, if one is given)."""
    from megatron_kto.checkpointing.model_io import read_architecture
    from megatron_kto.checkpointing.pretrained import resolve_pretrained_dir
    from megatron_kto.config.schema import architecture_of

    path = cfg.pretrained_checkpoint.restore_from_path
    arch = read_architecture(resolve_pretrained_dir(path)) if path else architecture_of(cfg.model)
    if arch.vocab_size is None:
        arch.vocab_size = vocab_size
    return arch


def run_spec(cfg: Any, algorithm: str) -> tuple[dict[str, Any], Any]:
    """What every TRL mirror of a run needs, as plain data (shape, tokenizer, files, batch,
    precision, seed, optimizer), and the run's `GPTArchitecture`.

    Args:
        cfg: the composed run config.
        algorithm: "kto" or "dpo" (whose `trainer.<algorithm>` clip is read).
    """
    from megatron_kto.checkpointing.pretrained import resolve_pretrained_dir
    from megatron_kto.conversion.hf_dir import looks_like_hf_dir
    from megatron_kto.data.pipeline import resolve_path
    from megatron_kto.data.tokenizers import load_tokenizer

    m = cfg.model
    tok_path = str(resolve_path(m.tokenizer.model))
    tokenizer = load_tokenizer(m.tokenizer.library, tok_path, m.tokenizer.chat_template)
    arch = _resolved_architecture(cfg, tokenizer.vocab_size)
    path = cfg.pretrained_checkpoint.restore_from_path
    hf_model = str(resolve_pretrained_dir(path)) if path else None
    spec = {
        "architecture": arch.to_dict(),
        "padded_vocab": arch.padded_vocab(m.tensor_model_parallel_size),
        # A Hugging Face directory we start from: the TRL side loads this very model.
        "hf_model": hf_model if hf_model and looks_like_hf_dir(hf_model) else None,
        "tokenizer": {
            "library": m.tokenizer.library,
            "model": tok_path,
            "bos_id": tokenizer.bos_id,
            "adds_bos": tokenizer.adds_bos,
            "eos_id": tokenizer.eos_id,
            "pad_id": tokenizer.pad_id,
        },
        "train_files": [str(resolve_path(p)) for p in m.data.data_prefix.train],
        "max_length": m.data.max_length or arch.encoder_seq_length,
        "global_batch_size": m.global_batch_size,
        "micro_batch_size": m.micro_batch_size,
        "precision": str(cfg.trainer.precision),
        "seed": m.seed,
        "optim": {
            "lr": m.optim.lr,
            "min_lr": m.optim.sched.min_lr,
            "sched": m.optim.sched.name,
            "warmup_steps": m.optim.sched.warmup_steps,
            "weight_decay": m.optim.weight_decay,
            "betas": list(m.optim.betas),
            "eps": m.optim.eps,
            "clip": getattr(cfg.trainer, algorithm).gradient_clip_val,
        },
    }
    return spec, arch


def trl_spec(cfg: Any) -> dict[str, Any]:
    """Everything the TRL side needs to run the same training as `cfg`, as plain data."""
    from megatron_kto.peft.settings import reference_strategy

    m = cfg.model
    spec, arch = run_spec(cfg, "kto")  # its micro_batch_size is ours only (TRL: one micro-batch)
    return {
        **spec,
        "pad_to_multiple_of": m.data.pad_to_multiple_of,
        "reference_policy": reference_strategy(m, "kto"),  # ours only
        "lora": lora_spec(m, arch),
        "gradient_checkpointing": m.activations_checkpoint_granularity is not None,
        "kto": {
            "beta": m.kto.ref_policy_kl_penalty,
            "desirable_weight": m.kto.desirable_loss_weight,
            "undesirable_weight": m.kto.undesirable_loss_weight,
            "loss_type": m.kto.loss_type,
            "sft_loss_weight": m.kto.sft_loss_weight,
            "precomputed_reference": m.kto.reference_policy == "precomputed",
        },
    }


def preference_spec(cfg: Any) -> dict[str, Any]:
    """What an `--objective` (DPO-family) run reports of its setup, and what the TRL side needs
    to mirror it (`run_trl_preference`), as plain data."""
    d = cfg.model.dpo
    spec, _ = run_spec(cfg, "dpo")
    spec["dpo"] = {
        "loss_type": d.loss_type,
        "beta": d.ref_policy_kl_penalty,
        "label_smoothing": d.label_smoothing,
        "cpo_alpha": d.cpo_alpha,
        "simpo_gamma": d.simpo_gamma,
    }
    return spec


def lora_spec(model_cfg: Any, arch: Any) -> dict[str, Any] | None:
    """The run's LoRA adapters as `peft.LoraConfig` arguments (None without LoRA), and the
    number of adapter parameters they add to the unsharded model: the TRL side wraps its model
    in the same adapters and reports its own count, which must be this one."""
    from megatron_kto.peft.hf_peft import peft_config
    from megatron_kto.peft.settings import lora_settings, uses_lora
    from megatron_kto.peft.targets import projection_shape, resolve_targets, selected_layers

    if not uses_lora(model_cfg):
        return None
    settings = lora_settings(model_cfg)
    config = peft_config(settings, arch, None)
    layers = selected_layers(settings.layer_selection, arch.num_layers)
    # Per layer: a hybrid model's DeltaNet and attention layers adapt different projections.
    fans = sum(
        sum(projection_shape(p, arch))
        for i in layers
        for t in resolve_targets(settings.target_modules, arch, i)
        for p in t.projections
    )
    keys = ("r", "lora_alpha", "lora_dropout", "target_modules", "layers_to_transform")
    return {**{k: config[k] for k in keys}, "adapter_parameters": settings.rank * fans}
