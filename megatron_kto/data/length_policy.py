"""The length policy: how long prompts and completions may be, and what happens when they are not.

Rules, applied per example (lengths count tokens, BOS/EOS included):

1. If ``max_prompt_length`` is set and the prompt is longer, the prompt is truncated to it:
   ``keep_end`` (TRL's default) drops its left side but keeps a leading BOS, because the model
   always saw BOS first; ``keep_start`` drops its right side.
2. If ``max_length`` is set and prompt + completion is longer, the completion keeps its first
   ``max_length - prompt`` tokens. Its EOS is then gone and is *not* re-appended: the answer did
   not end there, and teaching the model to emit EOS mid-answer would be wrong.
3. If the (truncated) prompt leaves no room for a single completion token, the example is
   dropped with reason ``prompt_too_long`` — never replaced by a dummy row. Without
   ``max_prompt_length`` this is how a prompt longer than ``max_length`` ends up. Dropped
   examples are counted per reason in the dataset statistics.

The decision only needs lengths, so the same function serves tokenisation and the ``stats`` tool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

TRUNCATION_MODES = ("keep_end", "keep_start")

#: Drop reasons (keys of ``DatasetStats.dropped``).
DROP_PROMPT_TOO_LONG = "prompt_too_long"
DROP_EMPTY_PROMPT = "empty_prompt"


@dataclass(frozen=True)
class LengthPolicy:
    """Length limits in tokens.

    Attributes:
        max_length: most tokens of prompt + completion (None: no limit).
        max_prompt_length: most prompt tokens (None: only ``max_length`` applies).
        truncation_mode: ``keep_end`` or ``keep_start``: which side of a long prompt is kept.
    """

    max_length: int | None = None
    max_prompt_length: int | None = None
    truncation_mode: str = "keep_end"

    def __post_init__(self) -> None:
        if self.truncation_mode not in TRUNCATION_MODES:
            raise ValueError(
                f"truncation_mode: {self.truncation_mode!r} is not one of {TRUNCATION_MODES}"
            )
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(
                f"max_length: must be >= 2 (prompt + completion), got {self.max_length}"
            )
        if self.max_prompt_length is not None:
            if self.max_prompt_length < 1:
                raise ValueError(f"max_prompt_length: must be >= 1, got {self.max_prompt_length}")
            if self.max_length is not None and self.max_prompt_length >= self.max_length:
                raise ValueError(
                    f"max_prompt_length ({self.max_prompt_length}) must be smaller than "
                    f"max_length ({self.max_length}) to leave room for the completion"
                )


@dataclass(frozen=True)
class LengthPlan:
    """What to keep of one example.

    Attributes:
        prompt_length: prompt tokens to keep.
        completion_lengths: tokens to keep of each completion (the first ones).
        drop_reason: None to keep the example, else why it is dropped.
        prompt_truncated: the prompt loses tokens.
        completion_truncated: at least one completion loses tokens.
    """

    prompt_length: int
    completion_lengths: tuple[int, ...]
    drop_reason: str | None = None
    prompt_truncated: bool = False
    completion_truncated: bool = False


def plan_lengths(
    policy: LengthPolicy, prompt_length: int, completion_lengths: Sequence[int]
) -> LengthPlan:
    """Apply the length policy to one example's lengths.

    Args:
        policy: the limits.
        prompt_length: prompt tokens (BOS included).
        completion_lengths: tokens of each completion (one for KTO, chosen and rejected for DPO;
            EOS included).

    Returns:
        The plan; ``drop_reason`` is set when the example cannot be kept.
    """
    if prompt_length == 0:
        return LengthPlan(0, tuple(completion_lengths), DROP_EMPTY_PROMPT)
    prompt = prompt_length
    if policy.max_prompt_length is not None:
        prompt = min(prompt, policy.max_prompt_length)
    completions = tuple(completion_lengths)
    if policy.max_length is not None:
        room = policy.max_length - prompt
        if room < 1:
            return LengthPlan(prompt, completions, DROP_PROMPT_TOO_LONG, prompt < prompt_length)
        completions = tuple(min(c, room) for c in completion_lengths)
    return LengthPlan(
        prompt_length=prompt,
        completion_lengths=completions,
        prompt_truncated=prompt < prompt_length,
        completion_truncated=completions != tuple(completion_lengths),
    )


def truncate_prompt(
    ids: Sequence[int], keep: int, truncation_mode: str, bos_id: int | None
) -> list[int]:
    """Keep ``keep`` tokens of a prompt.

    Args:
        ids: the prompt ids.
        keep: how many to keep (1 <= keep).
        truncation_mode: ``keep_end`` (drop the left side, keeping a leading BOS) or
            ``keep_start`` (drop the right side).
        bos_id: the BOS id, or None.

    Returns:
        The kept ids.
    """
    ids = list(ids)
    if keep >= len(ids):
        return ids
    if truncation_mode == "keep_start":
        return ids[:keep]
    if bos_id is not None and ids and ids[0] == bos_id:
        return [bos_id] + ids[len(ids) - (keep - 1) :]
    return ids[len(ids) - keep :]
