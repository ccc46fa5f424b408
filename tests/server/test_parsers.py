"""Qwen3 reasoning and Hermes tool calls without a model: the fixture tokenizer and its chat
template, the parsers (whole and streamed, property-tested over random splits), and the
grammar that ``tool_choice`` ``required`` / a named function turns into."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.server.reasoning import (ReasoningSplit, ReasoningStream, prompt_opens_reasoning,
                                       split_reasoning)
from minivllm.server.tool_calls import (ContentDelta, ParsedToolCall, ToolCallArguments, ToolCallSplit,
                                        TOOL_CALL_END, ToolCallStart, ToolCallStream, extract_tool_calls,
                                        forced_tools, new_tool_call_id, tool_choice_constraint)

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "fixtures" / "qwen3-chat-tokenizer"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
    "required": ["a", "b"]}}}
NO_PARAMS = {"type": "function", "function": {"name": "now"}}


def call_text(name: str, arguments: dict) -> str:
    """A call as Qwen3 writes it."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


# ---- the fixture tokenizer and its chat template --------------------------------------------

@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(FIXTURE))


def test_fixture_has_qwen3s_added_tokens(tokenizer) -> None:
    added = {t.content: t for t in tokenizer.added_tokens_decoder.values()}
    assert {"<|endoftext|>", "<|im_start|>", "<|im_end|>"} <= {k for k, t in added.items() if t.special}
    text_tokens = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
    assert all(not added[t].special for t in text_tokens)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    text = "<think>\nhmm\n</think>\n\n" + call_text("get_weather", {"city": "Paris"})
    ids = tokenizer.encode(text + "<|im_end|>", add_special_tokens=False)
    # Each tag is one token; decoding as a completion is decoded drops only the ChatML markers.
    for tag in text_tokens[:4]:
        assert tokenizer.convert_tokens_to_ids(tag) in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert sum(p.stat().st_size for p in FIXTURE.iterdir()) < 100_000


