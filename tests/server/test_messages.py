"""The Anthropic Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) end to end,
through the official ``anthropic`` client on loopback.

The server is the scripted one of ``tests/server/scripted.py``: the real engine, detokenizer,
parsers and app, with an executor that writes, for each prompt, the completion a script gives
(then eos), token by token; the prompts it records show what the chat template rendered.
"""

from __future__ import annotations

import json
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling import SamplingParams
from minivllm.server.protocol import ServerConfig
from minivllm.server.tool_calls import tool_choice_constraint
from tests.server import scripted
from tests.server.scripted import TIMEOUT, call, script_of

MODEL = "scripted-qwen3"

WEATHER = {"name": "get_weather", "description": "Get the weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ADD = {"name": "add", "input_schema": {"properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}
# The same tools as the chat API takes them (ADD's schema gains the "object" type it left out).
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                                "parameters": WEATHER["input_schema"]}},
              {"type": "function", "function": {"name": "add", "parameters": {"type": "object",
                                                                             **ADD["input_schema"]}}}]

THOUGHT = "\nThe user asks for the weather, so I call the tool.\n"
COUNT = "one two three four five six seven"
# The completion for a prompt whose last user turn holds the key.
SCRIPTS = {
    "weather?": f"<think>{THOUGHT}</think>\n\n" + call("get_weather", {"city": "Paris"}),
    "both?": "Checking both.\n" + call("get_weather", {"city": "Paris"}) + "\n" + call("add", {"a": 2, "b": 3}),
    "think?": "<think>\n2 and 3 make 5.\n</think>\n\nThe sum is 5.",
    "21 degrees": "It is 21 degrees in Paris.",
    "count": COUNT,
}
PLAIN = "Plain answer."


script = script_of(SCRIPTS, PLAIN)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[types.SimpleNamespace]:
    """A server with both parsers, as ``serve --reasoning-parser qwen3 --tool-call-parser hermes``."""
    config = ServerConfig(MODEL, reasoning_parser="qwen3", tool_call_parser="hermes")
    url, executor, stop = scripted.start_server(model_dir, config, script)
    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=TIMEOUT) as client, \
            openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT) as oai, \
            httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        yield types.SimpleNamespace(client=client, openai=oai, http=http, executor=executor)
    stop()


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def without_ids(message: Any) -> dict[str, Any]:
    """A message as a dict, its id, call ids and thinking signatures (random) checked and left out."""
    m = message.model_dump(exclude_none=True)
    assert m.pop("id").startswith("msg_")
    for block in m["content"]:
        if block["type"] == "tool_use":
            assert block.pop("id")
        if block["type"] == "thinking":
            assert block.pop("signature")
    return m


def both_ways(server: types.SimpleNamespace, **request: Any) -> Any:
    """The whole message, after checking that the stream of the same request, put together
    by the client (``get_final_message``), equals it."""
    request = {"model": MODEL, "max_tokens": 200} | request
    whole = server.client.messages.create(**request)
    with server.client.messages.stream(**request) as stream:
        streamed = stream.get_final_message()
    assert without_ids(streamed) == without_ids(whole)
    return whole


def prompt_ids(server: types.SimpleNamespace, prompt: str) -> list[int]:
    return server.executor.tokenizer.encode(prompt, add_special_tokens=False)


# ---- replies ----------------------------------------------------------------------------------

def test_a_plain_reply(server) -> None:
    m = both_ways(server, messages=user("hello"))
    assert (m.type, m.role, m.model) == ("message", "assistant", MODEL)
    assert [(b.type, b.text) for b in m.content] == [("text", PLAIN)]
    assert (m.stop_reason, m.stop_sequence) == ("end_turn", None)
    assert m.usage.input_tokens == len(prompt_ids(server, server.executor.prompts[-1]))
    assert m.usage.output_tokens == len(prompt_ids(server, PLAIN)) + 1  # and eos
    assert server.executor.prompts[-1].endswith("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")


