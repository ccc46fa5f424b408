"""Qwen3's reasoning parser: a choice's text split into ``reasoning_content`` and ``content``.

Qwen3 writes its reasoning as ``<think>...</think>`` before the answer. Semantics (one
reasoning block at most, decided from the text so far and the prompt, so the streamed
split always equals the whole one):

- ``in_reasoning`` false (the prompt leaves no ``<think>`` open, e.g. Qwen3 with thinking
  on, whose output starts with ``<think>``, or off, whose prompt holds an empty block):
  a ``<think>`` opens the reasoning only as the reply's first text (whitespace before it is
  content); the reasoning runs up to the first ``</think>``, the rest is content. A reply
  that starts otherwise is all content, tags included: a ``<think>`` later on (inside a tool
  call's arguments, say) is text the model wrote, not its reasoning.
- ``in_reasoning`` true (the template opened ``<think>`` in the prompt, as the Qwen3
  thinking-only models' templates do): the text is reasoning up to the first
  ``</think>``, the rest is content.
- Without its ``</think>`` (cut by ``max_tokens``) the reasoning runs to the end.
- After ``</think>`` every tag is plain content. The tags themselves are dropped;
  whitespace is kept as written (as vLLM keeps it).

vLLM's ``qwen3`` parser agrees when the output holds ``</think>``. It differs in three
cases, each chosen so that streaming and a whole response agree: vLLM's whole response
calls everything content when ``</think>`` is missing, while its stream calls it
reasoning (here: reasoning, both ways); vLLM calls the text before a ``</think>``
reasoning even when no ``<think>`` opened it and the prompt did not either (here:
content, tag included, since a stream has sent that text as content before the tag
comes); and vLLM splits at a ``<think>`` anywhere (here: only at the reply's start).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"


def prompt_opens_reasoning(opening: str) -> bool:
    """Whether the prompt's opening of the reply (the template's generation prompt, not the
    conversation, where a user may write the tag) ends inside a ``<think>`` block: the
    completion then starts in the reasoning."""
    return opening.rfind(THINK_START) > opening.rfind(THINK_END)


@dataclass(frozen=True)
class ReasoningSplit:
    """A choice's text split in two; an empty part is None (as the OpenAI API sends it)."""

    reasoning_content: str | None
    content: str | None


def split_reasoning(text: str, in_reasoning: bool = False) -> ReasoningSplit:
    """Split a whole completion (see the module docstring for the rules)."""
    before = ""
    if not in_reasoning:
        body = text.lstrip()
        if not body.startswith(THINK_START):
            return ReasoningSplit(None, text or None)
        before, text = text[:len(text) - len(body)], body[len(THINK_START):]
    reasoning, _, after = text.partition(THINK_END)
    return ReasoningSplit(reasoning or None, before + after or None)


@dataclass(frozen=True)
class ReasoningDelta:
    """What one piece of streamed text adds to each part ("" when nothing)."""

    reasoning_content: str = ""
    content: str = ""


class _Phase(enum.Enum):
    BEFORE = "before"        # only whitespace so far; a <think> opens the reasoning
    REASONING = "reasoning"  # reasoning; a </think> ends it
    AFTER = "after"          # content, tags included


def held_back(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that could be the start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """The incremental form of ``split_reasoning``: fed a choice's text piece by piece, it
    says what each piece adds to the reasoning and to the content. Text that could be the
    start of the tag it waits for (``<thi``) is held back until the next piece decides it;
    ``finish()`` releases it. Concatenated, the deltas equal ``split_reasoning`` of the
    whole text (None parts as "").
    """

    def __init__(self, in_reasoning: bool = False) -> None:
        self._phase = _Phase.REASONING if in_reasoning else _Phase.BEFORE
        self._pending = ""  # text not yet assigned: a possible tag start

    def feed(self, piece: str) -> ReasoningDelta:
        """The parts of ``piece`` that are decided now."""
        reasoning: list[str] = []
        content: list[str] = []
        text = self._pending + piece
        self._pending = ""
        while text:
            if self._phase is _Phase.AFTER:
                content.append(text)
                break
            if self._phase is _Phase.BEFORE:
                body = text.lstrip()
                content.append(text[:len(text) - len(body)])  # whitespace is content either way
                if body.startswith(THINK_START):
                    self._phase, text = _Phase.REASONING, body[len(THINK_START):]
                elif THINK_START.startswith(body):  # "<thi" (or nothing yet): wait for more
                    self._pending = body
                    break
                else:
                    self._phase, text = _Phase.AFTER, body
                continue
            head, found, tail = text.partition(THINK_END)
            if found:
                reasoning.append(head)
                self._phase, text = _Phase.AFTER, tail
                continue
            keep = held_back(text, THINK_END)
            reasoning.append(text[:len(text) - keep])
            self._pending = text[len(text) - keep:]
            break
        return ReasoningDelta("".join(reasoning), "".join(content))

    def finish(self) -> ReasoningDelta:
        """The held-back text, at the end of the choice: a tag that never completed is text."""
        rest, self._pending = self._pending, ""
        if self._phase is _Phase.REASONING:
            return ReasoningDelta(reasoning_content=rest)
        return ReasoningDelta(content=rest)
