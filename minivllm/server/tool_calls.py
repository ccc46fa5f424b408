"""The Hermes tool-call parser (vLLM's ``hermes``, the format of Qwen3's chat template),
and the constraint that forces a call for ``tool_choice`` ``required`` or a named function.

A call is a block ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in a
choice's content (after any reasoning). One parser reads a stream and a whole text (the
whole text is one piece of a stream), so a stream always reassembles into the whole response:

- A block whose body starts as Qwen3 writes a call, ``{"name": <string>, "arguments": {``
  (the "head", whitespace free), is a call from the moment its head is complete: a stream
  sends the name then, and the arguments as they are written. The arguments are the text
  of that object as the model wrote it, to its matching ``}`` (strings and escapes read
  as JSON, so a ``</tool_call>`` or ``<think>`` inside a string is argument text); the
  block ends at the first ``</tool_call>`` after them, or with the text. Under
  ``tool_choice`` ``required`` or a named function the grammar makes them valid JSON; a
  model left free may write them wrong, and they reach the client as written (as an
  OpenAI model's arguments may).
- Any other block is read whole, up to its first ``</tool_call>`` (or the end of the text):
  a JSON object with exactly ``name`` (a non-empty string) and ``arguments`` (an object) in
  another order is a call, its arguments that object as JSON text; anything else stays in
  the content as written, tags included.
- The text outside the call blocks is the content, less the whitespace that touches a
  call (the newlines Qwen3 writes around its blocks); empty content is None.
- Without parallel calls only the first call is reported; later ones are dropped.

vLLM differs: its whole response keeps only the text before the first block as content
(text between and after calls is lost), one malformed block makes all of it content, and it
ends a block at the first ``</tool_call>`` even inside a string.
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


def extract_tool_calls(text: str, new_id: Callable[[], str], parallel: bool = True) -> ToolCallSplit:
    """Split a whole content into text and calls (the module docstring's rules): the stream
    parser fed the whole text at once. ``new_id`` is called once per reported call, in order."""
    stream = ToolCallStream(new_id, parallel)
    content: list[str] = []
    calls: list[list[str]] = []
    for e in stream.feed(text) + stream.finish():
        if isinstance(e, ContentDelta):
            content.append(e.text)
        elif isinstance(e, ToolCallStart):
            calls.append([e.id, e.name, ""])
        else:
            calls[e.index][2] += e.arguments
    return ToolCallSplit("".join(content) or None, tuple(ParsedToolCall(*c) for c in calls))


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


_SPACE = " \t\r\n"
# The head of a call as Qwen3 writes it, after ``<tool_call>``: these pieces in order, with
# whitespace allowed before each, the name a JSON string at ``_NAME``.
_HEAD = ("{", '"name"', ":", None, ",", '"arguments"', ":", "{")
_NAME = 3


def read_head(body: str) -> tuple[str, str, int]:
    """Whether a block's ``body`` starts with a call's head: ``("call", name, i)`` with the
    arguments' ``{`` at ``i``; ``("wait", "", 0)`` while the body could still become one;
    ``("no", "", 0)`` once it cannot."""
    i, n = 0, len(body)
    for k, piece in enumerate(_HEAD):
        while i < n and body[i] in _SPACE:
            i += 1
        if i == n:
            return "wait", "", 0
        if k == _NAME:
            if body[i] != '"':
                return "no", "", 0
            j, escaped = i + 1, False
            while j < n and (escaped or body[j] != '"'):
                escaped = not escaped and body[j] == "\\"
                j += 1
            if j == n:
                return "wait", "", 0
            try:
                name = json.loads(body[i:j + 1])
            except ValueError:
                return "no", "", 0
            if not name:
                return "no", "", 0
            i = j + 1
            continue
        assert piece is not None
        if not body.startswith(piece, i):
            return ("wait", "", 0) if piece.startswith(body[i:]) else ("no", "", 0)
        i += len(piece)
    return "call", name, i - 1


class _Block:
    """An open ``<tool_call>`` block: its body so far and what it has been found to be."""

    def __init__(self) -> None:
        self.body = ""
        self.kind = "wait"        # "wait": its head undecided; "call": a call; "other": read whole
        self.searched = 0         # body length already searched for </tool_call>
        self.index = -1           # the call's index, -1 while not reported
        self.sent = 0             # the body up to here is sent (a call's arguments)
        self.depth = 0            # a call's arguments: nesting, string and escape state
        self.in_string = False
        self.escaped = False
        self.done = -1            # a call's arguments end here (-1: still open)

    def end_tag(self) -> int:
        """Where ``</tool_call>`` starts in the body (searched past a call's arguments), or -1."""
        start = max(self.searched - len(TOOL_CALL_END) + 1, self.done if self.kind == "call" else 0)
        found = self.body.find(TOOL_CALL_END, max(0, start))
        self.searched = len(self.body)
        return found

    def scan_arguments(self) -> None:
        """Read the arguments from ``sent`` on, as JSON text, until their object closes."""
        body, i = self.body, self.sent
        while i < len(body) and self.done < 0:
            c = body[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = i + 1
            i += 1


class ToolCallStream:
    """The Hermes parser fed the content piece by piece: it returns what each piece decides,
    in order (the module docstring's rules). Held back until decided: a possible
    ``<tool_call>`` start (``<tool_``), a block's head until it is complete (or cannot be),
    a block read whole until it closes, and whitespace that a following call would drop.
    ``finish()`` releases the rest.
    """

    def __init__(self, new_id: Callable[[], str], parallel: bool = True) -> None:
        self._new_id = new_id
        self._parallel = parallel
        self._pending = ""     # content that may be the start of <tool_call>
        self._block: _Block | None = None
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
                self._block = _Block()
                text = tail
                continue
            keep = held_back(text, TOOL_CALL_START)
            self._content(text[:len(text) - keep], events)
            self._pending = text[len(text) - keep:]
            break
        return events

    def finish(self) -> list[ToolCallEvent]:
        """The end of the content: an open block ends with it, held text is released."""
        events: list[ToolCallEvent] = []
        block = self._block
        if block is not None:
            self._block = None
            if block.kind != "call":
                self._close_whole(block.body, False, events)
        self._content(self._pending, events)
        self._pending = ""
        if self._space:
            events.append(ContentDelta(self._space))
            self._space = ""
        return events

    def _grow_block(self, text: str, events: list[ToolCallEvent]) -> str:
        """Add ``text`` to the open block and send what it decides. Returns what follows the
        block ("" while it stays open)."""
        block = self._block
        assert block is not None
        block.body += text
        if block.kind == "wait":
            kind, name, start = read_head(block.body)
            if kind == "call":
                self._start_call(block, name, start, events)
            elif kind == "no":
                block.kind = "other"
        if block.kind == "call":
            block.scan_arguments()
            upto = block.done if block.done >= 0 else len(block.body)
            if block.index >= 0 and upto > block.sent:
                events.append(ToolCallArguments(block.index, block.body[block.sent:upto]))
            block.sent = upto
            if block.done < 0:
                return ""
        end = block.end_tag()
        if end < 0:
            return ""
        self._block = None
        if block.kind != "call":  # a head that never completed, or another block: read whole
            self._close_whole(block.body[:end], True, events)
        return block.body[end + len(TOOL_CALL_END):]

    def _start_call(self, block: _Block, name: str, start: int, events: list[ToolCallEvent]) -> None:
        block.kind, block.sent = "call", start
        self._space, self._after_call = "", True
        if self._parallel or self._num_calls == 0:
            block.index = self._num_calls
            self._num_calls += 1
            events.append(ToolCallStart(block.index, self._new_id(), name))

    def _close_whole(self, body: str, closed: bool, events: list[ToolCallEvent]) -> None:
        """A block read whole: a call in another order, or content as written."""
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
    return _reasoning_first(st, calls, reasoning)


def _reasoning_first(st: Any, body: Any, reasoning: ReasoningMode) -> Any:
    """The structural-tag format ``body``, after a ``<think>`` block as ``reasoning`` allows
    (``tool_choice_constraint``'s modes; ``st``: xgrammar's module)."""
    if reasoning == "none":
        return body
    thought = st.AnyTextFormat(excludes=[THINK_START, THINK_END])
    after_thought = st.ConstStringFormat(value=REASONING_SEPARATOR)
    if reasoning == "open":
        return st.SequenceFormat(elements=[st.TagFormat(begin="", content=thought, end=THINK_END),
                                           after_thought, body])
    think = st.TagFormat(begin=THINK_START, content=thought, end=THINK_END)
    return st.OrFormat(elements=[st.SequenceFormat(elements=[think, after_thought, body]), body])


def after_reasoning(spec: StructuredOutputs, reasoning: ReasoningMode) -> StructuredOutputs:
    """``spec``'s constraint on the answer, after a reasoning block as ``reasoning`` allows
    (``tool_choice_constraint``'s modes; ``"none"``: ``spec`` itself): as vLLM applies a
    grammar once the reasoning has ended, so that a reasoning model thinks first.

    Raises:
        ValueError: a constraint xgrammar cannot compile (the message names ``spec``'s kind).
    """
    if reasoning == "none":
        return spec
    import xgrammar
    from xgrammar import structural_tag as st
    if spec.json is not None or spec.json_object:
        schema = valid_json_strings(json.loads(spec.json)) if spec.json is not None else {"type": "object"}
        body: Any = st.JSONSchemaFormat(json_schema=schema)
    elif spec.regex is not None:
        body = st.RegexFormat(pattern=spec.regex)
    elif spec.choice is not None:
        body = st.GrammarFormat(grammar="root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
    else:
        assert spec.grammar is not None
        body = st.GrammarFormat(grammar=spec.grammar)
    try:
        grammar = xgrammar.Grammar.from_structural_tag(st.StructuralTag(format=_reasoning_first(st, body, reasoning)))
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"structured_outputs.{spec.kind}: cannot be compiled into a grammar: {e}") from e
    return StructuredOutputs(grammar=str(grammar))
