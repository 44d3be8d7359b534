"""Tokenizers: one small interface, a SentencePiece and a Hugging Face ``tokenizer.json`` backend.

Conventions shared by both backends:

* ``encode(text)`` adds no special tokens; ``encode(text, add_special_tokens=True)`` adds what
  the tokenizer itself adds to a plain text — what ``transformers``' ``tokenizer(text)`` gives:

  - Hugging Face ``tokenizer.json``: exactly what its ``post_processor`` adds (e.g. Llama-3's
    ``TemplateProcessing`` puts ``<|begin_of_text|>`` first; ChatML/Qwen/SmolLM and GPT-2/NeoX
    style files add nothing, whatever ``bos_token`` says). ``transformers`` >= 5 does the same:
    it drops ``add_bos_token``/``add_eos_token`` from ``tokenizer_config.json`` when a
    ``tokenizer.json`` exists, so we ignore them too (and warn when they contradict the file).
  - SentencePiece ``.model``: BOS first when the model defines one, never EOS — the convention
    of SentencePiece-based Llama/Mistral tokenizers (``add_bos_token=True``,
    ``add_eos_token=False``). A ``.model`` file carries no post-processing rule of its own.

  Special-token *strings* inside the text (e.g. a chat template's ``<s>`` or ``<|im_end|>``)
  are encoded as their single special id, as Hugging Face tokenizers do.
* ``bos_id`` is the BOS token's id (None without one) and ``adds_bos`` says whether
  ``add_special_tokens=True`` puts it first.
* ``eos_id``/``eos_token`` are required: plain-text completions end with EOS (TRL appends the
  ``eos_token`` string), so a tokenizer without one is rejected at load time.
* ``pad_id`` falls back to ``eos_id`` when the tokenizer defines no padding token; padding is
  always masked by the labels, so any valid id works.
* ``fingerprint`` identifies everything that affects token ids (model file, special tokens,
  chat template, the rule version); the tokenised-data cache is keyed by it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from megatron_kto.data.chat_template import ChatTemplate, ChatTemplateError

TOKENIZER_LIBRARIES = ("sentencepiece", "huggingface")

logger = logging.getLogger(__name__)


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    @property
    def bos_id(self) -> int | None:
        """Id of the BOS token, or None when the tokenizer has none."""

    @property
    def adds_bos(self) -> bool:
        """Whether ``encode(text, add_special_tokens=True)`` puts BOS first."""

    @property
    def eos_id(self) -> int:
        """Id of the EOS token."""

    @property
    def eos_token(self) -> str:
        """The EOS token's string (TRL appends it to plain-text completions)."""

    @property
    def pad_id(self) -> int:
        """Id used to pad token tensors (always a valid id)."""

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included."""

    @property
    def fingerprint(self) -> str:
        """Hex digest of everything that determines the token ids."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` also what the tokenizer adds."""

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = False
    ) -> list[list[int]]:
        """``[encode(t, add_special_tokens) for t in texts]``, possibly faster."""

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool
    ) -> str:
        """Render chat messages with the tokenizer's chat template."""


#: Bumped whenever the rule for which special tokens `encode` adds changes (part of the
#: fingerprint, so tokenised-data caches built under an older rule are not reused).
ENCODING_RULE = "special-tokens-as-the-tokenizer-adds-them/2"


def _digest(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8") if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def resolve_chat_template(chat_template: str | None) -> str | None:
    """Accept a chat template as Jinja text or as the path of a file holding it.

    Args:
        chat_template: template text, a path to a ``.jinja``/text file, or None.

    Returns:
        The template text, or None.
    """
    if chat_template is None:
        return None
    # Template text always contains a Jinja delimiter; a path never needs one.
    if "{" not in chat_template and Path(chat_template).is_file():
        return Path(chat_template).read_text(encoding="utf-8")
    return chat_template


class _ChatTemplateMixin:
    """Shared ``apply_chat_template`` for both backends (the template is optional)."""

    _chat_template: ChatTemplate | None
    _model_path: str

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool
    ) -> str:
        """Render chat messages with the tokenizer's chat template.

        Raises:
            ChatTemplateError: no template is configured, or the template refused the messages.
        """
        if self._chat_template is None:
            raise ChatTemplateError(
                f"tokenizer {self._model_path} has no chat template; conversational data needs "
                "one (set the tokenizer's chat_template option or add it to tokenizer_config.json)"
            )
        return self._chat_template.render(messages, add_generation_prompt)


