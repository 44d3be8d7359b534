"""A TRL baseline for throughput comparisons: `trl.KTOTrainer` on a mirror of our run.

`tools/bench_kto.py` describes one of our training runs as plain data (a *spec*: architecture,
tokenizer, data files, loss and optimizer settings) and calls :func:`run_trl_kto` in a separate
process to time TRL on the same model shape and the same rows. Nothing here imports ``trl``,
``transformers`` or ``datasets`` until it runs, so the package does not depend on them.
"""

from __future__ import annotations

import copy
import os
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

#: Our LR schedule names and the `transformers` scheduler closest to each.
_HF_SCHEDULERS = {
    "CosineAnnealing": "cosine_with_min_lr",
    "Constant": "constant_with_warmup",
    "Linear": "linear",
}


def check_llama_compatible(arch: dict[str, Any]) -> None:
    """Raise ValueError naming what a `LlamaForCausalLM` (or, for an MoE shape, a
    `MixtralForCausalLM`) cannot mirror of `arch`."""
    problems = []
    if arch["normalization"] != "RMSNorm":
        problems.append(f"normalization={arch['normalization']}")
    if arch["activation"] != "swiglu":
        problems.append(f"activation={arch['activation']}")
    if arch["position_embedding_type"] != "rope" or arch["rope_scaling"]:
        problems.append("position embeddings other than plain RoPE")
    if arch["add_bias_linear"] or arch["add_qkv_bias"]:
        problems.append("linear biases")
    if arch.get("qk_layernorm"):
        problems.append("Q/K layer norms")
    if arch.get("num_moe_experts") and (
        arch["moe_router_pre_softmax"] or arch["moe_shared_expert_intermediate_size"]
    ):
        problems.append("MoE routing other than Mixtral's (softmax, top-k, renormalise)")
    if problems:
        raise ValueError(
            f"the TRL baseline builds a LlamaForCausalLM, which cannot mirror {', '.join(problems)}"
        )


def hf_tokenizer(tok: dict[str, Any], workdir: Path):
    """A `transformers` tokenizer with the same vocabulary and special ids, built offline.

    Args:
        tok: ``library`` ('sentencepiece' or 'huggingface'), ``model`` (path), ``adds_bos``
            (the tokenizer puts BOS first, see ``data.tokenizers``) and ``pad_id``.
        workdir: scratch directory (a SentencePiece model is copied there).
    """
    if tok["library"] == "sentencepiece":
        from transformers import LlamaTokenizer

        # LlamaTokenizer converts the SentencePiece model it finds as `tokenizer.model`.
        (workdir / "tokenizer.model").write_bytes(Path(tok["model"]).read_bytes())
        hf = LlamaTokenizer.from_pretrained(
            workdir, add_bos_token=tok["adds_bos"], add_eos_token=False
        )
    else:
        from transformers import AutoTokenizer

        path = Path(tok["model"])
        hf = AutoTokenizer.from_pretrained(path if path.is_dir() else path.parent)
    hf.pad_token = hf.convert_ids_to_tokens(tok["pad_id"])
    return hf


def unpaired_dataset(files: list[str]):
    """The rows of `files` in TRL's unpaired format (prompt, completion, label), in file order.

    Any format our pipeline reads is accepted (paired rows become two rows, as in ours).

    Raises:
        ValueError: for conversational rows (not mirrored: they need the same chat template).
    """
    from datasets import Dataset

    from megatron_kto.data.formats import iter_kto_examples

    prompts, completions, labels = [], [], []
    for path in files:
        for ex in iter_kto_examples(path):
            if not isinstance(ex.prompt, str):
                raise ValueError(f"{path}: the TRL baseline supports plain-text rows only")
            # TRL and we tokenise the same text (prompt + completion, as given).
            prompts.append(ex.prompt)
            completions.append(ex.completion)
            labels.append(bool(ex.label))
    return Dataset.from_dict({"prompt": prompts, "completion": completions, "label": labels})


