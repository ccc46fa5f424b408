"""The Hermes tool-call parser (vLLM's ``hermes``, the format of Qwen3's chat template),
and the constraint that forces a call for ``tool_choice`` ``required`` or a named function.

A call is a block ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in a
choice's content (after any reasoning). Rules, the same for a whole text and a stream:

- A block's body (up to the first ``</tool_call>``, or to the end of the text when the
  block never closes) must be a JSON object with exactly ``name`` (a non-empty string)
  and ``arguments`` (an object); the call's ``arguments`` are that object as JSON text.
  Any other block (bad JSON, other keys) stays in the content as written, tags included.
- The text outside the call blocks is the content, less the whitespace that touches a
  call (the newlines Qwen3 writes around its blocks); empty content is None.
- Without parallel calls only the first call is reported; later ones are dropped.

vLLM differs: its whole response keeps only the text before the first block as content
(text between and after calls is lost), and one malformed block makes all of it content;
its stream sends arguments as partial JSON while the block is still open. Here a stream
sends a call once its block is closed (a block's JSON is valid only once complete, and a
call already sent cannot be taken back), so a stream always reassembles into the whole
response.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union

from minivllm.sampling import StructuredOutputs
from minivllm.server.reasoning import THINK_END, THINK_START, held_back
from minivllm.structured import valid_json_strings

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
# How Qwen3's template writes a call (and how the constraint makes the model write it).
CALL_HEAD = TOOL_CALL_START + '\n{"name": '
CALL_ARGUMENTS = ', "arguments": '
CALL_TAIL = "}\n" + TOOL_CALL_END
CALL_SEPARATOR = "\n"
REASONING_SEPARATOR = "\n\n"  # what Qwen3 writes between </think> and its answer

ReasoningMode = Literal["none", "optional", "open"]


@dataclass(frozen=True)
class ParsedToolCall:
    """One call: its id (``call_<hex>``), the function's name, its arguments as JSON text."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallSplit:
    """A choice's content split into text (None when empty) and calls."""

    content: str | None
    tool_calls: tuple[ParsedToolCall, ...]


def new_tool_call_id() -> str:
    """A call id ``call_<24 random hex digits>``: unique per call, seeded request or not (a
    seeded agent loop would otherwise hand its tools one id twice)."""
    return f"call_{secrets.token_hex(12)}"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_call(body: str) -> tuple[str, str] | None:
    """``(name, arguments as JSON text)`` of a block's body, or None if it is not a call."""
    try:
        obj = json.loads(body, parse_constant=_no_constant)
    except ValueError:  # json.JSONDecodeError is one, and so are NaN / Infinity
        return None
    if not isinstance(obj, dict) or set(obj) != {"name", "arguments"}:
        return None
    name, arguments = obj["name"], obj["arguments"]
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments, ensure_ascii=False)


def _strip_segments(segments: list[str]) -> str:
    """The content: text segments between call blocks, less the whitespace touching a call."""
    if len(segments) == 1:
        return segments[0]
    last = len(segments) - 1
    return "".join(s.strip() if 0 < i < last else s.rstrip() if i == 0 else s.lstrip()
                   for i, s in enumerate(segments))


def extract_tool_calls(text: str, new_id: Callable[[], str], parallel: bool = True) -> ToolCallSplit:
    """Split a whole content into text and calls (see the module docstring for the rules).

    ``new_id`` is called once per reported call, in order.
    """
    segments: list[str] = []
    current: list[str] = []
    calls: list[ParsedToolCall] = []
    pos = 0
    while (start := text.find(TOOL_CALL_START, pos)) >= 0:
        current.append(text[pos:start])
        body_start = start + len(TOOL_CALL_START)
        end = text.find(TOOL_CALL_END, body_start)
        body_end = end if end >= 0 else len(text)
        pos = end + len(TOOL_CALL_END) if end >= 0 else len(text)
        call = parse_call(text[body_start:body_end])
        if call is None:
            current.append(text[start:pos])
            continue
        segments.append("".join(current))
        current = []
        if parallel or not calls:
            calls.append(ParsedToolCall(new_id(), *call))
    current.append(text[pos:])
    segments.append("".join(current))
    return ToolCallSplit(_strip_segments(segments) or None, tuple(calls))


