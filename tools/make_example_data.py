#!/usr/bin/env python
"""Regenerate the bundled example data and tokenizer under examples/data/ (deterministic).

    python tools/make_example_data.py [--out examples/data]

Writes tiny_kto/{train,validation}.jsonl (TRL unpaired), tiny_dpo/{train,validation}.jsonl
(paired) and tokenizer/tiny_sp.model (SentencePiece BPE trained on the training text). The
task is described in examples/data/README.md and megatron_kto/data/synthetic.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_kto.data import synthetic  # noqa: E402

KTO_TRAIN_ROWS, KTO_VALIDATION_ROWS = 1024, 128
DPO_TRAIN_ROWS, DPO_VALIDATION_ROWS = 512, 64
VOCAB_SIZE = 384
# Distinct seeds per split, so validation rows are drawn independently of training rows.
SEEDS = {"kto_train": 1, "kto_validation": 2, "dpo_train": 3, "dpo_validation": 4}


def make_example_data(out: Path) -> dict[str, int]:
    """Write every example file under ``out``.

    Args:
        out: the examples/data directory.

    Returns:
        Rows written per file (relative path -> rows).
    """
    kto_train = list(synthetic.kto_rows(KTO_TRAIN_ROWS, SEEDS["kto_train"]))
    dpo_train = list(synthetic.dpo_rows(DPO_TRAIN_ROWS, SEEDS["dpo_train"]))
    files = {
        "tiny_kto/train.jsonl": kto_train,
        "tiny_kto/validation.jsonl": synthetic.kto_rows(
            KTO_VALIDATION_ROWS, SEEDS["kto_validation"]
        ),
        "tiny_dpo/train.jsonl": dpo_train,
        "tiny_dpo/validation.jsonl": synthetic.dpo_rows(
            DPO_VALIDATION_ROWS, SEEDS["dpo_validation"]
        ),
    }
    written = {name: synthetic.write_jsonl(rows, out / name) for name, rows in files.items()}
    texts = [r["prompt"] for r in kto_train] + [r["completion"] for r in kto_train]
    texts += [r[k] for r in dpo_train for k in ("prompt", "chosen", "rejected")]
    # Completions start with their separating space; the tokenizer is trained on bare sentences.
    texts = [t.strip() for t in texts]
    synthetic.train_sentencepiece(texts, out / "tokenizer" / "tiny_sp.model", VOCAB_SIZE)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = Path(__file__).resolve().parents[1] / "examples" / "data"
    parser.add_argument("--out", type=Path, default=default, help="output directory")
    args = parser.parse_args(argv)
    for name, rows in make_example_data(args.out).items():
        print(f"{args.out / name}: {rows} rows")
    print(f"{args.out / 'tokenizer' / 'tiny_sp.model'}: vocab {VOCAB_SIZE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
