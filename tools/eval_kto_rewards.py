#!/usr/bin/env python
"""How well a trained policy's implicit reward separates desirable from undesirable examples.

    python tools/eval_kto_rewards.py --policy results/gpt_kto [--reference CKPT] [--data FILE ...]
    torchrun --nproc_per_node N tools/eval_kto_rewards.py --policy ... --tensor-model-parallel-size T

The implicit reward of an example is β·(log π(y|x) − log π_ref(y|x)), summed over completion
tokens. Prints the ROC AUC (0.5 = chance), the accuracy of "reward > 0 means desirable", and
the mean reward of each class.

A reference-free objective (`--algorithm dpo` on a run whose `model.dpo.loss_type` is cpo,
simpo or orpo, or `--reference none`) has no reference: the reward is the policy's own β·log π
(per-token mean for simpo / orpo, or with the run's `preference_average_log_probs`, as its
`rewards/*` metrics), and the report is its AUC and the margin between the classes' mean
rewards (no sign accuracy: log π is never above 0). No reference weights are read.

Settings not given on the command line come from the policy checkpoint's saved run config
(`config.yaml` in a training checkpoint): the reference is the run's
`pretrained_checkpoint.restore_from_path`, the data its validation files, β, tokenizer and
length limits its own. `--policy` accepts a run directory, a checkpoints root, a `step_<N>`
directory or a converted checkpoint. Exit code 2 and one `error:` line on bad input.

`--precision` defaults to the run's `trainer.precision` (so the numbers are the ones its
validation computed), and without a run config follows the device as the trainer does (bf16 on
CUDA, 32 on a CPU). The attention backend (`--attention-backend`, default auto) is decided as
for training (`megatron_kto/runtime/attention_backend.py`) for packed passes at that precision,
before any process group exists; the choice is printed with the results.

On the checkpoint and data of a run's validation, the mean rewards and log-probs per class are
the run's `val` row (which covers the full global batches, `limit_val_batches` of them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_kto.checkpointing import files  # noqa: E402
from megatron_kto.checkpointing.errors import CheckpointError  # noqa: E402
from megatron_kto.config.validate import ConfigError  # noqa: E402
from megatron_kto.data.errors import DataFormatError  # noqa: E402
from megatron_kto.losses.dpo_types import (  # noqa: E402
    averages_log_probs,
    loss_type_names,
    needs_reference,
)
from megatron_kto.runtime.attention_backend import ATTENTION_BACKENDS  # noqa: E402


class UsageError(ValueError):
    """A setting is missing or invalid."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--policy",
        required=True,
        help="trained checkpoint, run directory or Hugging Face directory (a run's hf/ too)",
    )
    p.add_argument(
        "--reference",
        help="reference weights (default: the run's restore_from_path; none for a "
        "reference-free objective: rewards are β·log π of the policy alone)",
    )
    p.add_argument("--data", nargs="+", help="labelled data files (default: the run's validation)")
    p.add_argument("--algorithm", choices=("kto", "dpo"), default="kto", help="whose β to read")
    p.add_argument("--beta", type=float, help="β (default: the run's ref_policy_kl_penalty)")
    p.add_argument("--tokenizer", help="tokenizer model (default: the run's)")
    p.add_argument("--tokenizer-library", choices=("sentencepiece", "huggingface"))
    p.add_argument("--max-length", type=int, help="prompt + completion tokens (default: the run's)")
    p.add_argument("--batch-size", type=int, default=8, help="examples per forward pass per rank")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument(
        "--context-parallel-size",
        type=int,
        default=1,
        help="CP: ranks each row is split over along the sequence (for very long rows)",
    )
    p.add_argument(
        "--precision",
        choices=("32", "bf16", "16"),
        help="model precision (default: the run's trainer.precision, else bf16 on CUDA, 32 on CPU)",
    )
    p.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="attention backend (default: auto, decided as for training)",
    )
    p.add_argument(
        "--expert-model-parallel-size",
        type=int,
        default=1,
        help="EP of mixture-of-experts models (divides the experts and world / (TP x PP))",
    )
    p.add_argument(
        "--expert-tensor-parallel-size",
        type=int,
        default=None,
        help="expert TP of mixture-of-experts models (default: the same as TP; "
        "ETP x EP divides world / PP)",
    )
    p.add_argument("--no-cache", action="store_true", help="do not write tokenised caches")
    p.add_argument("--json", type=Path, help="write the summary (and settings) as JSON here")
    p.add_argument("--per-example", type=Path, help="write one JSON line per example here")
    return p.parse_args(argv)


def _run_config(policy_dir: Path) -> Any | None:
    """The training run's config: the checkpoint's, or for a run's Hugging Face output
    (`exp_manager.save_hf`) the config of the checkpoint its `hf_export.json` names."""
    import json

    from omegaconf import OmegaConf

    path = policy_dir / files.CONFIG
    record = policy_dir / "hf_export.json"
    if not path.is_file() and record.is_file():
        checkpoint = json.loads(record.read_text()).get("checkpoint")
        path = Path(checkpoint) / files.CONFIG if checkpoint else path
    return OmegaConf.load(path) if path.is_file() else None