def _llama(spec: dict[str, Any]):
    """The policy: a `LlamaForCausalLM` of the spec's shape, or a `MixtralForCausalLM` (experts
    of `moe_ffn_hidden_size`, Mixtral's routing, the run's `router_aux_loss_coef`, which TRL adds
    to the loss as we do) when the shape has experts. Random init, seeded."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    if spec.get("hf_model"):  # our run starts from a Hugging Face directory: the same model
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(spec["hf_model"], dtype=torch.float32)
        return model.to(torch.bfloat16 if spec["precision"] == "bf16" else torch.float32)
    arch, tok = spec["architecture"], spec["tokenizer"]
    heads = arch["num_attention_heads"]
    torch.manual_seed(spec["seed"])
    common = dict(
        vocab_size=spec["padded_vocab"],
        hidden_size=arch["hidden_size"],
        num_hidden_layers=arch["num_layers"],
        num_attention_heads=heads,
        num_key_value_heads=arch["num_query_groups"] or heads,
        head_dim=arch["kv_channels"] or arch["hidden_size"] // heads,
        max_position_embeddings=arch["encoder_seq_length"],
        rms_norm_eps=arch["layernorm_epsilon"],
        rope_theta=float(arch["rotary_base"]),
        tie_word_embeddings=arch["share_embeddings_and_output_weights"],
        initializer_range=arch["init_method_std"],
        bos_token_id=tok["bos_id"],
        eos_token_id=tok["eos_id"],
        pad_token_id=tok["pad_id"],
    )
    if arch.get("num_moe_experts"):
        config = MixtralConfig(
            **common,
            intermediate_size=arch["moe_ffn_hidden_size"] or arch["ffn_hidden_size"],
            num_local_experts=arch["num_moe_experts"],
            num_experts_per_tok=arch["moe_router_topk"],
            router_aux_loss_coef=arch["moe_aux_loss_coeff"],
        )
        model = MixtralForCausalLM(config)
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, intermediate_size=arch["ffn_hidden_size"]))
    return model.to(torch.bfloat16 if spec["precision"] == "bf16" else torch.float32)


def hf_training_args(spec: dict[str, Any], max_steps: int, output_dir: Path) -> dict[str, Any]:
    """The `transformers.TrainingArguments` every TRL mirror shares: the spec's schedule, Adam,
    clip, `max_length`, precision and seed; one log line after the last step; nothing saved."""
    o = spec["optim"]
    scheduler = _HF_SCHEDULERS[o["sched"]]
    return dict(
        output_dir=str(output_dir),
        max_steps=max_steps,
        learning_rate=o["lr"],
        lr_scheduler_type=scheduler,
        lr_scheduler_kwargs={"min_lr": o["min_lr"]} if scheduler == "cosine_with_min_lr" else {},
        warmup_steps=o["warmup_steps"],
        weight_decay=o["weight_decay"],
        adam_beta1=o["betas"][0],
        adam_beta2=o["betas"][1],
        adam_epsilon=o["eps"],
        max_grad_norm=o["clip"],
        max_length=spec["max_length"],
        bf16=spec["precision"] == "bf16",
        seed=spec["seed"],
        dataloader_drop_last=True,
        logging_steps=max_steps,  # one log line, after the last step
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )


def _kto_config(spec: dict[str, Any], max_steps: int, output_dir: Path):
    from trl import KTOConfig

    k = spec["kto"]
    return KTOConfig(
        **hf_training_args(spec, max_steps, output_dir),
        per_device_train_batch_size=spec["global_batch_size"],
        gradient_accumulation_steps=1,
        beta=k["beta"],
        desirable_weight=k["desirable_weight"],
        undesirable_weight=k["undesirable_weight"],
        loss_type=k["loss_type"],
        precompute_ref_log_probs=k["precomputed_reference"],
        pad_to_multiple_of=spec["pad_to_multiple_of"] if spec["pad_to_multiple_of"] > 1 else None,
        # KTOConfig defaults this to True; ours is set by the run's config.
        gradient_checkpointing=spec["gradient_checkpointing"],
    )


def run_trl_kto(spec: dict[str, Any], max_steps: int) -> dict[str, Any]:
    """Train `trl.KTOTrainer` for `max_steps` steps on the run described by `spec`.

    A `LlamaForCausalLM` (`MixtralForCausalLM` for an MoE shape) of the spec's shape (random
    init, seeded) is the policy and a deep copy of it the reference; with the spec's ``lora``,
    TRL wraps the policy in those `peft` adapters and its reference is the policy with the
    adapters disabled (no copy). Each step is timed from the end of the previous one, so data loading
    and collation are inside it (as in our trainer's ``step_time``).

    Args:
        spec: the run, as written by ``tools/bench_kto.py`` (``trl_spec``).
        max_steps: optimizer steps to run.

    Returns:
        ``step_times`` (wall s), ``step_cpu_times`` (CPU s of the process), ``tokens`` ([sample, KL]
        unpadded input positions, i.e. sequence length − 1 per row) and ``row_lengths`` ([sample,
        KL] lists of those per-row lengths) per step, ``peak_memory_gb`` (peak allocated on CUDA, max RSS of the
        process on CPU), ``versions``, ``optim``, ``attn_implementation``, ``final_log``, and
        ``batch_size``, ``trainable_parameters`` and ``lora`` as the trainer holds them.
    """
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(var, "1")
    if not spec.get("hf_model"):
        check_llama_compatible(spec["architecture"])
    with tempfile.TemporaryDirectory(prefix="trl_baseline_") as tmp:
        return _train(spec, max_steps, Path(tmp))


def _train(spec: dict[str, Any], max_steps: int, workdir: Path) -> dict[str, Any]:
    import torch
    import transformers
    import trl
    from transformers import TrainerCallback
    from trl import KTOTrainer

    model = _llama(spec)
    lora = spec.get("lora")
    if lora:
        # TRL wraps the model in the adapters itself; without a ref_model its reference is
        # that model with the adapters disabled, as ours (adapters_off).
        ref_model, peft_config = None, _lora_config(lora)
    else:  # a copy, else TRL reloads the reference by hub name
        ref_model, peft_config = copy.deepcopy(model).eval(), None
    config = _kto_config(spec, max_steps, workdir / "out")

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.cpu_times: list[float] = []
            self._last = (0.0, 0.0)

        def on_train_begin(self, *_, **__) -> None:
            self._last = (time.perf_counter(), time.process_time())

        def on_step_end(self, *_, **__) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            now = (time.perf_counter(), time.process_time())
            self.times.append(now[0] - self._last[0])
            self.cpu_times.append(now[1] - self._last[1])
            self._last = now

    class CountingKTOTrainer(KTOTrainer):
        """KTOTrainer that records each training batch's (sample, KL) input positions."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.batch_tokens: list[list[int]] = []
            self.batch_row_lengths: list[list[list[int]]] = []

        def training_step(self, model, inputs, num_items_in_batch=None):
            masks = [inputs["attention_mask"], inputs.get("KL_attention_mask")]
            lengths = [(m.sum(dim=-1) - 1).tolist() if m is not None else [] for m in masks]
            self.batch_row_lengths.append(lengths)
            self.batch_tokens.append([sum(n) for n in lengths])
            return super().training_step(model, inputs, num_items_in_batch)

    timer = StepTimer()
    trainer = CountingKTOTrainer(
        model=model,
        ref_model=ref_model,
        args=config,
        train_dataset=unpaired_dataset(spec["train_files"]),
        processing_class=hf_tokenizer(spec["tokenizer"], workdir),
        callbacks=[timer],
        peft_config=peft_config,
    )
    trained = _trained_setup(trainer, config)
    trainer.train()
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated() / 2**30
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {
        "step_times": timer.times,
        "step_cpu_times": timer.cpu_times,
        "tokens": trainer.batch_tokens,
        "row_lengths": trainer.batch_row_lengths,
        "peak_memory_gb": peak,
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "optim": getattr(config.optim, "value", str(config.optim)),
        "attn_implementation": model.config._attn_implementation,
        "final_log": logs[-1] if logs else {},
        **trained,
    }


def _lora_config(lora: dict[str, Any]):
    """`peft.LoraConfig` of the spec's adapters (rank, alpha, dropout, projections, layers)."""
    from peft import LoraConfig

    return LoraConfig(
        r=lora["r"],
        lora_alpha=lora["lora_alpha"],
        lora_dropout=lora["lora_dropout"],
        target_modules=list(lora["target_modules"]),
        layers_to_transform=lora["layers_to_transform"],
        bias="none",
        task_type="CAUSAL_LM",
    )


def _trained_setup(trainer: Any, config: Any) -> dict[str, Any]:
    """What TRL actually trains, read back from the trainer: the batch, the trainable
    parameter count, and the adapters' settings as peft holds them (None without LoRA)."""
    model = trainer.model
    adapters = getattr(model, "peft_config", {}).get("default")
    lora = None
    if adapters is not None:
        lora = {
            "r": adapters.r,
            "lora_alpha": adapters.lora_alpha,
            "lora_dropout": adapters.lora_dropout,
            "target_modules": sorted(adapters.target_modules),
            "layers_to_transform": adapters.layers_to_transform,
            "reference": "adapters disabled" if trainer.ref_model is None else "separate model",
        }
    return {
        "batch_size": config.per_device_train_batch_size * config.gradient_accumulation_steps,
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "lora": lora,
    }


def trl_figures(spec: dict[str, Any], peak_flops: float, warmup: int, steps: int) -> dict[str, Any]:
    """`run_trl_kto` for `warmup + steps` steps, its timed steps' figures counted as our trainer
    counts its own (tokens, model FLOPs of each row at its own length, MFU against `peak_flops`)."""
    import torch

    from megatron_kto.config.architecture import GPTArchitecture
    from megatron_kto.logging.throughput import (
        FWD_BWD_MULTIPLIER,
        architecture_flops,
        kto_pass_tokens,
    )

    run = run_trl_kto(spec, warmup + steps)
    flops = architecture_flops(
        GPTArchitecture.from_dict(spec["architecture"]), spec["padded_vocab"]
    )
    reference_forward = not spec["kto"]["precomputed_reference"]
    per_step = []
    for i in range(warmup, warmup + steps):
        seconds, (samples, kl) = run["step_times"][i], run["tokens"][i]
        row_flops = [flops.rows(torch.tensor(n, dtype=torch.long)) for n in run["row_lengths"][i]]
        forward_only, forward_backward = kto_pass_tokens(*row_flops, reference_forward)
        step_flops = forward_only + FWD_BWD_MULTIPLIER * forward_backward
        per_step.append(
            {
                "step": i + 1,
                "step_time": seconds,
                "samples_per_sec": spec["global_batch_size"] / seconds,
                "tokens_per_sec": (samples + kl) / seconds,
                "mfu": step_flops / seconds / peak_flops,
                "tokens": samples + kl,
                "cpu_time": run["step_cpu_times"][i],
            }
        )
    keys = ("versions", "optim", "attn_implementation", "final_log", "batch_size",
            "trainable_parameters", "lora")  # fmt: skip
    meta = {k: run[k] for k in keys}
    return {"steps": per_step, "peak_memory_gb": run["peak_memory_gb"], **meta}