def test_fixture_is_rebuilt_byte_for_byte(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "fixtures" / "make_qwen3_chat_tokenizer.py"), "--out",
                    str(tmp_path)], check=True, capture_output=True, timeout=120,
                   env=os.environ | {"RAYON_NUM_THREADS": "1"})
    names = sorted(p.name for p in FIXTURE.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == names
    for name in names:
        assert (tmp_path / name).read_bytes() == (FIXTURE / name).read_bytes(), name


def test_template_renders_tools_calls_and_responses(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Weather in Paris and 2+3?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
        {"role": "tool", "tool_call_id": "call_2", "content": "5"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=[WEATHER, ADD], tokenize=False,
                                         add_generation_prompt=True)
    want_system = ("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\nYou may call one or more "
                   "functions to assist with the user query.\n\nYou are provided with function signatures "
                   "within <tools></tools> XML tags:\n<tools>\n" + json.dumps(WEATHER) + "\n"
                   + json.dumps(ADD) + "\n</tools>\n\nFor each function call, return a json object with "
                   "function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                   '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n')
    assert text == (want_system
                    + "<|im_start|>user\nWeather in Paris and 2+3?<|im_end|>\n"
                    + "<|im_start|>assistant\n" + call_text("get_weather", {"city": "Paris"}) + "\n"
                    + call_text("add", {"a": 2, "b": 3}) + "<|im_end|>\n"
                    + '<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response>\n'
                    + "<tool_response>\n5\n</tool_response><|im_end|>\n"
                    + "<|im_start|>assistant\n")


def test_template_thinking_switch_and_history(tokenizer) -> None:
    user = [{"role": "user", "content": "hi"}]
    render = lambda msgs, **kw: tokenizer.apply_chat_template(msgs, tokenize=False, **kw)  # noqa: E731
    assert render(user, add_generation_prompt=True) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    off = render(user, add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render(user, add_generation_prompt=True, enable_thinking=True) == render(user, add_generation_prompt=True)
    assert render(user) == "<|im_start|>user\nhi<|im_end|>\n"
    # An earlier turn's reasoning is dropped; the turn after the last query keeps it.
    turns = [*user, {"role": "assistant", "content": "<think>\nold\n</think>\n\nhello"},
             {"role": "user", "content": "more"},
             {"role": "assistant", "content": "sure", "reasoning_content": "new"}]
    assert render(turns) == ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
                             "<|im_start|>user\nmore<|im_end|>\n"
                             "<|im_start|>assistant\n<think>\nnew\n</think>\n\nsure<|im_end|>\n")
    with pytest.raises(Exception, match="unknown message role"):
        render([{"role": "robot", "content": "x"}])


# ---- reasoning --------------------------------------------------------------------------------

@pytest.mark.parametrize("text, in_reasoning, reasoning, content", [
    ("<think>\nsteps\n</think>\n\nanswer", False, "\nsteps\n", "\n\nanswer"),
    ("plain answer", False, None, "plain answer"),
    ("", False, None, None),
    ("<think>cut off by max_tokens", False, "cut off by max_tokens", None),
    ("<think>all</think>", False, "all", None),
    ("<think></think>x", False, None, "x"),
    ("pre <think>r</think> post", False, None, "pre <think>r</think> post"),  # opens only at the start
    (" \n<think>r</think> post", False, "r", " \n post"),
    ('<tool_call>{"q": "<think>"}</tool_call>', False, None, '<tool_call>{"q": "<think>"}</tool_call>'),
    ("a</think>b", False, None, "a</think>b"),         # no <think> anywhere: all content
    ("<think>r</think>x<think>y</think>", False, "r", "x<think>y</think>"),
    ("steps</think>answer", True, "steps", "answer"),   # the prompt opened <think>
    ("still thinking", True, "still thinking", None),
    ("<think>r</think>x", True, "<think>r", "x"),
])
def test_split_reasoning(text: str, in_reasoning: bool, reasoning: str | None, content: str | None) -> None:
    assert split_reasoning(text, in_reasoning) == ReasoningSplit(reasoning, content)
    assert streamed_reasoning([text], in_reasoning) == ReasoningSplit(reasoning, content)


def test_prompt_opens_reasoning(tokenizer) -> None:
    user = [{"role": "user", "content": "hi"}]
    on = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    off = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert not prompt_opens_reasoning(on) and not prompt_opens_reasoning(off)
    assert prompt_opens_reasoning(on + "<think>\n")


def streamed_reasoning(pieces: list[str], in_reasoning: bool) -> ReasoningSplit:
    stream = ReasoningStream(in_reasoning)
    deltas = [stream.feed(p) for p in pieces] + [stream.finish()]
    reasoning = "".join(d.reasoning_content for d in deltas)
    content = "".join(d.content for d in deltas)
    return ReasoningSplit(reasoning or None, content or None)


def test_reasoning_stream_holds_back_only_a_possible_tag() -> None:
    stream = ReasoningStream()
    assert stream.feed(" \n<thi").content == " \n"   # whitespace first: a <think> may still open
    d = stream.feed("nk>x <")
    assert (d.content, d.reasoning_content) == ("", "x ")
    d = stream.feed("b</th")     # "<b" is not the start of </think>
    assert d.reasoning_content == "<b"
    d = stream.feed("ink><think")
    assert (d.reasoning_content, d.content) == ("", "<think")  # after the block, a tag is text
    assert stream.finish().content == ""
    late = ReasoningStream()
    assert late.feed("abc<thi").content == "abc<thi"  # text first: no reasoning, nothing held
    assert late.feed("nk>x").content == "nk>x"
    cut = ReasoningStream()
    assert cut.feed("<thin").content == ""
    assert cut.finish().content == "<thin"  # a tag that never completed is text


def split_points(draw: st.DrawFn, text: str) -> list[str]:
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


# Pieces that make tags, near-tags, calls, malformed calls and whitespace likely.
ATOMS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<", "<t", "<think", "<tool_", "</",
         "</tool_call", "\n", "\n\n", " ", "a", "é", "中", "x y", "{", "}",
         '{"name": "f", "arguments": {"x": 1}}', '\n{"name": "get_weather", "arguments": {"city": "中"}}\n',
         '{"name": "g", "arguments": {}}', '{"name": "f"}', '{"name": "f", "arguments": [1]}', '{bad']


@st.composite
def split_texts(draw: st.DrawFn) -> tuple[str, list[str]]:
    text = "".join(draw(st.lists(st.sampled_from(ATOMS), max_size=20)))
    return text, split_points(draw, text)


@settings(max_examples=300, deadline=None)
@given(case=split_texts(), in_reasoning=st.booleans())
def test_streamed_reasoning_equals_whole(case: tuple[str, list[str]], in_reasoning: bool) -> None:
    text, pieces = case
    assert streamed_reasoning(pieces, in_reasoning) == split_reasoning(text, in_reasoning)


# ---- tool calls -------------------------------------------------------------------------------

def tool_call_ids(seed: int) -> Callable[[], str]:
    """A fixed sequence of call ids (the server's are random), so that two parses compare."""
    n = itertools.count()
    return lambda: f"call_{seed:04x}{next(n):020x}"


def ids() -> list[str]:
    new = tool_call_ids(seed=7)
    return [new() for _ in range(3)]


@pytest.mark.parametrize("text, parallel, content, calls", [
    (call_text("get_weather", {"city": "Paris"}), True, None, [("get_weather", '{"city": "Paris"}')]),
    ("Let me check.\n\n" + call_text("get_weather", {"city": "Paris"}) + "\n" + call_text("add", {"a": 2, "b": 3}),
     True, "Let me check.", [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 2, "b": 3}')]),
    (call_text("add", {"a": 1, "b": 2}) + "\n" + call_text("add", {"a": 3, "b": 4}), False, None,
     [("add", '{"a": 1, "b": 2}')]),
    ("no calls here\n", True, "no calls here\n", []),
    ("<tool_call>{bad json}</tool_call> tail", True, "<tool_call>{bad json}</tool_call> tail", []),
    ('<tool_call>{"name": "f", "arguments": "x"}</tool_call>', True,
     '<tool_call>{"name": "f", "arguments": "x"}</tool_call>', []),
    # After a complete head a block is a call: its arguments as written, to their closing brace.
    ('<tool_call>{"name": "f", "arguments": {}, "extra": 1}</tool_call>', True, None, [("f", "{}")]),
    ('<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', True, None, [("f", '{"x": NaN}')]),
    ('<tool_call>{"name": "f", "arguments": {"s": "</tool_call>", "t": "<think>}"}}</tool_call> ok', True, "ok",
     [("f", '{"s": "</tool_call>", "t": "<think>}"}')]),
    ('<tool_call>{"name": "f", "arguments": {"s": "a\\"}</tool_call>b"}}</tool_call>', True, None,
     [("f", '{"s": "a\\"}</tool_call>b"}')]),
    # Another key order is read whole, normalised; a head that cannot be is content.
    ('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', True, None, [("f", '{"a": 1}')]),
    ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', True, '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
     []),
    # Text between and after calls stays, less the whitespace touching the calls.
    ("a " + call_text("f", {}) + " b \n" + call_text("g", {"s": "é"}) + "\n c ", True, "abc ",
     [("f", "{}"), ("g", '{"s": "\\u00e9"}')]),
    # A malformed block between calls is text; a valid block left open at the end is a call.
    (call_text("f", {}) + "\n<tool_call>{</tool_call>\n" + '<tool_call>{"name": "g", "arguments": {}}', True,
     "<tool_call>{</tool_call>", [("f", "{}"), ("g", "{}")]),
    ('x <tool_call>{"name": "g", "argu', True, 'x <tool_call>{"name": "g", "argu', []),
    ("x <tool_", True, "x <tool_", []),
])
def test_extract_tool_calls(text: str, parallel: bool, content: str | None,
                            calls: list[tuple[str, str]]) -> None:
    want = ToolCallSplit(content, tuple(ParsedToolCall(i, n, a) for i, (n, a) in zip(ids(), calls)))
    assert extract_tool_calls(text, tool_call_ids(seed=7), parallel) == want
    assert streamed_tool_calls([text], parallel, seed=7) == want


def test_new_tool_call_ids_are_unique() -> None:
    got = {new_tool_call_id() for _ in range(64)}
    assert len(got) == 64 and all(i.startswith("call_") and len(i) == 29 for i in got)
    assert all(int(i[5:], 16) >= 0 for i in got)


def streamed_tool_calls(pieces: list[str], parallel: bool, seed: int) -> ToolCallSplit:
    """Reassemble a stream's events as a client does, checking their order on the way."""
    stream = ToolCallStream(tool_call_ids(seed=seed), parallel)
    events = [e for p in pieces for e in stream.feed(p)] + stream.finish()
    content, calls = [], []
    for e in events:
        if isinstance(e, ContentDelta):
            assert e.text
            content.append(e.text)
        elif isinstance(e, ToolCallStart):
            assert e.index == len(calls)
            calls.append([e.id, e.name, ""])
        else:
            assert isinstance(e, ToolCallArguments) and e.index == len(calls) - 1
            calls[e.index][2] += e.arguments
    return ToolCallSplit("".join(content) or None, tuple(ParsedToolCall(*c) for c in calls))


def test_tool_call_stream_holds_back_until_decided() -> None:
    stream = ToolCallStream(tool_call_ids(seed=0))
    assert stream.feed("Sure <tool_") == [ContentDelta("Sure")]   # " " waits: a call may follow
    assert stream.feed('call>\n{"name": "f", "argu') == []      # the head is not complete yet
    events = stream.feed('ments": {"x": ')                     # it is: the name, then the arguments
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArguments]
    assert (events[0].name, events[1].arguments) == ("f", '{"x": ')
    assert stream.feed('"</tool_call>') == [ToolCallArguments(0, '"</tool_call>')]  # inside a string
    events = stream.feed('"}}\n</tool_call>\nok')
    assert events == [ToolCallArguments(0, '"}'), ContentDelta("ok")]
    assert stream.feed(" <tool_call>{oops") == []
    assert stream.finish() == [ContentDelta(" <tool_call>{oops")]


@settings(max_examples=300, deadline=None)
@given(case=split_texts(), parallel=st.booleans())
def test_streamed_tool_calls_equal_whole(case: tuple[str, list[str]], parallel: bool) -> None:
    text, pieces = case
    assert streamed_tool_calls(pieces, parallel, seed=3) == extract_tool_calls(text, tool_call_ids(seed=3), parallel)


@settings(max_examples=200, deadline=None)
@given(case=split_texts(), in_reasoning=st.booleans())
def test_reasoning_then_tool_calls_stream_equals_whole(case: tuple[str, list[str]], in_reasoning: bool) -> None:
    """The server's order: reasoning split first, tool calls parsed from the content only."""
    text, pieces = case
    reasoning, tools = ReasoningStream(in_reasoning), ToolCallStream(tool_call_ids(seed=5))
    thought, events = [], []
    for delta in [reasoning.feed(p) for p in pieces] + [reasoning.finish()]:
        thought.append(delta.reasoning_content)
        events += tools.feed(delta.content)
    events += tools.finish()
    whole = split_reasoning(text, in_reasoning)
    want = extract_tool_calls(whole.content or "", tool_call_ids(seed=5))
    assert ("".join(thought) or None) == whole.reasoning_content
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == (want.content or "")
    assert [e.name for e in events if isinstance(e, ToolCallStart)] == [c.name for c in want.tool_calls]


def chat_parser(tool_choice: object = "auto", prompt: str = "<|im_start|>assistant\n"):
    """``chat_output_parser`` of a request giving WEATHER and ADD, on a server with both parsers."""
    from minivllm.server.chat_output import chat_output_parser
    from minivllm.server.protocol import ChatCompletionRequest, ServerConfig

    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER, ADD],
                                tool_choice=tool_choice, seed=11)
    return chat_output_parser(ServerConfig("m", reasoning_parser="qwen3", tool_call_parser="hermes"), req, prompt)