def test_the_system_prompt_reaches_the_template(server) -> None:
    server.client.messages.create(model=MODEL, max_tokens=50, system="Be brief.", messages=user("hello"))
    as_text = server.executor.prompts[-1]
    assert as_text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello<|im_end|>")
    server.client.messages.create(model=MODEL, max_tokens=50, messages=user("hello"), system=[
        {"type": "text", "text": "Be"}, {"type": "text", "text": "brief.", "cache_control": {"type": "ephemeral"}}])
    assert server.executor.prompts[-1] == as_text.replace("Be brief.", "Be\nbrief.")


def test_reasoning_comes_back_as_a_thinking_block(server) -> None:
    m = both_ways(server, messages=user("think?"), thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "\n2 and 3 make 5.\n" and m.content[0].signature
    assert m.content[1].text == "\n\nThe sum is 5." and m.stop_reason == "end_turn"


def test_a_tool_exchange(server) -> None:
    first = both_ways(server, messages=user("weather?"), tools=[WEATHER], metadata={"user_id": "u1"})
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["thinking", "tool_use"]
    thought, use = first.content
    assert thought.thinking == THOUGHT
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"}) and use.id.startswith("call_")
    # The tool reached the template as a function whose parameters are its input schema.
    assert "<tools>\n" + json.dumps(CHAT_TOOLS[0]) + "\n</tools>" in server.executor.prompts[-1]
    messages = [*user("weather?"), {"role": "assistant", "content": [use]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                              "content": '{"temperature": "21 degrees"}'}]}]
    answer = both_ways(server, messages=messages, tools=[WEATHER])
    assert [(b.type, b.text) for b in answer.content] == [("text", "It is 21 degrees in Paris.")]
    assert answer.stop_reason == "end_turn"
    assert ("<|im_start|>assistant\n" + call("get_weather", {"city": "Paris"}) + "<|im_end|>\n<|im_start|>user\n"
            '<tool_response>\n{"temperature": "21 degrees"}\n</tool_response><|im_end|>\n'
            "<|im_start|>assistant\n") in server.executor.prompts[-1]


def test_parallel_calls_and_the_text_before_them(server) -> None:
    m = both_ways(server, messages=user("both?"), tools=[WEATHER, ADD])
    assert [b.type for b in m.content] == ["text", "tool_use", "tool_use"] and m.stop_reason == "tool_use"
    assert m.content[0].text == "Checking both."
    assert [(b.name, b.input) for b in m.content[1:]] == [("get_weather", {"city": "Paris"}),
                                                          ("add", {"a": 2, "b": 3})]
    assert m.content[1].id != m.content[2].id
    single = both_ways(server, messages=user("both?"), tools=[WEATHER, ADD],
                       tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [b.type for b in single.content] == ["text", "tool_use"]


def test_tool_results_come_first_in_their_turn(server) -> None:
    """A user turn's tool results become tool messages, in order, before the turn's text."""
    uses = [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "t2", "name": "add", "input": {"a": 2, "b": 3}}]
    results = [{"type": "text", "text": "Thanks."},
               {"type": "tool_result", "tool_use_id": "t1", "content": "21 degrees"},
               {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
                "content": [{"type": "text", "text": "add:"}, {"type": "text", "text": "overflow"}]}]
    m = server.client.messages.create(model=MODEL, max_tokens=50, tools=[WEATHER, ADD], messages=[
        *user("both?"), {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, *uses]},
        {"role": "user", "content": results}])
    assert m.content[0].text == PLAIN
    assert server.executor.prompts[-1].endswith(
        "<|im_start|>assistant\nChecking.\n" + call("get_weather", {"city": "Paris"}) + "\n"
        + call("add", {"a": 2, "b": 3}) + "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n21 degrees\n</tool_response>\n"
        "<tool_response>\nadd:\noverflow\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nThanks.<|im_end|>\n<|im_start|>assistant\n")


