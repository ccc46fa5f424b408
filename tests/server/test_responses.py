"""The Responses API (``/v1/responses``) end to end: the ``openai`` client, raw HTTP and SSE,
``openai-agents`` and ``langchain-openai``, against the scripted Qwen3-format server
(``tests/server/scripted.py``: the model writes what a script gives for each prompt, through
the real engine, parsers and server; the executor records the prompts the template rendered
and the tokens a grammar refused)."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402
import openai  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from minivllm.server.engine_process import LLMFront  # noqa: E402
from minivllm.server.protocol import ServerConfig  # noqa: E402
from minivllm.server.responses import ResponseStore, StoredResponse  # noqa: E402
from tests.server import scripted  # noqa: E402
from tests.server.scripted import TIMEOUT, call, script_of  # noqa: E402
from tests.server.utils import wait_for  # noqa: E402

MODEL = "scripted-qwen3"

WEATHER = {"type": "function", "name": "get_weather", "description": "Get the weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ADD = {"type": "function", "name": "add",
       "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}

THOUGHT = "\nThe user asks for the weather, so I call the tool.\n"
PLAIN = "Plain answer."
LONG = "word " * 200
# The completion for a prompt whose last user turn holds the key (the first key found).
SCRIPTS = {
    "agent weather?": call("get_weather", {"city": "Paris"}),
    "weather?": f"<think>{THOUGHT}</think>\n\n" + call("get_weather", {"city": "Paris"}),
    "both?": "Checking both.\n" + call("get_weather", {"city": "Paris"}) + "\n" + call("add", {"a": 2, "b": 3}),
    "after?": "Let me look.\n" + call("get_weather", {"city": "Paris"}) + "\nDone.",
    "think?": "<think>\n2 and 3 make 5.\n</think>\n\nThe sum is 5.",
    "21 degrees": "It is 21 degrees in Paris.",
    "long?": LONG,
    "less?": "Is 2 < 3? Yes: 2 <",  # ends with what could open a tag: held back to the end
}


script = script_of(SCRIPTS, PLAIN)


def start(model_dir: Path, config: ServerConfig) -> tuple[types.SimpleNamespace, Callable[[], None]]:
    url, executor, stop = scripted.start_server(model_dir, config, script)
    oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    client = httpx.Client(base_url=url, timeout=TIMEOUT)
    return types.SimpleNamespace(url=url, openai=oai, client=client, executor=executor), stop


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[types.SimpleNamespace]:
    """A server with both parsers, as ``serve --reasoning-parser qwen3 --tool-call-parser hermes``."""
    s, stop = start(model_dir, ServerConfig(MODEL, reasoning_parser="qwen3", tool_call_parser="hermes"))
    with s.openai, s.client:
        yield s
    stop()


def create(server: types.SimpleNamespace, **body: Any) -> dict[str, Any]:
    """A whole response as JSON (raw HTTP)."""
    r = server.client.post("/v1/responses", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def sse(server: types.SimpleNamespace, **body: Any) -> list[dict[str, Any]]:
    """A streamed response's events, each checked to name its type on its ``event:`` line."""
    events, kind = [], None
    with server.client.stream("POST", "/v1/responses", json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: "):
                event = json.loads(line.removeprefix("data: "))
                assert event["type"] == kind
                events.append(event)
    return events


def prompt_of(server: types.SimpleNamespace) -> str:
    return server.executor.prompts[-1]


def kinds(response: dict[str, Any]) -> list[str]:
    return [item["type"] for item in response["output"]]


def texts(item: dict[str, Any]) -> list[str]:
    return [part["text"] for part in item["content"]]


# ---- whole responses ----------------------------------------------------------------------

def test_plain_text_through_the_openai_client(server) -> None:
    resp = server.openai.responses.create(model=MODEL, input="hello")
    assert resp.output_text == PLAIN and resp.status == "completed" and resp.object == "response"
    assert resp.id.startswith("resp_") and resp.model == MODEL and resp.error is None
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert [(p.type, p.text, p.annotations) for p in item.content] == [("output_text", PLAIN, [])]
    tokenizer = server.executor.tokenizer
    assert prompt_of(server) == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    num_prompt = len(tokenizer.encode(prompt_of(server), add_special_tokens=False))
    num_output = len(tokenizer.encode(PLAIN, add_special_tokens=False)) + 1  # and eos
    u = resp.usage
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (num_prompt, num_output, num_prompt + num_output)
    assert u.output_tokens_details.reasoning_tokens == 0 and u.input_tokens_details.cached_tokens == 0
    # The request's echo.
    assert resp.parallel_tool_calls is True and resp.tool_choice == "auto" and resp.tools == []
    assert resp.temperature == 1.0 and resp.top_p == 1.0 and resp.text.format.type == "text"


def test_instructions_and_message_items_reach_the_template(server) -> None:
    resp = server.openai.responses.create(model=MODEL, instructions="Be brief.", input="hi")
    assert resp.output_text == PLAIN and resp.instructions == "Be brief."
    assert prompt_of(server) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                                 "<|im_start|>assistant\n")
    resp = server.openai.responses.create(model=MODEL, input=[
        {"role": "developer", "content": [{"type": "input_text", "text": "Answer in English."}]},
        {"type": "message", "role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello.", "annotations": []}]},
        {"role": "user", "content": [{"type": "input_text", "text": "one"}, {"type": "input_text", "text": "two"}]}])
    assert resp.output_text == PLAIN and resp.instructions is None
    assert prompt_of(server) == (
        "<|im_start|>system\nAnswer in English.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\none\ntwo<|im_end|>\n<|im_start|>assistant\n"), prompt_of(server)