class SentencePieceTokenizer(_ChatTemplateMixin):
    """A SentencePiece ``.model`` file."""

    def __init__(self, model_path: str | Path, chat_template: str | None = None) -> None:
        """Load the model.

        Args:
            model_path: the ``.model`` file.
            chat_template: Jinja chat template text (SentencePiece models carry none).

        Raises:
            FileNotFoundError: no such file.
            ValueError: the model has no EOS id.
        """
        import sentencepiece

        path = Path(model_path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: SentencePiece model not found")
        data = path.read_bytes()
        self._sp = sentencepiece.SentencePieceProcessor(model_proto=data)
        self._model_path = str(path)
        if self._sp.eos_id() < 0:
            raise ValueError(f"{path}: SentencePiece model has no EOS id (train it with eos_id>=0)")
        self._bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        self._pad_id = self._sp.pad_id() if self._sp.pad_id() >= 0 else self._sp.eos_id()
        piece = self._sp.id_to_piece
        # SentencePiece never produces control ids from text, so map their strings ourselves.
        self._special = {
            piece(i): i for i in range(self._sp.get_piece_size()) if self._sp.is_control(i)
        }
        self._special_re = (
            re.compile("(" + "|".join(map(re.escape, sorted(self._special, key=len)[::-1])) + ")")
            if self._special
            else None
        )
        bos = piece(self._bos_id) if self._bos_id is not None else ""
        template = resolve_chat_template(chat_template)
        self._chat_template = ChatTemplate(template, bos, piece(self.eos_id)) if template else None
        self._fingerprint = _digest("sentencepiece", data, template or "", ENCODING_RULE)

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def adds_bos(self) -> bool:
        # SentencePiece-based Llama/Mistral tokenizers put BOS first (add_bos_token=True).
        return self._bos_id is not None

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def eos_token(self) -> str:
        return self._sp.id_to_piece(self._sp.eos_id())

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def _encode_with_specials(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, part in enumerate(self._special_re.split(text)):  # type: ignore[union-attr]
            if i % 2:  # odd parts are the captured special strings
                ids.append(self._special[part])
            elif part:
                ids.extend(self._sp.encode(part, out_type=int))
        return ids

    def _with_specials(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        return [self._bos_id, *ids] if add_special_tokens and self.adds_bos else ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if self._special_re is not None and self._special_re.search(text):
            ids = self._encode_with_specials(text)
        else:
            ids = self._sp.encode(text, out_type=int)
        return self._with_specials(ids, add_special_tokens)

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = False
    ) -> list[list[int]]:
        if self._special_re is not None and any(self._special_re.search(t) for t in texts):
            return [self.encode(t, add_special_tokens) for t in texts]
        return [
            self._with_specials(ids, add_special_tokens)
            for ids in self._sp.encode(list(texts), out_type=int)
        ]

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


def _token_string(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as a string or as a serialised AddedToken.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _find_tokenizer_files(model: Path) -> tuple[Path, dict[str, Any], str | None]:
    tokenizer_file = model / "tokenizer.json" if model.is_dir() else model
    if not tokenizer_file.is_file():
        raise FileNotFoundError(
            f"{model}: expected a tokenizer.json file or a directory containing one"
        )
    config_file = tokenizer_file.parent / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_file.is_file():
        config = json.loads(config_file.read_text(encoding="utf-8"))
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    jinja_file = tokenizer_file.parent / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text(encoding="utf-8")
    return tokenizer_file, config, template


def _added_by_post_processor(tok: Any, bos_id: int | None, eos_id: int) -> tuple[bool, bool]:
    """(BOS first?, EOS last?) in what ``tok``'s post-processor does to a plain text."""
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    if full == plain:
        return False, False
    adds_bos = bos_id is not None and full[:1] == [bos_id] and plain[:1] != [bos_id]
    adds_eos = full[-1:] == [eos_id] and plain[-1:] != [eos_id]
    return adds_bos, adds_eos


class HuggingFaceTokenizer(_ChatTemplateMixin):
    """A Hugging Face ``tokenizer.json`` (fast tokenizer) plus its ``tokenizer_config.json``."""

    def __init__(self, model: str | Path, chat_template: str | None = None) -> None:
        """Load ``tokenizer.json`` and, if present beside it, ``tokenizer_config.json``.

        Args:
            model: a ``tokenizer.json`` file or a directory containing one.
            chat_template: Jinja template text (or file) overriding the configured one.

        Raises:
            FileNotFoundError: no tokenizer.json.
            ValueError: no EOS token, or a configured special token is not in the vocabulary.

        Special tokens come from ``bos_token``/``eos_token``/``pad_token`` of
        ``tokenizer_config.json``; without that file, tokens spelled ``<s>``, ``</s>`` and
        ``<pad>`` are used when the vocabulary has them. Which of them a plain text gets is
        decided by ``tokenizer.json``'s post-processor alone (see the module docstring).
        """
        from tokenizers import Tokenizer as _HFTokenizer

        tokenizer_file, config, configured_template = _find_tokenizer_files(Path(model))
        self._model_path = str(tokenizer_file)
        self._tok = _HFTokenizer.from_file(str(tokenizer_file))
        if config:
            names = {k: _token_string(config.get(f"{k}_token")) for k in ("bos", "eos", "pad")}
        else:
            names = {"bos": "<s>", "eos": "</s>", "pad": "<pad>"}
            names = {
                k: v if self._tok.token_to_id(v) is not None else None for k, v in names.items()
            }
        ids: dict[str, int | None] = {}
        for key, name in names.items():
            ids[key] = self._tok.token_to_id(name) if name is not None else None
            if name is not None and ids[key] is None:
                raise ValueError(
                    f"{tokenizer_file.parent / 'tokenizer_config.json'}: {key}_token {name!r} is "
                    "not in the vocabulary of tokenizer.json"
                )
        if ids["eos"] is None:
            raise ValueError(
                f"{tokenizer_file}: no EOS token; set eos_token in tokenizer_config.json next to it"
            )
        self._eos_id: int = ids["eos"]  # type: ignore[assignment]
        self._eos_token: str = names["eos"]  # type: ignore[assignment]
        self._pad_id: int = ids["pad"] if ids["pad"] is not None else self._eos_id
        self._bos_id = ids["bos"]
        self._adds_bos, adds_eos = _added_by_post_processor(self._tok, self._bos_id, self._eos_id)
        for key, does in (("add_bos_token", self._adds_bos), ("add_eos_token", adds_eos)):
            if key in config and bool(config[key]) != does:
                logger.warning(
                    "%s: %s is %s, but the post-processor of %s %s it; following tokenizer.json "
                    "(as transformers >= 5 does)",
                    tokenizer_file.parent / "tokenizer_config.json",
                    key,
                    config[key],
                    tokenizer_file.name,
                    "adds" if does else "does not add",
                )
        template = resolve_chat_template(chat_template) or configured_template
        self._chat_template = (
            ChatTemplate(template, names["bos"] or "", names["eos"] or "") if template else None
        )
        special = json.dumps(names, sort_keys=True)
        self._fingerprint = _digest(
            "huggingface", tokenizer_file.read_bytes(), special, template or "", ENCODING_RULE
        )

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def adds_bos(self) -> bool:
        return self._adds_bos

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def eos_token(self) -> str:
        return self._eos_token

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = False
    ) -> list[list[int]]:
        encoded = self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encoded]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def load_tokenizer(library: str, model: str, chat_template: str | None = None) -> Tokenizer:
    """Load a tokenizer.

    Args:
        library: ``"sentencepiece"`` (``model`` is a ``.model`` file) or ``"huggingface"``
            (``model`` is a ``tokenizer.json`` or a directory with ``tokenizer.json`` and
            optionally ``tokenizer_config.json``).
        model: path of the model file or directory.
        chat_template: Jinja chat template text or file, overriding the tokenizer's own.

    Returns:
        The tokenizer.

    Raises:
        ValueError: unknown library, or an unusable tokenizer (message names the file).
        ChatTemplateError: the chat template does not compile.
    """
    if library == "sentencepiece":
        return SentencePieceTokenizer(model, chat_template)
    if library == "huggingface":
        return HuggingFaceTokenizer(model, chat_template)
    raise ValueError(
        f"unknown tokenizer library {library!r}; expected one of {TOKENIZER_LIBRARIES}"
    )
