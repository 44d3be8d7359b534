"""Turn normalised examples into prompt and completion token ids with an exact boundary.

Prompt and completion are tokenised *separately* and the id lists are concatenated, so no token
ever straddles the prompt/completion boundary and the loss mask is exact.

* Plain-text rows are used as they are (no chat template).
* Conversational rows: ``prompt_text = template(prompt, add_generation_prompt=True)`` and
  ``completion_text = template(prompt + completion)[len(prompt_text):]``; a template whose
  full rendering does not start with the prompt rendering is an error, because the boundary
  would be undefined.
* BOS is prepended to the prompt when the tokenizer has one and the ids do not already start
  with it (chat templates often render ``bos_token`` themselves).
* EOS is appended to each completion unless its ids already end with it (some templates render
  ``eos_token`` at the end of the assistant turn).
"""

from __future__ import annotations

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
        prompt: prompt text.
        completions: completion texts (one for KTO; chosen, rejected for DPO).
    """

    prompt: str
    completions: tuple[str, ...]


@dataclass(frozen=True)
class EncodedExample:
    """Token ids of one example (before the length policy).

    Attributes:
        prompt_ids: prompt ids, BOS first when the tokenizer has one.
        completion_ids: ids of each completion, each ending with EOS.
    """

    prompt_ids: list[int]
    completion_ids: tuple[list[int], ...]


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
    """Render an example's texts, applying the chat template to conversational rows.

    Args:
        tokenizer: supplies the chat template.
        prompt: prompt text or messages.
        completions: completion texts or message lists (same kind as ``prompt``).
        where: the row, for errors.
        fields: the completions' field names, for errors.

    Returns:
        The rendered strings.

    Raises:
        DataFormatError: the template refused the messages or breaks the prompt prefix.
    """
    if isinstance(prompt, str):
        return RenderedExample(prompt, tuple(completions))  # type: ignore[arg-type]
    try:
        prompt_text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
    except ChatTemplateError as err:
        raise where.error("prompt", str(err)) from None
    texts = []
    for completion, field in zip(completions, fields):
        try:
            full = tokenizer.apply_chat_template(prompt + list(completion), False)
        except ChatTemplateError as err:
            raise where.error(field, str(err)) from None
        if not full.startswith(prompt_text):
            raise where.error(
                field,
                "the chat template renders prompt+completion so that it does not start with the "
                "rendered prompt (add_generation_prompt=True), so the prompt/completion boundary "
                "is undefined; fix the template or give the texts as plain strings",
            )
        if not full[len(prompt_text) :].strip():
            raise where.error(field, "the chat template renders this completion as empty text")
        texts.append(full[len(prompt_text) :])
    return RenderedExample(prompt_text, tuple(texts))


def add_bos(ids: list[int], bos_id: int | None) -> list[int]:
    """Prepend ``bos_id`` unless it is None or already first."""
    if bos_id is None or (ids and ids[0] == bos_id):
        return ids
    return [bos_id, *ids]


def add_eos(ids: list[int], eos_id: int) -> list[int]:
    """Append ``eos_id`` unless already last."""
    if ids and ids[-1] == eos_id:
        return ids
    return [*ids, eos_id]


def encode_rendered(
    tokenizer: Tokenizer, rendered: Sequence[RenderedExample]
) -> list[EncodedExample]:
    """Tokenise rendered examples in one batch per kind of text.

    Args:
        tokenizer: the tokenizer.
        rendered: examples as strings; all must have the same number of completions.

    Returns:
        The encoded examples, in order.
    """
    if not rendered:
        return []
    per_example = len(rendered[0].completions)
    prompts = tokenizer.encode_batch([r.prompt for r in rendered])
    flat = tokenizer.encode_batch([c for r in rendered for c in r.completions])
    encoded = []
    for i, prompt_ids in enumerate(prompts):
        completions = flat[i * per_example : (i + 1) * per_example]
        encoded.append(
            EncodedExample(
                add_bos(list(prompt_ids), tokenizer.bos_id),
                tuple(add_eos(list(c), tokenizer.eos_id) for c in completions),
            )
        )
    return encoded