def test_thinking_of_an_earlier_turn_reaches_the_template(server) -> None:
    """An assistant turn's thinking blocks are its reasoning, which Qwen3's template writes
    back for the turns after the last user query (a tool exchange)."""
    first = server.client.messages.create(model=MODEL, max_tokens=200, messages=user("weather?"), tools=[WEATHER])
    thought, use = first.content
    server.client.messages.create(model=MODEL, max_tokens=200, tools=[WEATHER], messages=[
        *user("weather?"), {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 degrees"}]}])
    assert ("<|im_start|>assistant\n<think>\n" + THOUGHT.strip("\n") + "\n</think>\n\n"
            + call("get_weather", {"city": "Paris"})) in server.executor.prompts[-1]


@pytest.fixture
def sampling(monkeypatch: pytest.MonkeyPatch) -> list[SamplingParams]:
    """The sampling params of each request the engine admits from now on."""
    seen: list[SamplingParams] = []
    real = LLMEngine.validate_request

    def spy(self: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        seen.append(params)
        real(self, request_id, prompt, params)

    monkeypatch.setattr(LLMEngine, "validate_request", spy)
    return seen


def test_forced_tool_choice_runs_under_its_grammar(server, sampling) -> None:
    """``any`` and ``tool`` reach the engine as the grammar of the chat API's ``required`` and
    named function (``disable_parallel_tool_use``: one call), whose mask keeps the model on a call."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, chat_choice, parallel in [({"type": "any"}, "required", True),
                                          ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
                                          ({"type": "tool", "name": "get_weather"}, named, True)]:
        m = both_ways(server, messages=user("weather?"), tools=[WEATHER, ADD], tool_choice=choice)
        assert sampling[-1].structured_outputs == tool_choice_constraint(CHAT_TOOLS, chat_choice, parallel,
                                                                         reasoning="optional")
        assert m.stop_reason == "tool_use" and [b.name for b in m.content if b.type == "tool_use"] == ["get_weather"]
    assert server.executor.refused == []
    # A script that would answer in words is held to the call from its first token on.
    forced = server.client.messages.create(model=MODEL, max_tokens=4, messages=user("hello"), tools=[WEATHER],
                                           tool_choice={"type": "tool", "name": "get_weather"})
    assert server.executor.refused[0] == prompt_ids(server, PLAIN)[0] and forced.stop_reason == "max_tokens"
    server.executor.refused.clear()
    server.client.messages.create(model=MODEL, max_tokens=50, messages=user("hello"), tools=[WEATHER],
                                  tool_choice={"type": "none"})
    assert sampling[-1].structured_outputs is None and "<tools>" in server.executor.prompts[-1]


def test_output_config_format_is_a_json_schema_constraint(server, sampling) -> None:
    schema = {"type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"]}
    m = server.client.messages.create(model=MODEL, max_tokens=3, messages=user("hello"),
                                      output_config={"format": {"type": "json_schema", "schema": schema}})
    constraint = sampling[-1].structured_outputs
    server.openai.chat.completions.create(model=MODEL, max_tokens=3, messages=user("hello"), response_format={
        "type": "json_schema", "json_schema": {"name": "output", "schema": schema}})
    assert constraint is not None and constraint == sampling[-1].structured_outputs  # the chat API's own
    assert server.executor.refused[0] == prompt_ids(server, PLAIN)[0] and m.stop_reason == "max_tokens"
    server.executor.refused.clear()


def test_stop_sequences_and_max_tokens(server, sampling) -> None:
    stopped = both_ways(server, messages=user("count"), stop_sequences=["nine", "four"])
    assert [b.text for b in stopped.content] == ["one two three "]
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "four")
    cut = both_ways(server, messages=user("count"), max_tokens=3)
    assert (cut.stop_reason, cut.stop_sequence, cut.usage.output_tokens) == ("max_tokens", None, 3)
    assert COUNT.startswith(cut.content[0].text)
    # Sampling fields the API defines (this client version no longer names them).
    whole = both_ways(server, messages=user("count"), stop_sequences=["ten"],
                      extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 5})
    assert [b.text for b in whole.content] == [COUNT] and whole.stop_reason == "end_turn"
    params = sampling[-1]
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.5, 0.9, 5, 200)
    assert list(params.stop) == ["ten"]


# ---- the stream, as sent ----------------------------------------------------------------------

def sse_events(server: types.SimpleNamespace, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed reply's events, after checking that each event's name is its data's type."""
    events = []
    with server.http.stream("POST", "/v1/messages", json={"model": MODEL, "max_tokens": 200, "stream": True} | body
                            ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    for raw in text.split("\n\n")[:-1]:
        name, data = raw.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == "event: " + event["type"]
        events.append(event)
    assert text.endswith("\n\n")
    return events


def test_stream_events_come_in_anthropic_order(server) -> None:
    events = sse_events(server, {"messages": user("weather?"), "tools": [WEATHER]})
    types_ = [e["type"] for e in events]
    assert types_[0] == "message_start" and types_[-2:] == ["message_delta", "message_stop"]
    start = events[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert start["usage"]["input_tokens"] == len(prompt_ids(server, server.executor.prompts[-1]))
    blocks: list[list[dict[str, Any]]] = []  # each block's events, start to stop
    for e in events[1:-2]:
        if e["type"] == "content_block_start":
            assert e["index"] == len(blocks) and (not blocks or blocks[-1][-1]["type"] == "content_block_stop")
            blocks.append([e])
        else:
            assert e["type"] in ("content_block_delta", "content_block_stop") and e["index"] == len(blocks) - 1
            blocks[-1].append(e)
    thinking, tool = blocks
    assert thinking[0]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert "".join(e["delta"]["thinking"] for e in thinking[1:-2]) == THOUGHT
    assert thinking[-2]["delta"]["type"] == "signature_delta" and thinking[-2]["delta"]["signature"]
    assert tool[0]["content_block"]["name"] == "get_weather" and tool[0]["content_block"]["input"] == {}
    pieces = [e["delta"] for e in tool[1:-1]]
    assert {p["type"] for p in pieces} == {"input_json_delta"}
    assert json.loads("".join(p["partial_json"] for p in pieces)) == {"city": "Paris"}
    assert tool[-1] == {"type": "content_block_stop", "index": 1}
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"]["output_tokens"] == len(prompt_ids(server, SCRIPTS["weather?"])) + 1


# ---- count_tokens -----------------------------------------------------------------------------

def test_count_tokens_is_the_prompt_length(server) -> None:
    uses = [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}]
    conversation = dict(system="Be brief.", tools=[WEATHER], messages=[
        *user("weather?"), {"role": "assistant", "content": uses},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "21 degrees"}]}])
    num_prompts = len(server.executor.prompts)
    counted = server.client.messages.count_tokens(model=MODEL, **conversation)
    assert len(server.executor.prompts) == num_prompts  # nothing was queued
    m = server.client.messages.create(model=MODEL, max_tokens=50, **conversation)
    assert counted.input_tokens == m.usage.input_tokens == len(prompt_ids(server, server.executor.prompts[-1]))
    chat = server.openai.chat.completions.create(model=MODEL, tools=CHAT_TOOLS[:1], messages=[
        {"role": "system", "content": "Be brief."}, *user("weather?"),
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "21 degrees"}])
    assert chat.usage.prompt_tokens == counted.input_tokens
    assert server.client.messages.count_tokens(model=MODEL, messages=user("hello")).input_tokens < counted.input_tokens


# ---- bad requests -----------------------------------------------------------------------------

IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}


