#!/usr/bin/env python
"""Context parallelism on a long row: peak activation memory per rank at CP = 1, 2, 4.

    python tools/bench_cp_memory.py [--tokens 4096] [--cp 1 2 4] [--hidden 256] [--layers 4]
        [--heads 8] [--groups 2] [--packed | --padded] [--json out.json]

For each CP size, CP gloo processes (DP = 1) build the same small GPT (SDPA attention, fp32,
megatron-core local layers, RoPE, GQA) and run one KTO training step — reference pass, KL pass,
forward + backward — on one global batch of two rows of `--tokens` tokens each (prompt a tenth
of the row), micro-batch 1, through `MegatronGPTKTOModel` and megatron-core's schedule, as the
trainer does. It reports per rank:

* the peak of live torch tensor bytes during the training pass (forward + backward), minus what
  was alive when it started (model state, the batch) — the activations a GPU would hold
  (`planning.measure.AllocationTrace`, the same measure `tools/bench_lora_memory.py` uses);
* the step's loss, which must be the same at every CP size (it is printed as a check).

On CPU the numbers are torch allocations, not a GPU's: gloo's all-gather stages full-size
copies through torch's allocator (NCCL's do not), and CPU SDPA's kernels are not flash-attn's.
The comparison between CP sizes is what the tool is for.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MIB = 1024 * 1024


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per row")
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="CP sizes to measure")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--groups", type=int, default=2, help="KV groups (GQA)")
    p.add_argument("--vocab", type=int, default=512)
    layout = p.add_mutually_exclusive_group()
    layout.add_argument("--packed", dest="pack", action="store_true", default=True)
    layout.add_argument("--padded", dest="pack", action="store_false")
    p.add_argument("--json", type=Path, help="write the results as JSON here")
    return p.parse_args(argv)


def _examples(args: argparse.Namespace) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    prompt = args.tokens // 10
    return [
        {
            "prompt_ids": torch.randint(1, args.vocab, (prompt,), generator=g).tolist(),
            "completion_ids": torch.randint(
                1, args.vocab, (args.tokens - prompt,), generator=g
            ).tolist(),
            "label": i == 0,
        }
        for i in range(2)
    ]


def _worker(rank: int, cp: int, port: int, args: argparse.Namespace, out: dict) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(cp), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1"
    )
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    from megatron_kto.config.architecture import GPTArchitecture
    from megatron_kto.data.collate import kto_custom_collate
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks
    from megatron_kto.models.kto_model import (
        REF_KL,
        REF_SAMPLES,
        KTOSettings,
        MegatronGPTKTOModel,
    )
    from megatron_kto.models.schedule import to_device
    from megatron_kto.models.training_setup import wrap_ddp
    from megatron_kto.planning.measure import AllocationTrace
    from megatron_kto.runtime import init_runtime, teardown

    with AllocationTrace() as trace:
        rt = init_runtime(seed=1, device="cpu", context_parallel_size=cp)
        arch = GPTArchitecture(
            num_layers=args.layers,
            hidden_size=args.hidden,
            ffn_hidden_size=4 * args.hidden,
            num_attention_heads=args.heads,
            num_query_groups=args.groups,
            encoder_seq_length=args.tokens,
            vocab_size=args.vocab,
            padded_vocab_size=args.vocab,
        )
        layout = ParallelLayout(
            context_parallel_size=cp, attention_backend="sdpa", pack_sequences=args.pack
        )
        chunks = wrap_ddp(
            build_gpt_chunks(arch, layout, rt.device), use_distributed_optimizer=False
        )
        reference = build_gpt_chunks(arch, layout, rt.device)

        class Reference:
            def log_probs(self, batch, forward):
                return forward(reference)

        settings = KTOSettings(
            beta=0.1, desirable_weight=1.0, undesirable_weight=1.0, loss_type="kto",
            sft_loss_weight=0.0, micro_batch_size=1, forward_micro_batch_size=1,
            vocab_size=args.vocab, pack_sequences=args.pack,
        )  # fmt: skip
        model = MegatronGPTKTOModel(chunks, Reference(), settings)
        batch = to_device(kto_custom_collate(_examples(args), pad_id=0), rt.device)
        refs = model.get_ref_policy_logprobs(batch)
        batch[REF_SAMPLES], batch[REF_KL] = refs[:2], refs[2:]
        with trace.window():
            loss, _ = model.get_loss_and_metrics(batch, forward_only=False)
    out[rank] = {"peak_mib": (trace.peak - trace.at_start) / MIB, "loss": float(loss)}
    teardown()


def measure(cp: int, args: argparse.Namespace) -> list[dict]:
    """Per-rank results of one CP size (CP processes)."""
    from megatron_kto.runtime.distributed import rendezvous_port

    port = rendezvous_port()
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        out = manager.dict()
        procs = [ctx.Process(target=_worker, args=(r, cp, port, args, out)) for r in range(cp)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"CP={cp}: a rank failed")
        return [dict(out[r]) for r in range(cp)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = {cp: measure(cp, args) for cp in args.cp}
    base = max(r["peak_mib"] for r in results[args.cp[0]])
    layout = "packed" if args.pack else "padded"
    print(
        f"rows of {args.tokens} tokens ({layout}), {args.layers} layers x hidden {args.hidden}, "
        f"{args.heads} heads / {args.groups} KV groups, vocab {args.vocab}, fp32, SDPA"
    )
    print("| CP | peak activations per rank (MiB, max over ranks) | vs first | loss |")
    print("|---:|---:|---:|---:|")
    for cp, ranks in results.items():
        peak = max(r["peak_mib"] for r in ranks)
        print(f"| {cp} | {peak:.1f} | {peak / base:.2f} | {ranks[0]['loss']:.6f} |")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": None}, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
