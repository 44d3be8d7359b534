#!/usr/bin/env python
"""Host memory per rank while loading a Hugging Face directory directly, under several layouts.

    python tools/measure_hf_load.py --hf-dir DIR [--layouts tp1,tp2,pp2]
    python tools/measure_hf_load.py --make-llama DIR [--hidden 768 --layers 8 --vocab 32000]

For each layout the tool launches its ranks (`torch.distributed.run`, one process per rank, CPU),
and each rank builds its model shard, then loads the directory with `load_hf_model`
(`pretrained_checkpoint.restore_from_path=<dir>`). Per rank it reports:

- `params`: bytes of the rank's parameters (its shard, built before loading);
- `read`: bytes of the slices it copied out of the safetensors files (`LoadStats.bytes_read`);
- `rss+`: the rise of the process's peak resident memory during the load — Linux's VmHWM, reset
  to the current RSS (`/proc/self/clear_refs` 5) just before the load and read after it, so it
  counts everything the load touched at once: slices, fused tensors, memory-mapped file pages;
- `largest`: the largest single parameter's slices (what the load holds at once by design).

The model's size is the sum of the files' tensors (`file bytes`). A rank that read the whole
model, or held it while loading, would show `read` or `rss+` near that; a TP=2 rank reads about
half, a PP=2 stage its own layers, and `rss+` stays near `largest`.
`--make-llama` writes a random `transformers` Llama (fp32 safetensors, sharded at 200 MB) to
measure on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _worker(hf_dir: str, tp: int, pp: int, out_dir: str) -> None:
    import torch

    from megatron_kto.checkpointing.hf_source import load_hf_model
    from megatron_kto.checkpointing.locate import read_architecture
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks, unwrap
    from megatron_kto.runtime import init_runtime, teardown

    rt = init_runtime(tp, pp, seed=0)
    arch = read_architecture(hf_dir)
    layout = ParallelLayout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    chunks = build_gpt_chunks(arch, layout, rt.device)
    params = sum(p.numel() * p.element_size() for c in chunks for p in unwrap(c).parameters())
    rss_before = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    stats = load_hf_model(hf_dir, chunks)
    peak = _status_kb("VmHWM")
    record = {
        "rank": torch.distributed.get_rank(),
        "params": params,
        "read": stats.bytes_read,
        "largest": stats.largest_read,
        "rss_rise": (peak - rss_before) * 1024,
    }
    (Path(out_dir) / f"{record['rank']}.json").write_text(json.dumps(record))
    teardown()


def _file_bytes(hf_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in hf_dir.glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                total += _slice_bytes(f.get_slice(key))
    return total


def _slice_bytes(lazy) -> int:
    sizes = {"F32": 4, "BF16": 2, "F16": 2}
    numel = 1
    for n in lazy.get_shape():
        numel *= n
    return numel * sizes[lazy.get_dtype()]


def _make_llama(out: Path, hidden: int, layers: int, vocab: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=4,  # GQA; divides the heads of every hidden size a multiple of 256
        vocab_size=vocab,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(out, max_shard_size="200MB")
    print(f"wrote {out} ({sum(p.numel() for p in LlamaForCausalLM(config).parameters()):,} params)")


def _measure(hf_dir: Path, layouts: list[str]) -> None:
    total = _file_bytes(hf_dir)
    print(f"{hf_dir}: file bytes {total / 2**20:.1f} MiB")
    print(f"{'layout':<7}{'rank':>5}{'params MiB':>12}{'read MiB':>10}{'read/model':>12}"
          f"{'rss+ MiB':>10}{'largest MiB':>13}")  # fmt: skip
    for name in layouts:
        tp, pp = LAYOUTS[name]
        with tempfile.TemporaryDirectory() as out:
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={tp * pp}", __file__, "--worker", str(hf_dir), str(tp),
                   str(pp), out]  # fmt: skip
            proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"{name}: the ranks failed:\n{proc.stderr[-3000:]}")
            for path in sorted(Path(out).glob("*.json"), key=lambda p: int(p.stem)):
                r = json.loads(path.read_text())
                mib = 2**20
                print(f"{name:<7}{r['rank']:>5}{r['params'] / mib:>12.1f}{r['read'] / mib:>10.1f}"
                      f"{r['read'] / total:>12.3f}{r['rss_rise'] / mib:>10.1f}"
                      f"{r['largest'] / mib:>13.1f}")  # fmt: skip


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hf-dir", type=Path)
    parser.add_argument("--make-llama", type=Path)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--layouts", default="tp1,tp2,pp2")
    args = parser.parse_args()
    if args.make_llama:
        _make_llama(args.make_llama, args.hidden, args.layers, args.vocab)
        return
    if not args.hf_dir:
        parser.error("give --hf-dir (or --make-llama)")
    _measure(args.hf_dir, args.layouts.split(","))


if __name__ == "__main__":
    main()