@pytest.mark.parametrize("body, words", [
    ({"max_tokens": None}, "max_tokens: required"),
    ({"max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1"),
    ({"messages": [{"role": "user", "content": [IMAGE]}]}, "image blocks are not supported"),
    ({"temprature": 0.5}, "temprature: unknown field"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice: tool 'nope' is not among the tools ['get_weather']"),
    ({"tool_choice": {"type": "any"}}, "tool_choice: only allowed with tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice: name: required when type is 'tool'"),
    ({"tools": [{"name": "get weather", "input_schema": {}}]}, "tools.0.name: String should match pattern"),
    ({"tools": [{"name": "web_search", "type": "web_search_20250305"}]}, "tools.0.type: Input should be 'custom'"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, "not tool_use"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "thinking": "hm"}]}]},
     "a text block has no field 'thinking'"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [IMAGE]}]}]},
     "image blocks are not supported"),
    ({"messages": [{"role": "system", "content": "hi"}]}, "messages.0.role"),
    ({"messages": []}, "messages: List should have at least 1 item"),
    ({"thinking": {"type": "enabled"}}, "thinking: budget_tokens: required when type is 'enabled'"),
    ({"system": [IMAGE]}, "image blocks are not supported"),
    ({"stop_sequences": [""]}, "stop_sequences must be"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}}, "output_config.format: "),
    ({"model": "other"}, "model 'other' does not exist"),
    ({"max_tokens": 5000}, "maximum context length"),
])
def test_bad_requests_are_refused_in_anthropic_shape(server, body: dict, words: str) -> None:
    request = {k: v for k, v in ({"model": MODEL, "max_tokens": 50, "messages": user("hi")} | body).items()
               if v is not None}
    status = 404 if "model" in body else 400
    r = server.http.post("/v1/messages", json=request)
    assert r.status_code == status and words in r.json()["error"]["message"], r.text
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    assert r.json() == {"type": "error", "error": {"type": kind, "message": r.json()["error"]["message"]}}