@dataclass(frozen=True)
class ContentDelta:
    """Streamed content text."""

    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A call begins: the first chunk of call ``index`` names its id and function."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    """More of call ``index``'s arguments (JSON text, to be appended)."""

    index: int
    arguments: str


ToolCallEvent = Union[ContentDelta, ToolCallStart, ToolCallArguments]


class ToolCallStream:
    """The incremental form of ``extract_tool_calls``: fed the content piece by piece, it
    returns what each piece decides, in order. Held back until decided: a possible
    ``<tool_call>`` start (``<tool_``), an open block (until it closes), and whitespace
    that a following call would drop. ``finish()`` releases the rest. Concatenated, the
    events equal ``extract_tool_calls`` of the whole text, given the same ``new_id``.
    """

    def __init__(self, new_id: Callable[[], str], parallel: bool = True) -> None:
        self._new_id = new_id
        self._parallel = parallel
        self._pending = ""     # content that may be the start of <tool_call>
        self._block: str | None = None  # the body of an open block
        self._searched = 0     # body length already searched for </tool_call>
        self._space = ""       # trailing whitespace of the content so far
        self._after_call = False  # no content since the last call: leading whitespace goes
        self._num_calls = 0

    def feed(self, piece: str) -> list[ToolCallEvent]:
        """The events that ``piece`` decides."""
        events: list[ToolCallEvent] = []
        text = self._pending + piece
        self._pending = ""
        while text:
            if self._block is not None:
                text = self._grow_block(text, events)
                continue
            head, found, tail = text.partition(TOOL_CALL_START)
            if found:
                self._content(head, events)
                self._block, self._searched = "", 0
                text = tail
                continue
            keep = held_back(text, TOOL_CALL_START)
            self._content(text[:len(text) - keep], events)
            self._pending = text[len(text) - keep:]
            break
        return events

    def finish(self) -> list[ToolCallEvent]:
        """The end of the content: an open block is parsed as it is, held text released."""
        events: list[ToolCallEvent] = []
        if self._block is not None:
            self._close_block(self._block, False, events)
        self._content(self._pending, events)
        self._pending = ""
        if self._space:
            events.append(ContentDelta(self._space))
            self._space = ""
        return events

    def _grow_block(self, text: str, events: list[ToolCallEvent]) -> str:
        """Add ``text`` to the open block; close it if its end tag is there. Returns what
        follows the block ("" while it stays open)."""
        assert self._block is not None
        body = self._block + text
        end = body.find(TOOL_CALL_END, max(0, self._searched - len(TOOL_CALL_END) + 1))
        if end < 0:
            self._block, self._searched = body, len(body)
            return ""
        self._close_block(body[:end], True, events)
        return body[end + len(TOOL_CALL_END):]

    def _close_block(self, body: str, closed: bool, events: list[ToolCallEvent]) -> None:
        self._block = None
        call = parse_call(body)
        if call is None:
            self._content(TOOL_CALL_START + body + (TOOL_CALL_END if closed else ""), events)
            return
        self._space, self._after_call = "", True
        if self._parallel or self._num_calls == 0:
            index, (name, arguments) = self._num_calls, call
            self._num_calls += 1
            events.append(ToolCallStart(index, self._new_id(), name))
            events.append(ToolCallArguments(index, arguments))

    def _content(self, text: str, events: list[ToolCallEvent]) -> None:
        """Text outside the calls; its trailing whitespace waits for what follows."""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        body = text.rstrip()
        if not body:
            self._space += text
            return
        events.append(ContentDelta(self._space + body))
        self._space = text[len(body):]


# ---- tool_choice: required or a named function ---------------------------------------

def _function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    """The ``function`` object of an OpenAI tool (``{"type": "function", "function": ...}``)."""
    return tool["function"]