def streamed_message(parser, pieces: list[str]) -> dict:
    """A streamed choice reassembled as a client does, in the whole message's shape."""
    stream = parser.stream(0)
    fields: dict = {"content": "", "reasoning_content": ""}
    calls: list[dict] = []
    for delta in [d for p in pieces for d in stream.feed(p)] + stream.finish():
        fields["content"] += delta.content or ""
        fields["reasoning_content"] += delta.reasoning_content or ""
        for c in delta.tool_calls or []:
            if c.id is not None:
                calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": ""}})
            calls[c.index]["function"]["arguments"] += c.function.arguments
    fields["reasoning"] = fields["reasoning_content"]  # one text under vLLM's two names
    return without_ids({"role": "assistant", **{k: v or None for k, v in fields.items()}, "tool_calls": calls or None})


def without_ids(message: dict) -> dict:
    """``message`` with its calls' ids (random, unique per call) checked and left out."""
    for c in message["tool_calls"] or ():
        assert c.pop("id").startswith("call_")
    return message


CLOSED_CALL = ("<think>\nweather first\n</think>\n\nLet me check.\n" + call_text("get_weather", {"city": "Paris"})
               + "\nThen the sum.")


def two_piece_cuts(text: str, cut: str) -> range:
    """Where to cut ``text`` in two: within (or at the edges of) its ``</tool_call>``, or anywhere."""
    end = text.index(TOOL_CALL_END)
    return range(end, end + len(TOOL_CALL_END) + 1) if cut == "closing tag" else range(len(text) + 1)


