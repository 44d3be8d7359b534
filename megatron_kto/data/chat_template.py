"""Render Jinja chat templates (the ``chat_template`` of a ``tokenizer_config.json``).

Templates come with downloaded models, so they are rendered in jinja2's immutable sandbox:
a template can format strings but cannot touch Python objects or the file system. The
environment matches what Hugging Face templates expect: ``trim_blocks``/``lstrip_blocks``,
the ``loopcontrols`` extension, a ``tojson`` filter that keeps non-ASCII text, and the globals
``raise_exception(msg)`` and ``strftime_now(fmt)``. Each render receives ``messages``,
``add_generation_prompt``, ``bos_token`` and ``eos_token``.
"""

from __future__ import annotations

import datetime
import json
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A chat template failed to compile, or refused (``raise_exception``) or failed to render."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _environment() -> jinja2.Environment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template bound to a tokenizer's BOS/EOS token strings."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        """Compile ``source``.

        Args:
            source: the Jinja template text.
            bos_token: the string the template sees as ``bos_token`` ("" if none).
            eos_token: the string the template sees as ``eos_token`` ("" if none).

        Raises:
            ChatTemplateError: the template does not compile (message has its line).
        """
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as err:
            raise ChatTemplateError(
                f"chat template does not compile: {err.message} (template line {err.lineno})"
            ) from None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        """Render a conversation.

        Args:
            messages: ``{"role", "content"}`` dicts.
            add_generation_prompt: append the header that starts the assistant's turn.

        Returns:
            The rendered text (special tokens appear as their strings).

        Raises:
            ChatTemplateError: the template called ``raise_exception`` or failed at render time.
        """
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except ChatTemplateError:
            raise
        except Exception as err:  # a template can fail with any Python error (TypeError, ...)
            raise ChatTemplateError(
                f"chat template failed to render: {type(err).__name__}: {err}"
            ) from None
