#!/usr/bin/env python
"""Generate a KTO benchmark set with long-tailed lengths and imbalanced classes.

    python tools/make_bench_data.py --out bench_kto.jsonl [--rows 2048] [--seed 0]
        [--prompt-median 150] [--completion-median 250] [--sigma 0.7] [--max-length 1024]
        [--desirable 2:1] [--tokenizer-model examples/data/tokenizer/tiny_sp.model]

Real preference data is nothing like the bundled example's ~20-token rows: prompt and completion
lengths are long-tailed, so padding a batch to its longest row wastes a large share of every
pass, and feedback is rarely balanced. Here each row draws its prompt and completion length in
tokens of the given tokenizer from log-normal distributions (medians as given, shape ``sigma``),
caps the prompt at half of ``max_length`` and then the completion at what is left (less two
tokens for BOS/EOS), and labels
rows desirable or undesirable at the given ratio, shuffled. Text is the bundled example's
vocabulary (a request for words of one category, preceded by context sentences; a desirable
completion lists words of that category, an undesirable one words of another set), so it stays
in the bundled tokenizer's vocabulary and tokenises to exactly the drawn lengths. Seeded: the
same arguments give the same file byte for byte.

Prints p50/p90/p99 of prompt, completion and row lengths (measured by tokenising the written
rows, not the drawn targets) and the class ratio. TRL-style unpaired rows
(``prompt``/``completion``/``label``), which both sides of ``tools/bench_kto.py`` read.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TOKENIZER = REPO / "examples" / "data" / "tokenizer" / "tiny_sp.model"

_CATEGORIES = {
    "fruit": "apple banana cherry grape lemon mango peach plum".split(),
    "animal": "cat dog horse mouse rabbit tiger wolf zebra".split(),
    "color": "red blue green yellow purple pink brown gray".split(),
    "tool": "hammer saw drill wrench shovel rake chisel pliers".split(),
}
_OFF_TOPIC = {
    "vehicle": "car bus train truck bicycle boat plane tram".split(),
    "weather": "rain snow wind storm fog hail sunshine cloud".split(),
    "drink": "tea coffee milk juice water soda cocoa cider".split(),
}
_CONTEXT = "Hello ! I need some words for a list now , please . Can you give me more ?".split()


class _Words:
    """Appends words to a text until it holds an exact number of tokens.

    SentencePiece does not merge across spaces, so a text's token count is the sum of its words'
    counts (each word tokenised with its leading space); that sum is checked against the real
    tokenisation of the finished rows in `length_stats`.
    """

    def __init__(self, tokenizer: Any):
        self._tok = tokenizer
        self._cost: dict[str, int] = {}

    def cost(self, word: str) -> int:
        if word not in self._cost:
            self._cost[word] = len(self._tok.encode(word))
        return self._cost[word]

    def fill(self, rng: random.Random, pool: list[str], budget: int, head: list[str]) -> str:
        words, used = [], 0
        for w in head:
            if used + self.cost(w) > budget:
                break
            words.append(w)
            used += self.cost(w)
        while used < budget:
            w = rng.choice(pool)
            if used + self.cost(w) > budget:
                w = min(pool, key=self.cost)  # the cheapest word closes the gap
                if used + self.cost(w) > budget:
                    break
            words.append(w)
            used += self.cost(w)
        return " ".join(words)


def _lognormal(rng: random.Random, median: float, sigma: float) -> int:
    return max(1, round(math.exp(rng.gauss(math.log(median), sigma))))


def make_rows(
    tokenizer: Any,
    rows: int,
    seed: int = 0,
    prompt_median: float = 150,
    completion_median: float = 250,
    sigma: float = 0.7,
    max_length: int = 1024,
    desirable: tuple[int, int] = (2, 1),
) -> list[dict[str, Any]]:
    """The rows of the set (see the module docstring); `desirable` is the D:U ratio."""
    if max_length < 4:
        raise ValueError(f"max_length must be >= 4, got {max_length}")
    rng = random.Random(seed)
    words = _Words(tokenizer)
    n_desirable = round(rows * desirable[0] / (desirable[0] + desirable[1]))
    labels = [True] * n_desirable + [False] * (rows - n_desirable)
    rng.shuffle(labels)
    out = []
    for label in labels:
        prompt_len = min(_lognormal(rng, prompt_median, sigma), max_length // 2)
        # Two tokens of room: the pipeline adds EOS (and BOS if the tokenizer does) to the row.
        room = max(1, max_length - prompt_len - 2)
        completion_len = min(_lognormal(rng, completion_median, sigma), room)
        category = rng.choice(list(_CATEGORIES))
        request = f"Please list {category} words .".split()
        context_len = max(0, prompt_len - sum(words.cost(w) for w in request))
        prompt = words.fill(rng, _CONTEXT + _CATEGORIES["color"], context_len, [])
        prompt = (prompt + " " + " ".join(request)).strip()
        if label:
            pool = _CATEGORIES[category]
        else:
            wrong = [c for c in _CATEGORIES if c != category]
            pool = {**_CATEGORIES, **_OFF_TOPIC}[rng.choice(wrong + list(_OFF_TOPIC))]
        completion = words.fill(rng, pool + [","], completion_len, ["Sure", ":"])
        out.append({"prompt": prompt, "completion": completion, "label": label})
    return out


def _percentile(sorted_values: list[int], q: float) -> int:
    index = min(len(sorted_values) - 1, max(0, math.ceil(q / 100 * len(sorted_values)) - 1))
    return sorted_values[index]


def length_stats(tokenizer: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """p50/p90/p99/max of prompt, completion and row lengths in tokens, and the class counts."""
    stats: dict[str, Any] = {}
    prompts = [len(tokenizer.encode(r["prompt"])) for r in rows]
    completions = [len(tokenizer.encode(r["completion"])) for r in rows]
    totals = [p + c for p, c in zip(prompts, completions)]
    for name, values in (("prompt", prompts), ("completion", completions), ("row", totals)):
        s = sorted(values)
        stats[name] = {f"p{q}": _percentile(s, q) for q in (50, 90, 99)} | {"max": s[-1]}
    stats["desirable"] = sum(r["label"] for r in rows)
    stats["undesirable"] = len(rows) - stats["desirable"]
    return stats


def describe(stats: dict[str, Any]) -> str:
    lines = [f"{'tokens':>12} {'p50':>6} {'p90':>6} {'p99':>6} {'max':>6}"]
    for name in ("prompt", "completion", "row"):
        s = stats[name]
        lines.append(f"{name:>12} {s['p50']:>6} {s['p90']:>6} {s['p99']:>6} {s['max']:>6}")
    d, u = stats["desirable"], stats["undesirable"]
    lines.append(f"classes: {d} desirable, {u} undesirable ({d / max(u, 1):.2f}:1)")
    return "\n".join(lines)


def write(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)


def _ratio(text: str) -> tuple[int, int]:
    try:
        d, u = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected D:U such as 2:1, got {text!r}") from None
    if d < 0 or u < 0 or d + u == 0:
        raise argparse.ArgumentTypeError(f"expected non-negative D:U, not both 0, got {text!r}")
    return d, u


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    parser.add_argument("--rows", type=int, default=2048, help="rows (default 2048)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--prompt-median", type=float, default=150, help="tokens (default 150)")
    parser.add_argument("--completion-median", type=float, default=250, help="tokens (default 250)")
    parser.add_argument(
        "--sigma", type=float, default=0.7, help="log-normal shape; larger = longer tail (0.7)"
    )
    parser.add_argument(
        "--max-length", type=int, default=1024, help="cap on prompt + completion (default 1024)"
    )
    parser.add_argument(
        "--desirable", type=_ratio, default=(2, 1), help="desirable:undesirable (default 2:1)"
    )
    parser.add_argument(
        "--tokenizer-library", default="sentencepiece", help="'sentencepiece' or 'huggingface'"
    )
    parser.add_argument("--tokenizer-model", default=str(DEFAULT_TOKENIZER), help="tokenizer")
    args = parser.parse_args(argv)
    if args.rows < 1 or args.sigma < 0 or args.prompt_median < 1 or args.completion_median < 1:
        parser.error("need --rows >= 1, --sigma >= 0 and medians >= 1")

    sys.path.insert(0, str(REPO))
    from megatron_kto.data.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer_library, args.tokenizer_model)
    rows = make_rows(
        tokenizer,
        args.rows,
        args.seed,
        args.prompt_median,
        args.completion_median,
        args.sigma,
        args.max_length,
        args.desirable,
    )
    write(args.out, rows)
    print(f"wrote {len(rows)} rows to {args.out}")
    print(describe(length_stats(tokenizer, rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