def _own_tokenizer(policy_dir: Path) -> bool:
    """Whether `policy_dir` is a Hugging Face directory carrying its tokenizer."""
    return (policy_dir / "config.json").is_file() and any(
        (policy_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")
    )


def resolve_settings(args: argparse.Namespace, policy_dir: Path) -> dict[str, Any]:
    """Command-line values, else the run config's; raises UsageError naming what is missing."""
    from omegaconf import OmegaConf

    from megatron_kto.data.pipeline import resolve_path

    cfg = _run_config(policy_dir)

    def run_value(key: str, default: Any = None) -> Any:
        value = OmegaConf.select(cfg, key) if cfg is not None else None
        return default if value is None else value

    def need(value: Any, flag: str, key: str) -> Any:
        if value is None or (isinstance(value, list | tuple) and not value):
            source = (
                f"{policy_dir / files.CONFIG} has no {key}"
                if cfg is not None
                else f"{policy_dir} has no {files.CONFIG} to take it from"
            )
            raise UsageError(f"{flag}: required ({source})")
        return value

    algo = args.algorithm
    data = args.data or list(run_value("model.data.data_prefix.validation", []))
    beta = args.beta if args.beta is not None else run_value(f"model.{algo}.ref_policy_kl_penalty")
    own = args.tokenizer is None and _own_tokenizer(policy_dir)
    tokenizer = args.tokenizer or (policy_dir if own else run_value("model.tokenizer.model"))
    loss_types = loss_type_names(run_value("model.dpo.loss_type", "sigmoid"))
    run_free = algo == "dpo" and not needs_reference(loss_types)
    if run_free and args.reference not in (None, "none"):
        raise UsageError(
            f"--reference: the run's model.dpo.loss_type {list(loss_types)} reads no reference "
            "(its rewards are β·log π of the policy); leave --reference out"
        )
    reference_free = run_free or args.reference == "none"
    reference = args.reference or run_value("pretrained_checkpoint.restore_from_path")
    average = bool(run_value(f"model.{algo}.preference_average_log_probs", False))
    settings = {
        "policy": str(policy_dir),
        "reference": None
        if reference_free
        else str(need(reference, "--reference", "pretrained_checkpoint.restore_from_path")),
        "average_log_probs": average or (algo == "dpo" and averages_log_probs(loss_types)),
        "data": [
            str(resolve_path(f).resolve())
            for f in need(data, "--data", "model.data.data_prefix.validation")
        ],
        "beta": float(need(beta, "--beta", f"model.{algo}.ref_policy_kl_penalty")),
        "tokenizer": str(
            resolve_path(need(tokenizer, "--tokenizer", "model.tokenizer.model")).resolve()
        ),
        "tokenizer_library": args.tokenizer_library
        or ("huggingface" if own else run_value("model.tokenizer.library", "sentencepiece")),
        "chat_template": run_value("model.tokenizer.chat_template"),
        "max_length": args.max_length or run_value("model.data.max_length"),
        "max_prompt_length": run_value("model.data.max_prompt_length"),
        "truncation_mode": run_value("model.data.truncation_mode", "keep_end"),
        "precision": _precision(args.precision, run_value("trainer.precision")),
        "attention_backend": args.attention_backend,
        "context_parallel_size": args.context_parallel_size,
    }
    if settings["beta"] <= 0:
        raise UsageError(f"--beta: must be > 0, got {settings['beta']}")
    for path in [*settings["data"], settings["tokenizer"]]:
        if not Path(path).exists():
            raise UsageError(f"{path}: not found")
    return settings


def _precision(flag: str | None, run: Any) -> str:
    """--precision, else the run's trainer.precision, else what the trainer's default gives here."""
    from megatron_kto.config.machine import canonical_precision, device_precision
    from megatron_kto.runtime.gpu_settings import Accelerator

    if flag is not None:
        return flag
    if run is not None:
        return canonical_precision(run)
    return device_precision(Accelerator.detect().cuda)


def choose_attention(settings: dict[str, Any]):
    """The attention backend of the passes (packed, at the chosen precision) on this machine.

    Raises:
        UsageError: naming --attention-backend / --precision when it cannot run here.
    """
    from megatron_kto.checkpointing.locate import read_architecture
    from megatron_kto.eval.implicit_reward import PACKED_PASSES
    from megatron_kto.runtime.attention_backend import (
        AttentionFeatures,
        SettingNames,
        choose_attention_backend,
    )
    from megatron_kto.runtime.gpu_settings import Accelerator

    try:
        arch = read_architecture(Path(settings["policy"]))
        return choose_attention_backend(
            settings["attention_backend"],
            precision=settings["precision"],
            packed=PACKED_PASSES,
            accelerator=Accelerator.detect(),
            features=AttentionFeatures.of(arch),
            context_parallel_size=settings["context_parallel_size"],
            names=SettingNames("--attention-backend", "--precision", packing=None),
        )
    except ValueError as e:
        raise UsageError(str(e)) from e


def check_layout(args: argparse.Namespace, settings: dict[str, Any]) -> None:
    """The requested TP/PP fit the world size and both models' architectures — checked from
    their architecture.json before any process group or model exists (one line, not a
    traceback per rank from inside megatron-core)."""
    from megatron_kto.checkpointing.locate import (
        ARCH_FILE,
        read_architecture,
        resolve_pretrained_dir,
    )
    from megatron_kto.config.layout import check_expert_layout
    from megatron_kto.config.layout import check_layout as check

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp = args.context_parallel_size
    flags = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for flag, value in zip((*flags[:2], "--context-parallel-size"), (tp, pp, cp)):
        if value < 1:
            raise UsageError(f"{flag}: must be >= 1, got {value}")
    if world % (tp * pp * cp):
        raise UsageError(
            f"--tensor-model-parallel-size: {world} processes are not divisible by TP ({tp}) x "
            f"PP ({pp})" + (f" x CP ({cp})" if cp > 1 else "")
        )
    reference = settings["reference"]
    models = [Path(settings["policy"])]
    models += [resolve_pretrained_dir(reference)] if reference is not None else []
    for ckpt in models:
        check(
            read_architecture(ckpt),
            tp,
            pp,
            None,
            architecture_file=str(ckpt / ARCH_FILE),
            keys=flags,
        )
        try:
            check_expert_layout(
                read_architecture(ckpt),
                args.expert_model_parallel_size,
                world // (tp * pp),  # megatron-core's expert layout spans DP x CP
                architecture_file=str(ckpt / ARCH_FILE),
                key="--expert-model-parallel-size",
                tp=tp,
                etp=args.expert_tensor_parallel_size,
                etp_key="--expert-tensor-parallel-size",
            )
        except ConfigError as e:
            raise UsageError(str(e)) from None


def evaluate(args: argparse.Namespace) -> int:
    from megatron_kto.checkpointing.locate import resolve_pretrained_dir

    if not Path(args.policy).exists():
        raise UsageError(f"--policy: {args.policy} not found")
    policy_dir = resolve_pretrained_dir(args.policy)
    settings = resolve_settings(args, policy_dir)
    check_layout(args, settings)
    attention = choose_attention(settings)

    from megatron_kto.data.tokenizers import load_tokenizer
    from megatron_kto.eval.classification import summarize
    from megatron_kto.eval.implicit_reward import implicit_rewards
    from megatron_kto.runtime import init_runtime, teardown

    runtime = init_runtime(
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        expert_parallel_size=args.expert_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
    )
    try:
        tokenizer = load_tokenizer(
            settings["tokenizer_library"], settings["tokenizer"], settings["chat_template"]
        )
        result = implicit_rewards(
            policy_dir,
            settings["reference"],
            settings["data"],
            tokenizer,
            runtime,
            beta=settings["beta"],
            max_length=settings["max_length"],
            max_prompt_length=settings["max_prompt_length"],
            truncation_mode=settings["truncation_mode"],
            batch_size=args.batch_size,
            use_cache=not args.no_cache,
            precision=settings["precision"],
            attention_backend=settings["attention_backend"],
            average_log_probs=settings["average_log_probs"],
        )
        if result.labels.all() or not result.labels.any():
            raise UsageError(
                f"{', '.join(settings['data'])}: needs desirable and undesirable examples, got "
                f"{int(result.labels.sum())} desirable of {result.labels.size}"
            )
        free = settings["reference"] is None
        report = summarize(result.rewards, result.labels, sign_accuracy=not free)
        if runtime.is_rank0:
            reference = settings["reference"] or "none (reference-free: rewards are β·log π)"
            print(f"policy: {policy_dir}\nreference: {reference}")
            print(f"data: {', '.join(settings['data'])} (beta {settings['beta']})")
            print(f"precision {settings['precision']}, attention {attention.describe()}")
            print(report.format(), flush=True)
            if args.json:
                args.json.write_text(
                    json.dumps({**report.to_dict(), "settings": settings}, indent=2)
                )
            if args.per_example:
                with open(args.per_example, "w", encoding="utf-8") as f:
                    for i in range(len(result.rewards)):
                        row = {
                            "index": i,
                            "label": bool(result.labels[i]),
                            "reward": float(result.rewards[i]),
                            "policy_logps": float(result.policy_logps[i]),
                            "reference_logps": None if free else float(result.reference_logps[i]),
                            "num_tokens": int(result.num_tokens[i]),
                        }
                        f.write(json.dumps(row) + "\n")
    finally:
        teardown()
    return 0


def main(argv: list[str] | None = None) -> int:
    from megatron_kto.console import quiet_third_party

    quiet_third_party()
    args = parse_args(argv)
    try:
        return evaluate(args)
    except (UsageError, ConfigError, CheckpointError, DataFormatError) as e:
        from megatron_kto.console import exit_with_user_error

        exit_with_user_error(str(e))  # one line from rank 0: every rank finds the same problem


if __name__ == "__main__":
    sys.exit(main())
