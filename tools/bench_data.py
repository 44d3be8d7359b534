#!/usr/bin/env python
"""Benchmark the KTO data pipeline: first build (tokenisation) and cache-hit start-up.

    python tools/bench_data.py [--rows 200000] [--tokenizer-library sentencepiece]
        [--tokenizer-model examples/data/tokenizer/tiny_sp.model]

Writes a synthetic JSONL of ``--rows`` rows into a temporary directory, then reports
(1) the first build: read + validate + tokenise + write the cache, in examples/s;
(2) a cache hit in this process; (3) a cache hit in a fresh Python process, including imports
(what a restarted training job pays); (4) random access and collate speed.
"""

from __future__ import annotations

import argparse
import functools
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_kto.data import synthetic  # noqa: E402
from megatron_kto.data.collate import kto_custom_collate  # noqa: E402
from megatron_kto.data.dataset import build_kto_dataset  # noqa: E402
from megatron_kto.data.tokenizers import load_tokenizer  # noqa: E402

MAX_LENGTH = 64
_CHILD = """
import sys, time
start = time.perf_counter()
sys.path.insert(0, {repo!r})
from megatron_kto.data.dataset import build_kto_dataset
from megatron_kto.data.tokenizers import load_tokenizer
tok = load_tokenizer({library!r}, {model!r})
built = time.perf_counter()
ds, _ = build_kto_dataset({data!r}, tok, {max_length})
print(len(ds), built - start, time.perf_counter() - built)
"""


def _timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--tokenizer-library", default="sentencepiece")
    default_model = REPO / "examples" / "data" / "tokenizer" / "tiny_sp.model"
    parser.add_argument("--tokenizer-model", default=str(default_model))
    args = parser.parse_args(argv)

    tok = load_tokenizer(args.tokenizer_library, args.tokenizer_model)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "bench.jsonl"
        _, seconds = _timed(lambda: synthetic.write_jsonl(synthetic.kto_rows(args.rows, 0), data))
        size_mb = data.stat().st_size / 2**20
        print(f"generated {args.rows} rows ({size_mb:.1f} MiB) in {seconds:.2f} s")

        (dataset, stats), first = _timed(lambda: build_kto_dataset(data, tok, MAX_LENGTH))
        print(
            f"first build (read + validate + tokenise + write cache): {first:.2f} s, "
            f"{stats.examples / first:,.0f} examples/s"
        )
        _, hit = _timed(lambda: build_kto_dataset(data, tok, MAX_LENGTH))
        print(f"cache hit, same process: {hit:.3f} s")

        child = _CHILD.format(
            repo=str(REPO), library=args.tokenizer_library, model=args.tokenizer_model,
            data=str(data), max_length=MAX_LENGTH,
        )  # fmt: skip
        out, wall = _timed(
            lambda: subprocess.run([sys.executable, "-c", child], capture_output=True, text=True)
        )
        if out.returncode != 0:
            print(out.stderr, file=sys.stderr)
            return 1
        rows, imports, load = out.stdout.split()
        print(
            f"cache hit, fresh process: {wall:.2f} s wall (imports + tokenizer {float(imports):.2f} s, "
            f"dataset {float(load):.3f} s) for {rows} examples"
        )

        indices = list(range(0, len(dataset), max(1, len(dataset) // 20_000)))
        _, access = _timed(lambda: [dataset[i] for i in indices])
        print(f"random access: {len(indices) / access:,.0f} items/s")
        collate = functools.partial(kto_custom_collate, pad_id=tok.pad_id)
        batches = [[dataset[i] for i in range(b, b + 64)] for b in range(0, 64 * 100, 64)]
        _, collated = _timed(lambda: [collate(b) for b in batches])
        print(f"kto_custom_collate, batch 64: {len(batches) / collated:,.0f} batches/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
