"""For `tools/bench_kto.py --objective cpo|simpo|orpo`: the TRL 1.16 baseline — its experimental `CPOTrainer`
(`loss_type` "sigmoid" / "simpo") or `ORPOTrainer` on a `LlamaForCausalLM` of the run's shape.

The preference baseline mirrors the run as `trl_baseline` mirrors a KTO run: the same model shape
(random init, seeded), the same pairs in file order, β, `cpo_alpha`, `simpo_gamma`, ε, schedule,
Adam settings, clip and `max_length`, and the run's micro-batch (`per_device_train_batch_size` =
our micro-batch in pairs, gradient accumulation up to the global batch), so both sides hold the
activations of the same number of pairs. TRL pads each micro-batch's chosen and rejected rows to
its longest row, as it does; tokens are counted as ours (the unpadded input positions, length − 1
per row), MFU as ours (policy forward+backward on the chosen and rejected rows, no reference).
Each step is timed from the end of the previous one, data loading included.
"""

from __future__ import annotations

import os
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

#: The objectives TRL's experimental reference-free trainers run: ours -> (trainer, loss_type).
TRL_PREFERENCE = {"cpo": ("cpo", "sigmoid"), "simpo": ("cpo", "simpo"), "orpo": ("orpo", None)}


def _config(spec: dict[str, Any], max_steps: int, output_dir: Path):
    from trl.experimental.cpo import CPOConfig
    from trl.experimental.orpo import ORPOConfig
    from trl_baseline import hf_training_args

    d = spec["dpo"]
    kind, loss_type = TRL_PREFERENCE[d["loss_type"]]
    loss: dict[str, Any] = {"beta": d["beta"]}
    if kind == "cpo":
        loss |= {"loss_type": loss_type, "cpo_alpha": d["cpo_alpha"],
                 "simpo_gamma": d["simpo_gamma"], "label_smoothing": d["label_smoothing"]}  # fmt: skip
    micro = spec["micro_batch_size"]
    return (CPOConfig if kind == "cpo" else ORPOConfig)(
        **hf_training_args(spec, max_steps, output_dir),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=spec["global_batch_size"] // micro,
        gradient_checkpointing=False,
        **loss,
    )


def _train(spec: dict[str, Any], max_steps: int, workdir: Path) -> dict[str, Any]:
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer
    from trl_baseline import _llama, hf_tokenizer

    from megatron_kto.data.formats import iter_dpo_examples

    rows = [e for path in spec["train_files"] for e in iter_dpo_examples(path)]
    if not all(isinstance(getattr(e, k), str) for e in rows for k in ("prompt", "chosen")):
        raise ValueError("the TRL baseline supports plain-text pairs only")
    data = Dataset.from_dict(
        {k: [getattr(e, k) for e in rows] for k in ("prompt", "chosen", "rejected")}
    )
    base = CPOTrainer if TRL_PREFERENCE[spec["dpo"]["loss_type"]][0] == "cpo" else ORPOTrainer
    marks: dict[str, list] = {"times": [], "cpu": [], "rows": [[]]}

    class StepTimer(TrainerCallback):
        def on_train_begin(self, *_, **__) -> None:
            marks["last"] = (time.perf_counter(), time.process_time())

        def on_step_end(self, *_, **__) -> None:
            now = (time.perf_counter(), time.process_time())
            marks["times"].append(now[0] - marks["last"][0])
            marks["cpu"].append(now[1] - marks["last"][1])
            marks["last"] = now
            marks["rows"].append([])

    class Counting(base):
        """Records each micro-batch's unpadded input positions per row (chosen, rejected)."""

        def training_step(self, model, inputs, num_items_in_batch=None):
            for side in ("chosen", "rejected"):
                marks["rows"][-1] += (inputs[f"{side}_attention_mask"].sum(-1) - 1).tolist()
            return super().training_step(model, inputs, num_items_in_batch)

        def _get_train_sampler(self, train_dataset=None):  # file order, as our side
            from torch.utils.data import SequentialSampler

            return SequentialSampler(train_dataset or self.train_dataset)

    config = _config(spec, max_steps, workdir / "out")
    trainer = Counting(
        model=_llama(spec),
        args=config,
        train_dataset=data,
        processing_class=hf_tokenizer(spec["tokenizer"], workdir),
        callbacks=[StepTimer()],
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {
        "step_times": marks["times"],
        "step_cpu_times": marks["cpu"],
        "row_lengths": marks["rows"][:-1],
        "peak_memory_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },  # fmt: skip
        "trainer": base.__name__,
        "final_log": logs[-1] if logs else {},
        "batch_size": config.per_device_train_batch_size * config.gradient_accumulation_steps,
        "micro_batch_size": config.per_device_train_batch_size,
    }


def run_trl_preference(
    spec: dict[str, Any], peak_flops: float, warmup: int, steps: int
) -> dict[str, Any]:
    """TRL's CPOTrainer / ORPOTrainer for `warmup + steps` steps on the run `spec` describes
    (`preference_spec`); the timed steps' figures counted as our trainer counts its own.

    Raises:
        ValueError: an objective TRL's reference-free trainers do not run, a model shape a
            `LlamaForCausalLM` cannot mirror, or conversational rows.
    """
    import torch
    from trl_baseline import check_llama_compatible

    from megatron_kto.config.architecture import GPTArchitecture
    from megatron_kto.logging.throughput import (
        FWD_BWD_MULTIPLIER,
        architecture_flops,
        dpo_pass_tokens,
    )

    if spec["dpo"]["loss_type"] not in TRL_PREFERENCE:
        raise ValueError(
            f"--objective {spec['dpo']['loss_type']}: the TRL baseline runs "
            f"{', '.join(TRL_PREFERENCE)} (TRL's CPOTrainer / ORPOTrainer)"
        )
    if spec["precision"] != "32" and not torch.cuda.is_available():
        raise ValueError("the preference baseline runs fp32 on CPU")
    check_llama_compatible(spec["architecture"])
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(var, "1")
    with tempfile.TemporaryDirectory(prefix="trl_preference_") as tmp:
        run = _train(spec, warmup + steps, Path(tmp))
    flops = architecture_flops(
        GPTArchitecture.from_dict(spec["architecture"]), spec["padded_vocab"]
    )
    per_step = []
    for i in range(warmup, warmup + steps):
        seconds, lengths = run["step_times"][i], run["row_lengths"][i]
        forward_only, forward_backward = dpo_pass_tokens(
            flops.rows(torch.tensor(lengths, dtype=torch.long)), reference_forward=False
        )
        per_step.append(
            {
                "step": i + 1,
                "step_time": seconds,
                "samples_per_sec": spec["global_batch_size"] / seconds,
                "tokens_per_sec": sum(lengths) / seconds,
                "mfu": (forward_only + FWD_BWD_MULTIPLIER * forward_backward)
                / seconds
                / peak_flops,
                "tokens": sum(lengths),
                "cpu_time": run["step_cpu_times"][i],
            }
        )
    keys = ("versions", "trainer", "final_log", "batch_size", "micro_batch_size")
    return {"steps": per_step, "peak_memory_gb": run["peak_memory_gb"], **{k: run[k] for k in keys}}
