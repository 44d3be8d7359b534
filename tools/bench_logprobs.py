#!/usr/bin/env python
"""Peak memory and time of one KTO step with a large vocabulary: full logits vs. log-probs only
where the loss looks (completion positions, in chunks).

    python tools/bench_logprobs.py [--vocab 128256] [--hidden 256] [--layers 2] [--rows 4]
        [--seq 512] [--prompt-fraction 0.5] [--chunk-sizes 0,1024,256] [--threads N]
        [--json OUT]

Each ``--chunk-sizes`` entry (``model.logprob_chunk_size``; 0 = full logits at every position)
runs in a fresh Python process: a megatron-core GPT of the given shape (TP=1, fp32, random
init), wrapped in megatron DDP, and `MegatronGPTKTOModel` with a separate reference model take
one warm-up step, then one measured step — reference pass over samples + KL rows, policy
forward-only over the KL rows, policy forward+backward over the samples, all on synthetic rows
whose first ``prompt-fraction`` of tokens is prompt and whose last 10% is padding.

Memory: on CUDA, ``torch.cuda.max_memory_allocated`` over the measured step minus what was
allocated before it; on CPU, the process's resident-set high-water mark (``VmHWM``, reset
through ``/proc/self/clear_refs`` just before the step) minus its resident set then — i.e. what
the step itself adds on top of the weights, gradients and batch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    # Writing 5 resets VmHWM to the current resident set (Linux >= 4.0).
    Path("/proc/self/clear_refs").write_text("5")


def _batch(args: argparse.Namespace, vocab: int):
    import torch

    g = torch.Generator().manual_seed(0)
    rows, seq = args.rows, args.seq
    prompt = int(seq * args.prompt_fraction)
    padding = seq // 10

    def part():
        tokens = torch.randint(0, vocab, (rows, seq), generator=g)
        labels = torch.full_like(tokens, -100)
        labels[:, prompt - 1 : seq - padding - 1] = tokens[:, prompt : seq - padding]
        return tokens, labels

    samples, sample_labels = part()
    kl, kl_labels = part()
    lengths = torch.full((rows,), seq - padding)
    return {
        "samples": samples,
        "sample_labels": sample_labels,
        "kl_samples": kl,
        "kl_sample_labels": kl_labels,
        "position_ids": torch.arange(seq).repeat(rows, 1),
        "preference": torch.arange(rows) % 2,
        "sample_lengths": lengths,
        "kl_sample_lengths": lengths,
    }


def measure(args: argparse.Namespace, chunk_size: int) -> dict:
    """One setting, in this process."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    sys.path.insert(0, str(REPO))
    from megatron_kto.config.architecture import GPTArchitecture
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks
    from megatron_kto.models.kto_model import REF_KL, REF_SAMPLES, KTOSettings, MegatronGPTKTOModel
    from megatron_kto.models.reference import SeparateReference, copy_weights
    from megatron_kto.models.schedule import to_device
    from megatron_kto.models.training_setup import wrap_ddp
    from megatron_kto.runtime import init_runtime, teardown

    rt = init_runtime(1, 1, seed=0)
    arch = GPTArchitecture(
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=4 * args.hidden,
        num_attention_heads=max(1, args.hidden // 64),
        encoder_seq_length=args.seq,
        vocab_size=args.vocab,
    )
    policy = build_gpt_chunks(arch, ParallelLayout(), rt.device)
    reference = build_gpt_chunks(arch, ParallelLayout(), rt.device)
    copy_weights(policy, reference)
    with torch.no_grad():  # a policy away from its reference, so the loss is not just σ(0)
        g = torch.Generator().manual_seed(1)
        for p in policy[0].parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    chunks = wrap_ddp(policy, use_distributed_optimizer=False)
    settings = KTOSettings(
        beta=0.1,
        desirable_weight=1.0,
        undesirable_weight=1.0,
        loss_type="kto",
        sft_loss_weight=0.0,
        micro_batch_size=args.rows,
        forward_micro_batch_size=args.rows,
        vocab_size=args.vocab,
        logprob_chunk_size=chunk_size,
    )
    model = MegatronGPTKTOModel(chunks, SeparateReference(reference), settings)
    cpu_batch = _batch(args, args.vocab)
    cuda = rt.device.type == "cuda"

    def step() -> tuple[float, float]:
        batch = to_device(cpu_batch, rt.device)
        ref = model.get_ref_policy_logprobs(batch)
        batch[REF_SAMPLES], batch[REF_KL] = ref.chunk(2)
        for c in chunks:
            c.zero_grad_buffer()
        loss, _ = model.get_loss_and_metrics(batch, forward_only=False)
        return loss, float(batch["sample_labels"].ne(-100).sum())

    step()  # warm-up: allocator pools, lazy initialisation
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        _reset_peak()
        before = _status_kib("VmRSS") * 1024
    start = time.perf_counter()
    loss, completion_tokens = step()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if cuda else _status_kib("VmHWM") * 1024
    teardown()
    return {
        "chunk_size": chunk_size,
        "step_peak_gib": (peak - before) / 2**30,
        "baseline_gib": before / 2**30,
        "step_time_s": seconds,
        "loss": loss,
        "tokens_per_micro_batch": args.rows * args.seq,
        "completion_tokens": completion_tokens,
        "device": rt.device.type,
        "threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=128256, help="vocabulary (Llama-3: 128256)")
    parser.add_argument("--hidden", type=int, default=256, help="model width")
    parser.add_argument("--layers", type=int, default=2, help="transformer layers")
    parser.add_argument("--rows", type=int, default=4, help="rows per micro-batch (one each)")
    parser.add_argument("--seq", type=int, default=512, help="tokens per row (padded length)")
    parser.add_argument(
        "--prompt-fraction", type=float, default=0.5, help="prompt share of each row"
    )
    parser.add_argument(
        "--chunk-sizes", default="0,1024,256", help="logprob_chunk_size values (0 = full logits)"
    )
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 0 < args.prompt_fraction < 0.9:
        parser.error("--prompt-fraction must be in (0, 0.9)")

    if args.worker is not None:
        print(json.dumps(measure(args, args.worker)))
        return 0

    results = []
    for chunk in (int(c) for c in args.chunk_sizes.split(",")):
        cmd = [sys.executable, __file__, *(argv or sys.argv[1:]), "--worker", str(chunk)]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        if args.threads:
            env["OMP_NUM_THREADS"] = str(args.threads)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            return proc.returncode
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))

    first = results[0]
    print(
        f"one KTO step (ref fwd 2B rows, policy fwd B KL rows, policy fwd+bwd B rows), "
        f"vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, {args.rows} rows x "
        f"{args.seq} tokens per pass ({first['completion_tokens']:.0f} completion tokens), "
        f"fp32, {first['device']}, {first['threads']} threads"
    )
    print(f"{'logprob_chunk_size':>20} {'step peak (GiB)':>16} {'step time (s)':>14} {'loss':>12}")
    for r in results:
        label = "0 (full logits)" if r["chunk_size"] == 0 else str(r["chunk_size"])
        print(
            f"{label:>20} {r['step_peak_gib']:>16.3f} {r['step_time_s']:>14.2f} {r['loss']:>12.6f}"
        )
    print(
        "(step peak: memory the step adds above weights, grads and batch; "
        + ("CUDA max allocated)" if first["device"] == "cuda" else "process RSS high-water mark)")
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
