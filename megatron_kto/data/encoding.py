"""Turn normalised examples into prompt and completion token ids, as TRL 1.16 does.

The training sequence of a (prompt, completion) row is what the tokenizer makes of the whole
text, and the prompt is tokenised alone only to find where the completion starts:

* Plain-text rows: the completion gets the ``eos_token`` string appended unless it already
  ends with it; then ``prompt_ids = encode(prompt)`` and ``full_ids = encode(prompt +
  completion)``, both with the special tokens the tokenizer itself adds (BOS for Llama-style
  tokenizers, nothing for ChatML/GPT-2-style ones; see ``tokenizers.py``). Prompt and completion
  are joined as given, with no separator: put the space that separates them in the data
  (``"completion": " The answer"``), as TRL expects.
* Conversational rows: ``prompt_ids = encode(template(prompt, add_generation_prompt=True))``
  and ``full_ids = encode(template(prompt + completion))``, without added special tokens (the
  template renders them). What the template renders is the sequence: its own end of turn
  (e.g. ``<|im_end|>\\n``) ends the completion, and no EOS is added.
* The completion starts where ``prompt_ids`` and ``full_ids`` first differ (TRL's
  ``common_prefix_length``). Usually that is ``len(prompt_ids)``; when a token merges across
  the seam, or a template renders the prompt differently alone, the prompt keeps only the common
  part and the example is counted in ``DatasetStats.prompts_merged`` (TRL warns once).
* For DPO the prompt ends at the shorter of the two common prefixes (chosen and rejected), as
  in TRL's DPO trainer.

So ``prompt_ids + completion_ids`` always equals ``full_ids`` — the ids ``transformers``/TRL
train on — and the loss mask covers exactly the completion.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_kto.data.chat_template import ChatTemplateError
from megatron_kto.data.errors import RowLocation
from megatron_kto.data.formats import PairedExample, RowFormat, Text, UnpairedExample
from megatron_kto.data.tokenizers import Tokenizer


@dataclass(frozen=True)
class RenderedExample:
    """An example as plain strings, ready for the tokenizer.

    Attributes:
        prompt: prompt text (rendered with the generation prompt for conversational rows).
        fulls: prompt + completion texts (one for KTO; chosen, rejected for DPO).
        chat: rendered by a chat template (encoded without added special tokens).
    """

    prompt: str
    fulls: tuple[str, ...]
    chat: bool = False


@dataclass(frozen=True)
class EncodedExample:
    """Token ids of one example (before the length policy).

    Attributes:
        prompt_ids: the prompt's ids (BOS first when the tokenizer or template puts it there).
        completion_ids: ids of each completion (plain text: ending with EOS).
        prompt_key: identity of the prompt (a hash of its text): rows with equal keys answer
            the same prompt, so one's completion is never the other's KL completion.
        merged: the tokenised prompt alone is not a prefix of prompt + completion.
    """

    prompt_ids: list[int]
    completion_ids: tuple[list[int], ...]
    prompt_key: int
    merged: bool = False


def completion_fields(example: UnpairedExample | PairedExample) -> tuple[str, ...]:
    """The source field names of an example's completions, for error messages."""
    if isinstance(example, PairedExample):
        return ("chosen", "rejected")
    if example.source_format is RowFormat.PAIRED:
        return ("chosen" if example.label else "rejected",)
    return ("response" if example.source_format is RowFormat.NEMO else "completion",)


def render_example(
    tokenizer: Tokenizer,
    prompt: Text,
    completions: Sequence[Text],
    where: RowLocation,
    fields: Sequence[str],
) -> RenderedExample:
    """Render an example's texts: plain rows joined with EOS, conversational rows templated.

    Args:
        tokenizer: supplies the chat template and the EOS string.
        prompt: prompt text or messages.
        completions: completion texts or message lists (same kind as ``prompt``).
        where: the row, for errors.
        fields: the completions' field names, for errors.

    Returns:
        The rendered strings.

    Raises:
        DataFormatError: the template refused the messages or rendered an empty completion.
    """
    if isinstance(prompt, str):
        eos = tokenizer.eos_token
        fulls = tuple(prompt + c + ("" if c.endswith(eos) else eos) for c in completions)  # type: ignore[operator]
        return RenderedExample(prompt, fulls)
    try:
        prompt_text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
    except ChatTemplateError as err:
        raise where.error("prompt", str(err)) from None
    fulls = []
    for completion, field in zip(completions, fields):
        try:
            full = tokenizer.apply_chat_template(prompt + list(completion), False)
        except ChatTemplateError as err:
            raise where.error(field, str(err)) from None
        if full == prompt_text or not full.strip():
            raise where.error(field, "the chat template renders this completion as empty text")
        fulls.append(full)
    return RenderedExample(prompt_text, tuple(fulls), chat=True)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading ids ``a`` and ``b`` have in common."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prompt_key(text: str) -> int:
    """A 63-bit identity of a (rendered) prompt text, stable across processes and runs."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def encode_rendered(
    tokenizer: Tokenizer, rendered: Sequence[RenderedExample]
) -> list[EncodedExample]:
    """Tokenise rendered examples in one batch per kind of text.

    Args:
        tokenizer: the tokenizer.
        rendered: examples as strings; all must have the same number of completions.

    Returns:
        The encoded examples, in order. An empty completion (a ``full`` that tokenises to the
        prompt's ids) comes back empty and is dropped by the length policy's callers.
    """
    if not rendered:
        return []
    per_example = len(rendered[0].fulls)
    out: list[EncodedExample | None] = [None] * len(rendered)
    for chat in (False, True):
        group = [i for i, r in enumerate(rendered) if r.chat is chat]
        if not group:
            continue
        special = not chat  # a template renders its special tokens itself
        prompts = tokenizer.encode_batch([rendered[i].prompt for i in group], special)
        flat = tokenizer.encode_batch([f for i in group for f in rendered[i].fulls], special)
        for j, (i, prompt_ids) in enumerate(zip(group, prompts)):
            fulls = flat[j * per_example : (j + 1) * per_example]
            boundary = min(common_prefix_length(prompt_ids, full) for full in fulls)
            out[i] = EncodedExample(
                prompt_ids=list(fulls[0][:boundary]),
                completion_ids=tuple(list(full[boundary:]) for full in fulls),
                prompt_key=prompt_key(rendered[i].prompt),
                merged=boundary < len(prompt_ids),
            )
    return out  # type: ignore[return-value]
