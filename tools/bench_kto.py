"""Benchmark KTO training: samples/s, tokens/s, MFU and peak memory; TRL side by side on CPU.

    python tools/bench_kto.py [--warmup 5] [--steps 20] [--trl] [--json OUT] [hydra overrides...]
    torchrun --nproc_per_node N tools/bench_kto.py model.tensor_model_parallel_size=2 ...

Our side runs the real training path (`run_alignment`, conf/gpt_kto.yaml + overrides) for
warm-up + timed steps and summarises the per-step figures it logs to metrics.jsonl (median and
mean over the timed steps). With `--trl` (one process) it then trains TRL's `KTOTrainer` on the
same Llama shape, data, β, learning rate, global batch and max_length, timing its steps with a
callback, and prints the ratio. The work differs by design: TRL runs the KL rows through
autograd with the samples (fwd+bwd over 2B rows), ours computes them forward-only (fwd over B
rows, fwd+bwd over B) — that is the point of the comparison. TRL's tokenizer is a whitespace
word-level one over the same words (the bundled data's words are single tokens of our
SentencePiece model), so sequence lengths match.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIGURES = ("samples_per_sec", "tokens_per_sec", "mfu", "peak_memory_gb", "step_time")


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from megatron_kto.config.schema import register

    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="gpt_kto", overrides=overrides)


def _summary(rows: list[dict], keys=FIGURES) -> dict[str, dict[str, float]]:
    out = {}
    for key in keys:
        values = [r[key] for r in rows if key in r]
        if values:
            out[key] = {"median": statistics.median(values), "mean": statistics.fmean(values)}
    return out


def bench_ours(overrides: list[str], warmup: int, steps: int) -> dict:
    """Train warm-up + timed steps with the real CLI path; summarise the timed steps."""
    import os

    from megatron_kto.run import run_alignment

    log_dir = Path(tempfile.mkdtemp(prefix="bench_kto_"))
    cfg = _compose(
        [
            f"exp_manager.explicit_log_dir={log_dir}",
            f"trainer.kto.max_steps={warmup + steps}",
            "trainer.kto.val_check_interval=100000",
            "trainer.kto.save_interval=0",
            "exp_manager.create_checkpoint_callback=false",
            "exp_manager.create_tensorboard_logger=false",
            "exp_manager.resume_if_exists=false",
            "model.data.data_prefix.validation=[]",
            *overrides,
        ]
    )
    run_alignment(cfg, "kto")
    if int(os.environ.get("RANK", "0")) != 0:
        return {}
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if r["split"] == "train" and r["step"] > warmup]
    return {"config": cfg, "steps": len(timed), **_summary(timed)}


def _word_tokenizer(files: list[Path]):
    """A word-level fast tokenizer over the data's words (TRL needs a transformers tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = set()
    for path in files:
        for line in path.read_text().splitlines():
            row = json.loads(line)
            words.update((row["prompt"] + " " + row["completion"]).split())
    vocab = {"<pad>": 0, "<unk>": 1, "<s>": 2, "</s>": 3}
    for word in sorted(words):
        vocab[word] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
    )


def bench_trl(cfg, warmup: int, steps: int, vocab_size: int) -> dict:
    """TRL KTOTrainer on the same shape/data/hyper-parameters; per-step wall times."""
    import torch
    from datasets import load_dataset
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback
    from trl import KTOConfig, KTOTrainer

    m = cfg.model
    files = [REPO / f for f in m.data.data_prefix.train]
    tokenizer = _word_tokenizer(files)
    config = LlamaConfig(
        hidden_size=m.hidden_size,
        intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups or m.num_attention_heads,
        vocab_size=max(vocab_size, len(tokenizer)),
        max_position_embeddings=m.encoder_seq_length,
        rope_theta=float(m.rotary_base),
        tie_word_embeddings=m.share_embeddings_and_output_weights,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(m.seed)
    model = LlamaForCausalLM(config)
    dataset = load_dataset("json", data_files=[str(f) for f in files], split="train")
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.t)

    args = KTOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench_trl_"),
        per_device_train_batch_size=m.global_batch_size,
        gradient_accumulation_steps=1,
        learning_rate=m.optim.lr,
        max_steps=warmup + steps,
        beta=m.kto.ref_policy_kl_penalty,
        desirable_weight=m.kto.desirable_loss_weight,
        undesirable_weight=m.kto.undesirable_loss_weight,
        max_length=m.data.max_length,
        logging_steps=1000,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        seed=m.seed,
        disable_tqdm=True,
    )
    trainer = KTOTrainer(
        model=model,
        ref_model=copy.deepcopy(model),
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Timer()],
    )
    trainer.train()
    timed = times[warmup:]
    per_step = statistics.median(timed)
    return {
        "steps": len(timed),
        "step_time": {"median": per_step, "mean": statistics.fmean(timed)},
        "samples_per_sec": {
            "median": m.global_batch_size / per_step,
            "mean": statistics.fmean(m.global_batch_size / t for t in timed),
        },
    }


def _print_table(ours: dict, trl: dict | None) -> None:
    print(
        f"\n{'figure (timed steps)':<24}{'ours median':>14}{'ours mean':>14}"
        + (f"{'TRL median':>14}" if trl else "")
    )
    for key in FIGURES:
        if key not in ours:
            continue
        row = f"{key:<24}{ours[key]['median']:>14.4g}{ours[key]['mean']:>14.4g}"
        if trl and key in trl:
            row += f"{trl[key]['median']:>14.4g}"
        print(row)
    if trl:
        ratio = ours["samples_per_sec"]["median"] / trl["samples_per_sec"]["median"]
        print(f"\nsamples/s ours / TRL (median): {ratio:.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--trl", action="store_true", help="also run TRL's KTOTrainer (1 process)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("overrides", nargs="*", help="hydra overrides for conf/gpt_kto.yaml")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))

    ours = bench_ours(args.overrides, args.warmup, args.steps)
    if not ours:  # not rank 0
        return 0
    cfg = ours.pop("config")
    from megatron_kto.data.tokenizers import load_tokenizer

    vocab = load_tokenizer(
        cfg.model.tokenizer.library, str(REPO / cfg.model.tokenizer.model), None
    ).vocab_size
    trl = bench_trl(cfg, args.warmup, args.steps, vocab) if args.trl else None
    print(
        f"KTO benchmark: {cfg.model.num_layers} layers, hidden {cfg.model.hidden_size}, global batch "
        f"{cfg.model.global_batch_size}, micro batch {cfg.model.micro_batch_size}, "
        f"reference {cfg.model.kto.reference_policy}, {args.steps} timed steps after {args.warmup}"
    )
    _print_table(ours, trl)
    if args.json:
        args.json.write_text(json.dumps({"ours": ours, "trl": trl}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