def test_an_unfinished_assistant_message_is_continued(server) -> None:
    """An input that ends with the model's message still in progress (or cut short) asks the
    model to go on writing it, as vLLM does: the prompt ends inside that message."""
    partial = {"role": "assistant", "content": [{"type": "output_text", "text": "Plain"}], "status": "incomplete"}
    create(server, input=[{"role": "user", "content": "hello"}, partial])
    assert prompt_of(server).endswith("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nPlain")
    create(server, input=[{"role": "user", "content": "hello"}, partial | {"status": "completed"}])
    assert prompt_of(server).endswith("<|im_start|>assistant\nPlain<|im_end|>\n<|im_start|>assistant\n")


def test_reasoning_then_content(server) -> None:
    resp = create(server, input="think?")
    assert kinds(resp) == ["reasoning", "message"] and resp["status"] == "completed"
    reasoning, message = resp["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "\n2 and 3 make 5.\n"}]
    assert reasoning["summary"] == [] and reasoning["status"] == "completed"
    assert texts(message) == ["\n\nThe sum is 5."]
    tokens = len(server.executor.tokenizer.encode("\n2 and 3 make 5.\n", add_special_tokens=False))
    assert resp["usage"]["output_tokens_details"]["reasoning_tokens"] == tokens
    assert server.openai.responses.retrieve(resp["id"]).output_text == "\n\nThe sum is 5."


def test_a_tool_call_then_its_output_gives_the_answer(server) -> None:
    first = server.openai.responses.create(model=MODEL, input="weather?", tools=[WEATHER])
    assert [i.type for i in first.output] == ["reasoning", "function_call"] and first.output_text == ""
    fc = first.output[1]
    assert fc.name == "get_weather" and json.loads(fc.arguments) == {"city": "Paris"}
    assert fc.call_id.startswith("call_") and fc.id.startswith("fc_") and fc.status == "completed"
    assert first.output[0].content[0].text == THOUGHT
    assert "<tools>\n" + json.dumps({"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                                      if k != "type"}}) in prompt_of(server)
    answer = server.openai.responses.create(model=MODEL, tools=[WEATHER], input=[
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": fc.call_id, "name": fc.name, "arguments": fc.arguments},
        {"type": "function_call_output", "call_id": fc.call_id, "output": '{"temperature": "21 degrees"}'}])
    assert answer.output_text == "It is 21 degrees in Paris." and [i.type for i in answer.output] == ["message"]
    assert ("<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\n" + call("get_weather", {"city": "Paris"})
            + "<|im_end|>\n<|im_start|>user\n<tool_response>\n{\"temperature\": \"21 degrees\"}\n</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\n") in prompt_of(server)


def test_reasoning_items_go_back_to_the_template(server) -> None:
    """A reasoning item passed back becomes the assistant turn's ``reasoning_content`` (the
    template writes it again in the turn after the last user message); chaining a response
    that reasoned does the same."""
    first = create(server, input="weather?", tools=[WEATHER])
    reasoning, fc = first["output"]
    answer = create(server, tools=[WEATHER], input=[
        {"role": "user", "content": "weather?"}, reasoning, fc,
        {"type": "function_call_output", "call_id": fc["call_id"], "output": "21 degrees"}])
    assert answer["output"][0]["content"][0]["text"] == "It is 21 degrees in Paris."
    turn = ("<|im_start|>assistant\n<think>" + THOUGHT + "</think>\n\n" + call("get_weather", {"city": "Paris"})
            + "<|im_end|>\n<|im_start|>user\n<tool_response>\n21 degrees\n</tool_response><|im_end|>\n")
    assert turn in prompt_of(server)
    chained = create(server, previous_response_id=first["id"], tools=[WEATHER], input=[
        {"type": "function_call_output", "call_id": fc["call_id"], "output": "21 degrees"}])
    assert chained["output"][0]["content"][0]["text"] == "It is 21 degrees in Paris."
    assert turn in prompt_of(server)


def test_parallel_calls_and_content_after_a_call(server) -> None:
    both = create(server, input="both?", tools=[WEATHER, ADD])
    assert kinds(both) == ["message", "function_call", "function_call"]
    assert texts(both["output"][0]) == ["Checking both."]
    assert [(i["name"], json.loads(i["arguments"])) for i in both["output"][1:]] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 2, "b": 3})]
    single = create(server, input="both?", tools=[WEATHER, ADD], parallel_tool_calls=False)
    assert kinds(single) == ["message", "function_call"] and single["parallel_tool_calls"] is False
    after = create(server, input="after?", tools=[WEATHER])
    assert kinds(after) == ["message", "function_call", "message"]
    assert texts(after["output"][0]) == ["Let me look."] and texts(after["output"][2]) == ["Done."]
    assert len({i["id"] for i in after["output"]}) == 3
    held = create(server, input="less?", tools=[WEATHER])
    assert kinds(held) == ["message"] and texts(held["output"][0]) == [SCRIPTS["less?"]]