@pytest.mark.parametrize("cut", ["closing tag", "whole text"])
def test_call_streams_as_a_call_wherever_its_text_is_cut_in_two(cut: str) -> None:
    """A call's end tag may arrive in two pieces (``</tool_`` then ``call>``): the stream must
    still find the block closed there and send the call the whole-text parser finds, not
    leave the block open and send it as content at the end. Every cut of the end tag, then
    every cut of the whole text: the tool-call stream alone, and a chat choice's stream
    (reasoning first) against its whole message."""
    content = CLOSED_CALL.split("</think>")[1]
    want = extract_tool_calls(content, tool_call_ids(seed=3))
    assert [c.name for c in want.tool_calls] == ["get_weather"]
    for k in two_piece_cuts(content, cut):
        assert streamed_tool_calls([content[:k], content[k:]], True, seed=3) == want, k
    parser = chat_parser()
    whole, called = parser.message(0, CLOSED_CALL)
    assert called and [c.function.name for c in whole.tool_calls] == ["get_weather"]
    assert whole.content.strip() == "Let me check.Then the sum." and whole.reasoning_content == "\nweather first\n"
    for k in two_piece_cuts(CLOSED_CALL, cut):
        assert streamed_message(parser, [CLOSED_CALL[:k], CLOSED_CALL[k:]]) == without_ids(whole.model_dump()), k