def test_the_client_raises_bad_request_errors(server) -> None:
    client = server.client
    with pytest.raises(anthropic.BadRequestError, match="max_tokens: required"):
        client.messages.create(model=MODEL, messages=user("hi"), max_tokens=anthropic.omit)
    with pytest.raises(anthropic.BadRequestError, match="image blocks are not supported"):
        client.messages.create(model=MODEL, max_tokens=50, messages=[{"role": "user", "content": [IMAGE]}])
    with pytest.raises(anthropic.BadRequestError, match="temprature: unknown field"):
        client.messages.create(model=MODEL, max_tokens=50, messages=user("hi"), extra_body={"temprature": 0})
    with pytest.raises(anthropic.BadRequestError, match="tool 'nope' is not among the tools"):
        client.messages.create(model=MODEL, max_tokens=50, messages=user("hi"), tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "nope"})
    with pytest.raises(anthropic.BadRequestError, match="image blocks are not supported"):
        client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [IMAGE]}])
    with pytest.raises(anthropic.BadRequestError, match="max_tokens: unknown field"):
        client.messages.count_tokens(model=MODEL, messages=user("hi"), extra_body={"max_tokens": 5})
    with pytest.raises(anthropic.NotFoundError, match="does not exist"):
        client.messages.create(model="other", max_tokens=50, messages=user("hi"))
    r = server.http.post("/v1/messages", content=b'{"model": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


# ---- an engine that fails mid-stream ----------------------------------------------------------

def test_an_engine_failure_mid_stream_is_an_error_event(model_dir: Path) -> None:
    url, executor, stop = scripted.start_server(model_dir, ServerConfig(MODEL), lambda prompt: COUNT)
    real_run, steps = executor.run, []

    def failing_run(plan: Any, bitmask: Any) -> Any:
        steps.append(plan)
        if len(steps) > 3:
            raise RuntimeError("device lost")
        return real_run(plan, bitmask)

    executor.run = failing_run
    try:
        with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=TIMEOUT) as client:
            events = []
            with pytest.raises(anthropic.APIStatusError, match="device lost"):
                with client.messages.stream(model=MODEL, max_tokens=50, messages=user("count")) as stream:
                    events.extend(stream)
            assert [e.type for e in events[:2]] == ["message_start", "content_block_start"]
            assert "message_stop" not in [e.type for e in events]
            # A request after the failure is refused before any stream starts.
            with pytest.raises(anthropic.InternalServerError):
                client.messages.create(model=MODEL, max_tokens=50, messages=user("count"), stream=True)
    finally:
        stop()