def test_forced_tool_choice_and_text_format_constrain_the_engine(server) -> None:
    """The script answers in words; the grammar of ``tool_choice`` or ``text.format`` refuses
    its first token (the executor records it) and holds the output to a call or to JSON."""
    executor, first_token = server.executor, server.executor.tokenizer.encode(PLAIN, add_special_tokens=False)[0]
    executor.refused.clear()
    forced = create(server, input="hello", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                    max_output_tokens=4)
    assert executor.refused[:1] == [first_token]
    assert forced["tool_choice"] == {"type": "function", "name": "get_weather"}
    executor.refused.clear()
    for choice in ["required", {"type": "function", "name": "get_weather"}]:  # a call passes the grammar
        forced = create(server, input="weather?", tools=[WEATHER, ADD], tool_choice=choice)
        assert kinds(forced) == ["reasoning", "function_call"] and executor.refused == []
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    for fmt in [{"type": "json_schema", "name": "answer", "schema": schema, "strict": True}, {"type": "json_object"}]:
        executor.refused.clear()
        resp = server.openai.responses.create(model=MODEL, input="hello", text={"format": fmt}, max_output_tokens=8)
        assert executor.refused[:1] == [first_token] and resp.output_text != PLAIN, resp.output
        assert resp.text.format.type == fmt["type"]
    executor.refused.clear()
    plain = server.openai.responses.create(model=MODEL, input="hello", text={"format": {"type": "text"}})
    assert plain.output_text == PLAIN and executor.refused == []


def test_max_output_tokens_makes_an_incomplete_response(server) -> None:
    resp = create(server, input="hello", max_output_tokens=3)
    assert resp["status"] == "incomplete" and resp["incomplete_details"] == {"reason": "max_output_tokens"}
    (item,) = resp["output"]
    assert item["status"] == "incomplete" and PLAIN.startswith(texts(item)[0]) and texts(item)[0] != PLAIN
    assert resp["usage"]["output_tokens"] == 3 and resp["max_output_tokens"] == 3