# ---- tool_choice constraint -------------------------------------------------------------------

def accepts(grammar: str, text: str) -> bool:
    from xgrammar.testing import _is_grammar_accept_string
    return _is_grammar_accept_string(grammar, text)


def test_auto_and_none_need_no_constraint() -> None:
    for choice in ("auto", "none", None):
        assert tool_choice_constraint([WEATHER], choice, True) is None


def test_named_function_constraint() -> None:
    pytest.importorskip("xgrammar")
    so = tool_choice_constraint([WEATHER, ADD], {"type": "function", "function": {"name": "get_weather"}}, True)
    assert so is not None and so.kind == "grammar"
    g = so.grammar
    # The grammar names the function and embeds its parameters (city: string, no others).
    assert '\\"name\\": \\"get_weather\\"' in g and '\\"city\\"' in g and '\\"days\\"' in g and "add" not in g
    good = call_text("get_weather", {"city": "Paris"})
    assert accepts(g, good) and accepts(g, call_text("get_weather", {"city": "Rome", "days": 2}))
    assert extract_tool_calls(good, tool_call_ids(0)).tool_calls[0].name == "get_weather"
    for bad in [call_text("add", {"a": 1, "b": 2}), call_text("get_weather", {"city": 3}),
                call_text("get_weather", {}), call_text("get_weather", {"city": "P", "zip": "1"}),
                "Sure. " + good, good + "\n" + good, "", good[:-3]]:
        assert not accepts(g, bad), bad


def test_required_constraint_allows_any_tool_and_parallel_calls() -> None:
    pytest.importorskip("xgrammar")
    g = tool_choice_constraint([WEATHER, ADD, NO_PARAMS], "required", True).grammar
    one, two = call_text("add", {"a": 1, "b": 2.5}), call_text("now", {"tz": "UTC"})
    assert accepts(g, one) and accepts(g, two) and accepts(g, one + "\n" + two)
    assert not accepts(g, "") and not accepts(g, "no call")
    single = tool_choice_constraint([WEATHER, ADD], "required", False).grammar
    assert accepts(single, one) and not accepts(single, one + "\n" + one)


