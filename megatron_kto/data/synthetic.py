"""A small, learnable synthetic preference task (the bundled example and the benchmark data).

The rule: a prompt asks for ``k`` words of one of four categories ("Please list three fruit
words ."). A desirable completion gives ``k`` words *of that category*. An undesirable one
gives ``k`` words of a wrong set, in the same sentence frame: usually an off-topic set that no
prompt asks about (vehicles, weather, ...), and in 25% of cases another asked-about category
(the prompt-dependent, harder case). Lead-ins, frames and counts are shared by both classes,
so the signal is which word set the completion draws from relative to the prompt — visible
token by token. A random 2-layer, hidden-64 model trained with KTO separates held-out
desirable from undesirable rows by implicit reward within ~50 steps (AUC ~0.9 measured with
global batch 32, lr 1e-3, beta 0.1). Labels are balanced: half of the rows (rounded up) are
desirable, in random order. Everything is driven by an explicit ``random.Random(seed)``, so
the output is byte-for-byte reproducible.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

#: Categories a prompt can ask about.
CATEGORIES: dict[str, tuple[str, ...]] = {
    "fruit": ("apple", "banana", "cherry", "grape", "lemon", "mango", "peach", "plum"),
    "animal": ("cat", "dog", "horse", "mouse", "rabbit", "tiger", "wolf", "zebra"),
    "color": ("red", "blue", "green", "yellow", "purple", "pink", "brown", "gray"),
    "tool": ("hammer", "saw", "drill", "wrench", "shovel", "rake", "chisel", "pliers"),
}
#: Word sets that only ever answer a prompt wrongly (never asked about).
OFF_TOPIC: dict[str, tuple[str, ...]] = {
    "vehicle": ("car", "bus", "train", "truck", "bicycle", "boat", "plane", "tram"),
    "weather": ("rain", "snow", "wind", "storm", "fog", "hail", "sunshine", "cloud"),
    "drink": ("tea", "coffee", "milk", "juice", "water", "soda", "cocoa", "cider"),
    "body": ("hand", "foot", "knee", "elbow", "nose", "ear", "chin", "neck"),
}
#: Share of wrong answers that use another *asked-about* category (the harder, prompt-
#: dependent case); the rest use an off-topic set.
WRONG_CATEGORY_SHARE = 0.25
COUNTS = {2: "two", 3: "three", 4: "four", 5: "five"}
PROMPT_FRAMES = (
    "Name {n} {c} words .",
    "Please list {n} {c} words .",
    "Can you give me {n} {c} words ?",
    "I need {n} words for {c} , please .",
    "Tell me {n} different {c} words now .",
    "Hello ! Write {n} {c} words for me .",
)
LEAD_INS = ("", "Sure :", "Here :", "OK ,")


def _prompt(rng: random.Random, category: str, count: int) -> str:
    return rng.choice(PROMPT_FRAMES).format(n=COUNTS[count], c=category)


def _completion(rng: random.Random, category: str, count: int) -> str:
    words = rng.sample({**CATEGORIES, **OFF_TOPIC}[category], count)
    lead = rng.choice(LEAD_INS)
    body = " , ".join(words) + " ."
    # Leading space: prompt and completion are joined as given (TRL's plain-text convention),
    # so the completion carries the space that separates it from the prompt.
    return f" {lead} {body}" if lead else f" {body}"


def _wrong_category(rng: random.Random, category: str) -> str:
    if rng.random() < WRONG_CATEGORY_SHARE:
        return rng.choice([c for c in CATEGORIES if c != category])
    return rng.choice(list(OFF_TOPIC))


def kto_rows(num_rows: int, seed: int) -> Iterator[dict[str, Any]]:
    """TRL unpaired rows of the task.

    Args:
        num_rows: how many rows.
        seed: RNG seed.

    Returns:
        An iterator of ``{"prompt", "completion", "label"}`` dicts, ceil(n/2) desirable.
    """
    rng = random.Random(seed)
    categories = list(CATEGORIES)
    # Exactly ceil(n/2) desirable rows in random order: n_D/n_U stays in the KTO paper's
    # [1, 4/3] band, so the default loss weights need no change.
    labels = [True] * (num_rows - num_rows // 2) + [False] * (num_rows // 2)
    rng.shuffle(labels)
    for label in labels:
        category = rng.choice(categories)
        count = rng.choice(list(COUNTS))
        source = category if label else _wrong_category(rng, category)
        prompt = _prompt(rng, category, count)
        yield {"prompt": prompt, "completion": _completion(rng, source, count), "label": label}


def dpo_rows(num_rows: int, seed: int) -> Iterator[dict[str, Any]]:
    """Paired rows of the task: the chosen answer follows the rule, the rejected one breaks it.

    Args:
        num_rows: how many pairs.
        seed: RNG seed.

    Returns:
        An iterator of ``{"prompt", "chosen", "rejected"}`` dicts.
    """
    rng = random.Random(seed)
    categories = list(CATEGORIES)
    for _ in range(num_rows):
        category = rng.choice(categories)
        count = rng.choice(list(COUNTS))
        prompt = _prompt(rng, category, count)
        chosen = _completion(rng, category, count)
        rejected = _completion(rng, _wrong_category(rng, category), count)
        yield {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def write_jsonl(rows: Iterable[dict[str, Any]], path: str | Path) -> int:
    """Write rows as JSON Lines (UTF-8, one object per line).

    Args:
        rows: the rows.
        path: output file (parent directories are created).

    Returns:
        The number of rows written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
    return count


def train_sentencepiece(texts: Iterable[str], model_path: str | Path, vocab_size: int) -> None:
    """Train a BPE SentencePiece model with ids pad=0, unk=1, bos=2, eos=3.

    Single-threaded and without input sampling, so the model file is reproducible.

    Args:
        texts: training sentences.
        model_path: the ``.model`` file to write.
        vocab_size: target vocabulary size (a soft limit for tiny corpora).
    """
    import sentencepiece

    model_path = Path(model_path)
    model_path.parent.mkdir(parents=True, exist_ok=True)
    with open(model_path, "wb") as out:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(list(texts)),
            model_writer=out,
            model_type="bpe",
            vocab_size=vocab_size,
            hard_vocab_limit=False,
            character_coverage=1.0,
            pad_id=0,
            unk_id=1,
            bos_id=2,
            eos_id=3,
            num_threads=1,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            minloglevel=2,
        )