def forced_tools(tools: Sequence[Mapping[str, Any]], tool_choice: Any) -> list[Mapping[str, Any]] | None:
    """The functions a ``tool_choice`` forces the model to call from: all of them for
    ``required``, the named one for ``{"type": "function", "function": {"name": ...}}``;
    None for ``auto`` and ``none``.

    Raises:
        ValueError: ``required`` without tools, or a named function that is not a tool.
    """
    if tool_choice in (None, "auto", "none"):
        return None
    functions = [_function(t) for t in tools]
    if tool_choice == "required":
        if not functions:
            raise ValueError("tool_choice: 'required' needs at least one tool in tools")
        return functions
    name = tool_choice["function"]["name"]
    named = [f for f in functions if f["name"] == name]
    if not named:
        raise ValueError(f"tool_choice: function {name!r} is not among the tools "
                         f"({[f['name'] for f in functions]})")
    return named[:1]


def tool_choice_constraint(tools: Sequence[Mapping[str, Any]], tool_choice: Any,
                           parallel_tool_calls: bool = True, reasoning: ReasoningMode = "none"
                           ) -> StructuredOutputs | None:
    """The grammar that makes the model call a tool, for ``tool_choice`` ``required`` or a
    named function (None for ``auto`` and ``none``).

    The grammar's language is the Hermes text itself: one call block (or, for ``required``
    with parallel calls, several separated by newlines), written as Qwen3's template writes a call, with
    each function's name fixed and its arguments matching its ``parameters`` JSON schema
    (any JSON object when it has none). A grammar rather than a bare JSON schema keeps the
    model on the format it was trained to write, lets the same Hermes parser read every
    response (streamed too), and can let the model reason first:

    - ``reasoning="none"``: the output is the calls alone.
    - ``"optional"``: a ``<think>...</think>`` block and a blank line may come first (the
      prompt leaves the model free to think).
    - ``"open"``: the output starts inside the reasoning (the prompt opened ``<think>``)
      and the calls follow its ``</think>`` and a blank line.

    The result is an EBNF grammar in xgrammar's dialect, built through xgrammar's
    structural tags (which turn each JSON schema into rules).

    Raises:
        ValueError: as ``forced_tools``; a ``parameters`` schema xgrammar cannot compile.
    """
    functions = forced_tools(tools, tool_choice)
    if functions is None:
        return None
    parallel = parallel_tool_calls and tool_choice == "required"  # a named function: one call
    try:
        import xgrammar
        from xgrammar import structural_tag as st
    except ImportError as e:
        raise ValueError(f"tool_choice {tool_choice!r} needs the xgrammar package: {e}") from e
    try:  # xgrammar's errors (ValueError, RuntimeError) for a schema it cannot compile
        grammar = xgrammar.Grammar.from_structural_tag(
            st.StructuralTag(format=_calls_format(st, functions, parallel, reasoning)))
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"tools: a parameters schema cannot be compiled into a grammar: {e}") from e
    return StructuredOutputs(grammar=str(grammar))


def _calls_format(st: Any, functions: list[Mapping[str, Any]], parallel: bool,
                  reasoning: ReasoningMode) -> Any:
    """The structural-tag format of ``tool_choice_constraint`` (``st``: xgrammar's module)."""
    tags = [st.TagFormat(begin=CALL_HEAD + json.dumps(f["name"]) + CALL_ARGUMENTS,
                         content=st.JSONSchemaFormat(json_schema=valid_json_strings(f.get("parameters")
                                                                                    or {"type": "object"})),
                         end=CALL_TAIL)
            for f in functions]
    calls = st.TagsWithSeparatorFormat(tags=tags, separator=CALL_SEPARATOR, at_least_one=True,
                                       stop_after_first=not parallel)
    if reasoning == "none":
        return calls
    thought = st.AnyTextFormat(excludes=[THINK_START, THINK_END])
    after_thought = st.ConstStringFormat(value=REASONING_SEPARATOR)
    if reasoning == "open":
        return st.SequenceFormat(elements=[st.TagFormat(begin="", content=thought, end=THINK_END),
                                           after_thought, calls])
    think = st.TagFormat(begin=THINK_START, content=thought, end=THINK_END)
    return st.OrFormat(elements=[st.SequenceFormat(elements=[think, after_thought, calls]), calls])