def test_constraint_leaves_room_for_reasoning() -> None:
    pytest.importorskip("xgrammar")
    call = call_text("add", {"a": 1, "b": 2})
    optional = tool_choice_constraint([ADD], "required", True, reasoning="optional").grammar
    assert accepts(optional, call) and accepts(optional, "<think>\nadd them\n</think>\n\n" + call)
    assert not accepts(optional, "<think>never closed" + call)
    opened = tool_choice_constraint([ADD], "required", True, reasoning="open").grammar
    assert accepts(opened, "add them</think>\n\n" + call) and not accepts(opened, call)
    assert not accepts(tool_choice_constraint([ADD], "required", True).grammar, "<think>x</think>\n\n" + call)


@pytest.mark.parametrize("prompt, mode", [
    ("<|im_start|>assistant\n<think>\n", "open"),                  # the template opened the reasoning
    ("<|im_start|>assistant\n", "optional"),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "optional"),  # thinking switched off: closed
])
def test_server_builds_the_forced_call_grammar_for_the_prompts_reasoning_state(prompt: str, mode: str) -> None:
    """A prompt that ends inside ``<think>`` makes the output start in the reasoning: the
    forced-call grammar must then begin in an open block (text, ``</think>``, a blank line,
    the call) and refuse a second ``<think>`` or a bare call, else the model is forced to
    close a block it never opened or to write no reasoning at all."""
    pytest.importorskip("xgrammar")
    parser = chat_parser("required", prompt)
    assert parser.in_reasoning is (mode == "open")
    assert parser.constraint == tool_choice_constraint([WEATHER, ADD], "required", True, reasoning=mode)
    g, call = parser.constraint.grammar, call_text("add", {"a": 1, "b": 2})
    opened, closed = "adding them</think>\n\n" + call, "<think>\nadding them\n</think>\n\n" + call
    assert [accepts(g, t) for t in (opened, closed, call)] == ([True, False, False] if mode == "open" else
                                                               [False, True, True])


def test_constraint_refuses_what_it_cannot_force() -> None:
    with pytest.raises(ValueError, match="needs at least one tool"):
        tool_choice_constraint([], "required", True)
    with pytest.raises(ValueError, match="'nope' is not among the tools"):
        tool_choice_constraint([WEATHER], {"type": "function", "function": {"name": "nope"}}, True)
    assert [f["name"] for f in forced_tools([WEATHER, ADD], "required")] == ["get_weather", "add"]
    pytest.importorskip("xgrammar")
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}
    with pytest.raises(ValueError, match="cannot be compiled"):
        tool_choice_constraint([bad], "required", True)


def test_a_forced_calls_length_limited_strings_are_json() -> None:
    """A ``parameters`` string with ``maxLength``: the call's grammar takes no raw control
    character inside it (xgrammar's own rule would), so the forced call always parses."""
    note = {"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string", "maxLength": 20}}, "required": ["text"]}}}
    g = tool_choice_constraint([note], "required", True).grammar
    assert accepts(g, call_text("note", {"text": "buy milk"}))
    for bad in ("\t", "\x00", "\x1b"):
        assert not accepts(g, '<tool_call>\n{"name": "note", "arguments": {"text": "buy' + bad + 'milk"}}\n</tool_call>')


@pytest.mark.parametrize("spec, good, bad", [
    ({"json": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}, '{"n": 5}', '{"n": "5"}'),
    ({"json_object": True}, '{"a": [1]}', "[1]"),
    ({"regex": "[0-9]{2}"}, "42", "4"),
    ({"choice": ["yes", "no"]}, "no", "maybe"),
    ({"grammar": 'root ::= "x" [0-9]'}, "x7", "y7"),
], ids=["json", "json_object", "regex", "choice", "grammar"])
def test_a_constraint_after_the_reasoning(spec: dict, good: str, bad: str) -> None:
    """Each kind of constraint, after an optional reasoning block or after the reasoning the
    prompt opened; the answer alone is held to the constraint."""
    from minivllm.sampling import StructuredOutputs
    from minivllm.server.tool_calls import after_reasoning
    so = StructuredOutputs(**spec)
    assert after_reasoning(so, "none") is so
    optional, opened = after_reasoning(so, "optional").grammar, after_reasoning(so, "open").grammar
    thought = "<think>\nhm, <b>\n</think>\n\n"
    assert accepts(optional, good) and accepts(optional, thought + good) and not accepts(optional, thought + bad)
    assert accepts(opened, thought[len("<think>"):] + good) and not accepts(opened, good)
    assert not accepts(opened, thought[len("<think>"):] + bad)
