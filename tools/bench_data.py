#!/usr/bin/env python
"""Benchmark the KTO data pipeline: first build (tokenisation) and cache-hit start-up.

    python tools/bench_data.py [--rows 200000] [--max-length 64]
        [--tokenizer-library sentencepiece]
        [--tokenizer-model examples/data/tokenizer/tiny_sp.model]

Writes a synthetic JSONL of ``--rows`` rows into a temporary directory, then reports
(1) the first build: read + validate + tokenise + write the cache, in examples/s;
(2) a cache hit in this process; (3) a cache hit in a fresh Python process, including imports
(what a restarted training job pays); (4) random access and collate speed, with KL partners
given per row as the training loader gives them (``data.kl_pairs.BatchKLPartners``).
Timings on a shared machine are noisy.
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
from megatron_kto.data.kl_pairs import BatchKLPartners  # noqa: E402
from megatron_kto.data.tokenizers import load_tokenizer  # noqa: E402

COLLATE_BATCH = 64
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
    parser.add_argument(
        "--rows", type=int, default=200_000, help="synthetic rows to generate (default 200000)"
    )
    parser.add_argument(
        "--max-length", type=int, default=64, help="prompt + completion tokens (default 64)"
    )
    parser.add_argument(
        "--tokenizer-library", default="sentencepiece", help="'sentencepiece' or 'huggingface'"
    )
    default_model = REPO / "examples" / "data" / "tokenizer" / "tiny_sp.model"
    parser.add_argument(
        "--tokenizer-model",
        default=str(default_model),
        help="SentencePiece .model or tokenizer.json (default: the bundled tiny model)",
    )
    args = parser.parse_args(argv)
    if args.rows < 2 * COLLATE_BATCH:
        parser.error(f"--rows must be at least {2 * COLLATE_BATCH}")

    tok = load_tokenizer(args.tokenizer_library, args.tokenizer_model)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "bench.jsonl"
        _, seconds = _timed(lambda: synthetic.write_jsonl(synthetic.kto_rows(args.rows, 0), data))
        size_mb = data.stat().st_size / 2**20
        print(f"generated {args.rows} rows ({size_mb:.1f} MiB) in {seconds:.2f} s")

        (dataset, stats), first = _timed(lambda: build_kto_dataset(data, tok, args.max_length))
        print(
            f"first build (read + validate + tokenise + write cache): {first:.2f} s, "
            f"{stats.examples / first:,.0f} examples/s"
        )
        _, hit = _timed(lambda: build_kto_dataset(data, tok, args.max_length))
        print(f"cache hit, same process: {hit:.3f} s")

        child = _CHILD.format(
            repo=str(REPO), library=args.tokenizer_library, model=args.tokenizer_model,
            data=str(data), max_length=args.max_length,
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
        # Items as the training loader fetches them: each with its KL partner, the next row of
        # the batch (collating them includes fetching them, as in the DataLoader).
        collate = functools.partial(
            kto_custom_collate, pad_id=tok.pad_id, max_length=args.max_length
        )
        items = BatchKLPartners(dataset)
        n = COLLATE_BATCH
        starts = range(0, min(len(dataset) // n, 100) * n, n)  # up to 100 batches
        keys = [[(b + i, b + (i + 1) % n, 0) for i in range(n)] for b in starts]
        _, collated = _timed(lambda: [collate([items[k] for k in batch]) for batch in keys])
        print(
            f"fetch + kto_custom_collate, batch {n}: {len(keys) / collated:,.0f} batches/s "
            f"({len(keys) * n / collated:,.0f} examples/s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