def test_previous_response_id_continues_the_conversation(server) -> None:
    first = server.openai.responses.create(model=MODEL, input="hello", instructions="First rules.")
    second = server.openai.responses.create(model=MODEL, input="remember?", previous_response_id=first.id,
                                            instructions="Second rules.")
    assert second.previous_response_id == first.id
    exchange = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nPlain answer.<|im_end|>\n"
    assert prompt_of(server) == ("<|im_start|>system\nSecond rules.<|im_end|>\n" + exchange
                                 + "<|im_start|>user\nremember?<|im_end|>\n<|im_start|>assistant\n")
    server.openai.responses.create(model=MODEL, input="and now?", previous_response_id=second.id)
    assert prompt_of(server) == (exchange + "<|im_start|>user\nremember?<|im_end|>\n<|im_start|>assistant\n"
                                 "Plain answer.<|im_end|>\n<|im_start|>user\nand now?<|im_end|>\n"
                                 "<|im_start|>assistant\n")  # neither response's instructions
    # A call answered in the next request, by id.
    call_resp = create(server, input="agent weather?", tools=[WEATHER])
    (fc,) = call_resp["output"]
    answer = create(server, previous_response_id=call_resp["id"], tools=[WEATHER], input=[
        {"type": "function_call_output", "call_id": fc["call_id"], "output": "21 degrees"}])
    assert texts(answer["output"][0]) == ["It is 21 degrees in Paris."]


def test_stored_responses_retrieve_and_cancel(server) -> None:
    resp = create(server, input="hello", metadata={"k": "v"}, user="u-1")
    assert resp["store"] is True and resp["metadata"] == {"k": "v"} and resp["user"] == "u-1"
    got = server.client.get(f"/v1/responses/{resp['id']}")
    assert got.status_code == 200 and got.json() == resp
    assert server.openai.responses.retrieve(resp["id"]).output_text == PLAIN
    r = server.client.post(f"/v1/responses/{resp['id']}/cancel")
    assert_error(r, 400, "only a background response can be cancelled", "response_id")
    for r in (server.client.get("/v1/responses/resp_nope"), server.client.post("/v1/responses/resp_nope/cancel")):
        assert_error(r, 404, "'resp_nope' not found", "response_id")
    with pytest.raises(openai.NotFoundError):
        server.openai.responses.retrieve("resp_nope")
    unstored = create(server, input="hello", store=False)
    assert unstored["store"] is False
    assert_error(server.client.get(f"/v1/responses/{unstored['id']}"), 404, "not found", "response_id")
    r = server.client.post("/v1/responses", json={"input": "again", "previous_response_id": unstored["id"]})
    assert_error(r, 404, "not found", "previous_response_id")


def test_only_the_last_responses_are_kept() -> None:
    store = ResponseStore(capacity=2)
    bodies = [{"id": f"resp_{i}"} for i in range(3)]
    for body in bodies:
        store.put(StoredResponse(body, []))
    assert store.get("resp_0") is None and [store.get(f"resp_{i}").body for i in (1, 2)] == bodies[1:]


def assert_error(r: httpx.Response, status: int, words: str, param: str | None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status, err
    assert words in err["message"] and err["param"] == param, err


@pytest.mark.parametrize("body, param, words", [
    ({"bogus": 1}, "bogus", "unknown field"),
    ({"input": 5}, "input", "input"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input", "item 0: items of type 'web_search_call'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     "'input_image' are not supported"),
    ({"input": ["hi"]}, "input", "item 0: an input item is an object"),
    ({"input": [{"role": "user", "content": "x", "extra": 1}]}, "input", "item 0 (message): extra: unknown field"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input",
     "item 0 (function_call): call_id: Field required"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]}, "input",
     "arguments: not valid JSON"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input", "call_id: Field required"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]}, "input", "encrypted"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "role"),
    ({"input": []}, "input", "input"),
    ({"tools": [{"type": "web_search"}]}, "tools", "'web_search' are not supported"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools", "pattern"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "unique"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "'nope'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice",
     "'allowed_tools' is not supported"),
    ({"tool_choice": "required"}, "tool_choice", "only allowed with tools"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "name and schema"),
    ({"text": {"format": {"type": "xml"}}}, "text", "format"),
    ({"max_output_tokens": 5000}, "max_output_tokens", "reduce max_output_tokens"),
    ({"temperature": -1}, "temperature", "temperature"),
    ({"background": True}, "background", "background responses are not supported"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "reusable prompts"),
    ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
    ({"top_logprobs": 2}, "top_logprobs", "log-probabilities"),
    ({"include": ["message.output_text.logprobs"]}, "include", "log-probabilities"),
    ({"include": ["everything"]}, "include", "include"),
    ({"truncation": "middle"}, "truncation", "truncation"),
])
def test_bad_requests_are_refused(server, body: dict[str, Any], param: str, words: str) -> None:
    r = server.client.post("/v1/responses", json={"model": MODEL, "input": "hi"} | body)
    assert_error(r, 400, words, param)
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_another_model_is_a_404(server) -> None:
    assert_error(server.client.post("/v1/responses", json={"model": "gpt-5", "input": "hi"}), 404, "gpt-5", "model")


def test_openai_only_fields_are_accepted_and_logged_once(server, caplog, monkeypatch) -> None:
    rendered: list[dict[str, Any] | None] = []
    real = LLMFront.chat_prompt_text

    def spy(self: LLMFront, messages: Any, tools: Any = None, kwargs: Any = None, **options: Any) -> str:
        rendered.append(kwargs)
        return real(self, messages, tools, kwargs, **options)

    monkeypatch.setattr(LLMFront, "chat_prompt_text", spy)
    extra = {"service_tier": "auto", "prompt_cache_key": "k", "safety_identifier": "s", "max_tool_calls": 3,
             "stream_options": {"include_obfuscation": False}, "text": {"verbosity": "low"},
             "reasoning": {"effort": "low", "summary": "auto"}, "include": ["reasoning.encrypted_content"],
             "truncation": "auto"}
    with caplog.at_level(logging.WARNING, logger="minivllm.server.responses"):
        for _ in range(2):
            resp = create(server, input="hello", **extra)
    assert texts(resp["output"][0]) == [PLAIN] and resp["reasoning"]["effort"] == "low"
    assert resp["prompt_cache_key"] == "k" and resp["safety_identifier"] == "s" and resp["truncation"] == "auto"
    assert rendered[-1] == {"reasoning_effort": "low"}  # as vLLM hands the effort to the template
    logged = [r.getMessage() for r in caplog.records]
    for name in ["service_tier", "prompt_cache_key", "safety_identifier", "max_tool_calls", "stream_options",
                 "text.verbosity", "reasoning.summary", "include=reasoning.encrypted_content"]:
        assert sum(f"responses: {name} is accepted and ignored" in m for m in logged) == 1, (name, logged)


# ---- streaming ----------------------------------------------------------------------------

TERMINAL = ("response.completed", "response.incomplete", "response.failed")
TEXT_DELTAS = {"message": "response.output_text.delta", "reasoning": "response.reasoning_text.delta"}
TEXT_DONES = {"message": "response.output_text.done", "reasoning": "response.reasoning_text.done"}


def item_text(item: dict[str, Any]) -> str:
    return item["arguments"] if item["type"] == "function_call" else "".join(texts(item))


def replay(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Check a stream's order (the lifecycle events around one item at a time, each item's
    events in OpenAI's order) and that its deltas add up to each item and the items to the
    final response's output; returns the items."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types_ = [e["type"] for e in events]
    assert types_[:2] == ["response.created", "response.in_progress"], types_
    assert types_[-1] in TERMINAL and not set(types_[:-1]) & set(TERMINAL), types_
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    items: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for e in events[2:-1]:
        t = e["type"]
        if t == "response.output_item.added":
            assert current is None and e["output_index"] == len(items) and e["item"]["status"] == "in_progress"
            current = {"item": e["item"], "text": "", "stage": "added"}
            continue
        assert current is not None and e["output_index"] == len(items), (t, e)
        item, kind = current["item"], current["item"]["type"]
        assert e.get("item_id", item["id"]) == item["id"] and e.get("content_index", 0) == 0
        step = {("response.content_part.added", "added"): "part", (TEXT_DELTAS.get(kind), "part"): "part",
                ("response.function_call_arguments.delta", "added"): "added",
                (TEXT_DONES.get(kind), "part"): "text done",
                ("response.function_call_arguments.done", "added"): "part done",
                ("response.content_part.done", "text done"): "part done",
                ("response.output_item.done", "part done"): "done"}.get((t, current["stage"]))
        assert step is not None and (kind != "function_call" or "content_part" not in t), (t, current["stage"], kind)
        current["text"] += e.get("delta", "")
        assert e.get("text", e.get("arguments", current["text"])) == current["text"]
        if t == "response.content_part.done":
            assert e["part"]["text"] == current["text"]
        if step == "done":
            assert e["item"]["id"] == item["id"] and item_text(e["item"]) == current["text"]
            items.append(e["item"])
            current = None
        else:
            current["stage"] = step
    assert current is None
    assert events[-1]["response"]["output"] == items
    return items


def normalized(response: dict[str, Any]) -> str:
    """The response without what differs between two runs of a request: its id (in the item
    ids too), its times and its call ids (random)."""
    text = json.dumps({k: v for k, v in response.items() if k not in ("created_at", "completed_at")},
                      sort_keys=True).replace(response["id"].removeprefix("resp_"), "<id>")
    calls = [item["call_id"] for item in response["output"] if item["type"] == "function_call"]
    for i, call_id in enumerate(calls):
        text = text.replace(call_id, f"<call {i}>")
    return text


@pytest.mark.parametrize("body", [
    {"input": "hello"},
    {"input": "think?"},
    {"input": "weather?", "tools": [WEATHER]},
    {"input": "both?", "tools": [WEATHER, ADD]},
    {"input": "after?", "tools": [WEATHER]},
    {"input": "less?", "tools": [WEATHER]},
    {"input": "hello", "max_output_tokens": 3},
], ids=["text", "reasoning", "reasoning-and-call", "content-and-calls", "content-after-a-call", "held-back-end",
        "incomplete"])
def test_a_stream_builds_the_whole_response(server, body: dict[str, Any]) -> None:
    whole = create(server, **body)
    events = sse(server, **body)
    replay(events)
    final = events[-1]["response"]
    assert events[-1]["type"] == ("response.incomplete" if whole["status"] == "incomplete" else "response.completed")
    assert normalized(final) == normalized(whole)
    assert final["id"] == events[0]["response"]["id"] and final["id"] != whole["id"]
    assert server.client.get(f"/v1/responses/{final['id']}").json() == final  # a streamed response is stored


def test_streamed_deltas_come_in_pieces(server, monkeypatch) -> None:
    """Engine steps slower than the HTTP side: every token is its own delta, so texts and
    arguments reach the client in many pieces that must add up."""
    real = server.executor.run

    def slow_run(plan: Any, bitmask: Any) -> Any:  # a step slower than the HTTP side's work for it
        time.sleep(0.005)
        return real(plan, bitmask)

    monkeypatch.setattr(server.executor, "run", slow_run)
    events = sse(server, input="weather?", tools=[WEATHER])
    reasoning, fc = replay(events)
    counts = {t: sum(e["type"] == t for e in events) for t in ("response.reasoning_text.delta",
                                                                 "response.function_call_arguments.delta")}
    # Several pieces (not all merged into one, as a loaded machine may still merge some).
    assert counts["response.reasoning_text.delta"] > 1, counts
    assert item_text(reasoning) == THOUGHT and json.loads(fc["arguments"]) == {"city": "Paris"}


def test_the_openai_stream_helper_accepts_the_stream(server) -> None:
    with server.openai.responses.stream(model=MODEL, input="weather?", tools=[WEATHER]) as s:
        seen = [e.type for e in s]
        final = s.get_final_response()
    whole = server.openai.responses.create(model=MODEL, input="weather?", tools=[WEATHER])
    assert seen[0] == "response.created" and seen[-1] == "response.completed"
    assert "response.function_call_arguments.done" in seen and "response.reasoning_text.delta" in seen
    assert [i.type for i in final.output] == [i.type for i in whole.output] == ["reasoning", "function_call"]
    assert final.output[0].content == whole.output[0].content and final.output_text == whole.output_text == ""
    assert (final.output[1].name, final.output[1].arguments) == (whole.output[1].name, whole.output[1].arguments)
    with server.openai.responses.stream(model=MODEL, input="think?") as s:
        deltas = "".join(e.delta for e in s if e.type == "response.output_text.delta")
        assert deltas == s.get_final_response().output_text == "\n\nThe sum is 5."


def aborted_total(server: types.SimpleNamespace) -> float:
    text = server.client.get("/metrics").text
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return samples["minivllm_requests_aborted_total"]


def test_a_client_leaving_a_stream_aborts_its_request(server, monkeypatch) -> None:
    real = server.executor.run

    def slow_run(plan: Any, bitmask: Any) -> Any:  # the request outlives the client by far
        time.sleep(0.01)
        return real(plan, bitmask)

    monkeypatch.setattr(server.executor, "run", slow_run)
    before = aborted_total(server)
    with server.client.stream("POST", "/v1/responses", json={"input": "long?", "stream": True}) as r:
        for line in r.iter_lines():
            if line == "event: response.output_text.delta":
                break
    wait_for(lambda: aborted_total(server) == before + 1, "the request to be aborted", TIMEOUT)


# ---- other clients ----------------------------------------------------------------------------

def test_openai_agents_runs_a_tool_round_trip(server) -> None:
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the weather of a city."""
        calls.append(city)
        return "21 degrees"

    async def run() -> tuple[Any, Any]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
        agent = Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather],
                      model=OpenAIResponsesModel(model=MODEL, openai_client=client))
        result = await Runner.run(agent, "agent weather?")
        streamed = Runner.run_streamed(agent, "agent weather?")
        async for _ in streamed.stream_events():
            pass
        await client.close()
        return result, streamed

    result, streamed = asyncio.run(asyncio.wait_for(run(), TIMEOUT))
    assert result.final_output == streamed.final_output == "It is 21 degrees in Paris."
    assert calls == ["Paris", "Paris"]
    assert prompt_of(server).startswith("<|im_start|>system\nAnswer with the tool.\n\n# Tools")
    assert "<tool_response>\n21 degrees\n</tool_response>" in prompt_of(server)


def test_langchain_chat_openai_with_the_responses_api(server) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="unused", use_responses_api=True,
                     max_retries=0, timeout=TIMEOUT)
    assert llm.invoke("hello").text == PLAIN
    message = llm.bind_tools([{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
                             ).invoke("weather?")
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert "".join(chunk.text for chunk in llm.stream("think?")) == "\n\nThe sum is 5."


# ---- without parsers --------------------------------------------------------------------------

def test_without_parsers_the_text_is_one_message(model_dir: Path) -> None:
    s, stop = start(model_dir, ServerConfig(MODEL))
    try:
        whole = create(s, input="think?")
        assert kinds(whole) == ["message"] and texts(whole["output"][0]) == [SCRIPTS["think?"]]
        events = sse(s, input="think?")
        replay(events)
        assert normalized(events[-1]["response"]) == normalized(whole)
    finally:
        s.openai.close()
        s.client.close()
        stop()


def test_an_engine_failure_fails_the_stream(model_dir: Path) -> None:
    s, stop = start(model_dir, ServerConfig(MODEL))
    real, steps = s.executor.run, itertools.count()

    def failing_run(plan: Any, bitmask: Any) -> Any:  # the device is lost a few tokens in
        if next(steps) == 4:
            raise RuntimeError("device lost")
        return real(plan, bitmask)

    s.executor.run = failing_run
    try:
        events = sse(s, input="long?")
        assert events[-1]["type"] == "response.failed" and events[0]["type"] == "response.created"
        failed = events[-1]["response"]
        assert failed["status"] == "failed" and "device lost" in failed["error"]["message"]
        assert failed["id"] == events[0]["response"]["id"]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert_error(s.client.post("/v1/responses", json={"input": "hello"}), 500, "device lost", None)
    finally:
        s.openai.close()
        s.client.close()
        stop()

