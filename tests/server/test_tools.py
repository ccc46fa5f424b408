"""The server's reasoning and tool-call parsing end to end, through the official ``openai``
client on loopback.

The model is the one part replaced: a scripted executor writes, for each prompt, the
completion a script gives (then eos), token by token, through the real engine, its
detokenizer and the server. The tokenizer and chat template are the Qwen3-format fixture
(``fixtures/qwen3-chat-tokenizer``), so the completions hold Qwen3's real tags as single
tokens, and the prompts the executor records show what the template rendered. A trained
model could not be made to write chosen tags on demand; a random checkpoint would not
write them at all.
"""

from __future__ import annotations

import json
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402
import openai  # noqa: E402
from openai.types.chat import ChatCompletion, ChatCompletionMessageToolCall  # noqa: E402

from minivllm.engine.llm_engine import LLMEngine  # noqa: E402
from minivllm.server.engine_process import LLMFront  # noqa: E402
from minivllm.server.protocol import ServerConfig  # noqa: E402
from minivllm.server.tool_calls import tool_choice_constraint  # noqa: E402
from tests.server import scripted  # noqa: E402
from tests.server.scripted import ROOT, TIMEOUT, ScriptedExecutor, call, script_of  # noqa: E402

MODEL = "scripted-qwen3"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}


THOUGHT = "\nThe user asks for the weather, so I call the tool.\n"
# The completion for a prompt whose last user turn holds the key.
SCRIPTS = {
    "weather?": f"<think>{THOUGHT}</think>\n\n" + call("get_weather", {"city": "Paris"}),
    "both?": "Checking both.\n" + call("get_weather", {"city": "Paris"}) + "\n"
             + call("add", {"a": 2, "b": 3}),
    "think?": "<think>\n2 and 3 make 5.\n</think>\n\nThe sum is 5.",
    "21 degrees": "It is 21 degrees in Paris.",
    "broken?": '<tool_call>\n{"name": get_weather, "arguments": {"city": "Paris"}}\n</tool_call>',
    "json?": '<think>\nFive, as JSON.\n</think>\n\n{"sum": 5}',
    "special?": "a<|im_start|>b",
    "tags?": call("get_weather", {"city": "</tool_call> and <think> are text"}),
    "garbled?": '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
}
PLAIN = "Plain answer."


script = script_of(SCRIPTS, PLAIN)


def start_server(model_dir: Path, config: ServerConfig) -> tuple[Any, ScriptedExecutor, Callable[[], None]]:
    return scripted.start_server(model_dir, config, script)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[types.SimpleNamespace]:
    """A server with both parsers, as ``serve --reasoning-parser qwen3 --tool-call-parser hermes``."""
    config = ServerConfig(MODEL, reasoning_parser="qwen3", tool_call_parser="hermes")
    url, executor, stop = start_server(model_dir, config)
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT) as oai, \
            httpx.Client(base_url=url, timeout=TIMEOUT) as client:
        yield types.SimpleNamespace(openai=oai, client=client, executor=executor)
    stop()


@pytest.fixture(scope="module")
def plain_server(model_dir: Path) -> Iterator[httpx.Client]:
    """A server without parsers."""
    url, _, stop = start_server(model_dir, ServerConfig(MODEL))
    with httpx.Client(base_url=url, timeout=TIMEOUT) as client:
        yield client
    stop()


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def reassemble(chunks: list[Any]) -> dict[str, Any]:
    """A streamed choice 0 put back together as a client does, checking that every call
    starts with a chunk naming its index, id, type and function with arguments "" and
    continues with argument chunks only."""
    role, reasoning, content = None, "", ""
    calls: list[dict[str, Any]] = []
    finish = None
    for chunk in chunks:
        assert chunk.object == "chat.completion.chunk" and len(chunk.choices) == 1
        choice = chunk.choices[0]
        delta = choice.delta
        role = role or delta.role
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        for tc in delta.tool_calls or ():
            if tc.id is not None:
                assert tc.index == len(calls) and tc.type == "function"
                assert tc.function.name and tc.function.arguments == ""
                calls.append({"id": tc.id, "name": tc.function.name, "arguments": ""})
            else:
                assert tc.index == len(calls) - 1 and tc.type is None and tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments
        if choice.finish_reason is not None:
            assert finish is None
            finish = choice.finish_reason
    return {"role": role, "reasoning": reasoning or None, "content": content or None, "calls": calls,
            "finish": finish}


def whole_as_stream(completion: ChatCompletion) -> dict[str, Any]:
    choice = completion.choices[0]
    m = choice.message
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls or ()]
    return {"role": m.role, "reasoning": (m.model_extra or {}).get("reasoning_content"), "content": m.content,
            "calls": calls, "finish": choice.finish_reason}


def without_ids(choice: dict[str, Any]) -> dict[str, Any]:
    """``choice`` with its calls' ids (random, unique per call) checked and left out."""
    for c in choice["calls"]:
        assert c.pop("id").startswith("call_")
    return choice


def both_ways(server: types.SimpleNamespace, **request: Any) -> tuple[ChatCompletion, dict[str, Any]]:
    """The whole response, after checking that the stream of the same request reassembles
    into it (call ids apart: each call has its own)."""
    whole = server.openai.chat.completions.create(model=MODEL, seed=11, **request)
    chunks = list(server.openai.chat.completions.create(model=MODEL, seed=11, stream=True, **request))
    got = reassemble(chunks)
    assert without_ids(got) == without_ids(whole_as_stream(whole))
    return whole, got


# ---- with the parsers ---------------------------------------------------------------------

def test_reasoning_then_a_tool_call(server) -> None:
    whole, _ = both_ways(server, messages=user("weather?"), tools=[WEATHER])
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == THOUGHT
    (tc,) = choice.message.tool_calls
    assert isinstance(tc, ChatCompletionMessageToolCall) and tc.type == "function"
    assert tc.id.startswith("call_") and len(tc.id) == 29
    assert tc.function.name == "get_weather" and json.loads(tc.function.arguments) == {"city": "Paris"}
    # The tools reached the template: the prompt describes them the Hermes way.
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in server.executor.prompts[-1]
    # Ids are unique per call, seeded or not: a seeded agent loop must not hand its tools one id twice.
    again = [server.openai.chat.completions.create(model=MODEL, messages=user("weather?"), tools=[WEATHER], seed=seed)
             for seed in (11, 11, None)]
    ids = {c.choices[0].message.tool_calls[0].id for c in again}
    assert len(ids) == 3 and tc.id not in ids


def test_a_reply_appended_as_the_client_got_it_round_trips_its_reasoning(server) -> None:
    """The agent loop ``messages.append(reply)`` sends the reasoning back (both of vLLM's names);
    the template renders it in the turn after the last user message, as Qwen3's does."""
    messages: list[Any] = user("weather?")
    reply = server.openai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER]).choices[0].message
    assert reply.model_extra["reasoning"] == reply.model_extra["reasoning_content"] == THOUGHT
    messages += [reply, {"role": "tool", "tool_call_id": reply.tool_calls[0].id,
                         "content": '{"temperature": "21 degrees"}'}]
    answer = server.openai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    assert answer.choices[0].message.content == "It is 21 degrees in Paris."
    rendered = "<|im_start|>assistant\n<think>\n" + THOUGHT.strip("\n") + "\n</think>\n\n" + call(
        "get_weather", {"city": "Paris"})
    assert rendered in server.executor.prompts[-1]
    # Raw JSON with the newer name alone renders the same.
    raw = {"role": "assistant", "content": None, "reasoning": THOUGHT,
           "tool_calls": [reply.tool_calls[0].model_dump()]}
    body = {"model": MODEL, "messages": [*user("weather?"), raw, messages[-1]], "tools": [WEATHER]}
    assert server.client.post("/v1/chat/completions", json=body).status_code == 200
    assert rendered in server.executor.prompts[-1]


def test_parallel_calls_and_content_around_them(server) -> None:
    whole, _ = both_ways(server, messages=user("both?"), tools=[WEATHER, ADD])
    m = whole.choices[0].message
    assert m.content == "Checking both." and whole.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 2, "b": 3})]
    assert len({c.id for c in m.tool_calls}) == 2
    single, _ = both_ways(server, messages=user("both?"), tools=[WEATHER, ADD], parallel_tool_calls=False)
    assert [c.function.name for c in single.choices[0].message.tool_calls] == ["get_weather"]


def test_a_call_cut_by_a_stop_string_still_parses(server) -> None:
    """The stop string leaves the block unclosed: it is parsed when the choice ends."""
    whole, _ = both_ways(server, messages=user("weather?"), tools=[WEATHER], stop=["</tool_call>"])
    (tc,) = whole.choices[0].message.tool_calls
    assert tc.function.name == "get_weather" and whole.choices[0].finish_reason == "tool_calls"
    assert whole.choices[0].message.content is None


def test_tool_choice_none_leaves_calls_as_content(server) -> None:
    whole, _ = both_ways(server, messages=user("weather?"), tools=[WEATHER], tool_choice="none")
    m = whole.choices[0].message
    assert m.tool_calls is None and m.content == "\n\n" + call("get_weather", {"city": "Paris"})
    assert m.model_extra["reasoning_content"] == THOUGHT and whole.choices[0].finish_reason == "stop"
    assert "<tools>" in server.executor.prompts[-1]  # the prompt still describes them, as vLLM's does


def test_reasoning_without_tools_and_a_malformed_call(server) -> None:
    whole, _ = both_ways(server, messages=user("think?"))
    m = whole.choices[0].message
    assert (m.model_extra["reasoning_content"], m.content, m.tool_calls) == ("\n2 and 3 make 5.\n",
                                                                             "\n\nThe sum is 5.", None)
    broken, _ = both_ways(server, messages=user("broken?"), tools=[WEATHER])  # not a call's head: content
    assert broken.choices[0].message.content == SCRIPTS["broken?"]
    assert broken.choices[0].message.tool_calls is None and broken.choices[0].finish_reason == "stop"
    # A call's head, then arguments the model got wrong: a call, its arguments as written
    # (a stream has sent the name before the arguments go wrong).
    garbled, _ = both_ways(server, messages=user("garbled?"), tools=[WEATHER])
    (tc,) = garbled.choices[0].message.tool_calls
    assert (tc.function.name, tc.function.arguments) == ("get_weather", '{"city": }')
    plain, _ = both_ways(server, messages=user("hello"), tools=[WEATHER])
    assert plain.choices[0].message.content == PLAIN
    assert plain.choices[0].message.model_extra["reasoning_content"] is None


def test_chat_template_kwargs_reach_the_template(server) -> None:
    whole = server.openai.chat.completions.create(model=MODEL, messages=user("hello"),
                                                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert server.executor.prompts[-1].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert whole.choices[0].message.content == PLAIN
    server.openai.chat.completions.create(model=MODEL, messages=user("hello"))
    assert server.executor.prompts[-1].endswith("<|im_start|>assistant\n")


def test_a_tool_exchange_reaches_the_template(server) -> None:
    first = server.openai.chat.completions.create(model=MODEL, messages=user("weather?"), tools=[WEATHER])
    tc = first.choices[0].message.tool_calls[0]
    messages = [*user("weather?"),
                {"role": "assistant", "content": None, "tool_calls": [tc.model_dump()]},
                {"role": "tool", "tool_call_id": tc.id, "content": '{"temperature": "21 degrees"}'}]
    answer, _ = both_ways(server, messages=messages, tools=[WEATHER])
    assert answer.choices[0].message.content == "It is 21 degrees in Paris."
    assert answer.choices[0].finish_reason == "stop" and answer.choices[0].message.tool_calls is None
    prompt = server.executor.prompts[-1]
    assert ("<|im_start|>assistant\n" + call("get_weather", {"city": "Paris"}) + "<|im_end|>\n<|im_start|>user\n"
            '<tool_response>\n{"temperature": "21 degrees"}\n</tool_response><|im_end|>\n'
            "<|im_start|>assistant\n") in prompt


def test_forced_tool_choice_runs_under_its_grammar(server, monkeypatch) -> None:
    """``required`` and a named function reach the engine as the constraint's grammar, whose
    mask lets through every token of a Hermes call (and not those of a plain answer)."""
    seen: list[Any] = []
    real = LLMEngine.validate_request

    def spy(self: LLMEngine, request_id: str, prompt: list[int], params: Any) -> None:
        seen.append(params.structured_outputs)
        real(self, request_id, prompt, params)

    monkeypatch.setattr(LLMEngine, "validate_request", spy)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, parallel in [("required", True), ("required", False), (named, True)]:
        whole, _ = both_ways(server, messages=user("weather?"), tools=[WEATHER, ADD], tool_choice=choice,
                             parallel_tool_calls=parallel)
        assert seen[-1] == tool_choice_constraint([WEATHER, ADD], choice, parallel, reasoning="optional")
        assert whole.choices[0].finish_reason == "tool_calls" and server.executor.refused == []
        assert [c.function.name for c in whole.choices[0].message.tool_calls] == ["get_weather"]
    # A script that would answer in words is held to the grammar from its first token on.
    forced = server.openai.chat.completions.create(model=MODEL, messages=user("hello"), tools=[WEATHER],
                                                   tool_choice=named, max_tokens=4)
    plain_ids = server.executor.tokenizer.encode(PLAIN, add_special_tokens=False)
    assert server.executor.refused[0] == plain_ids[0] and forced.choices[0].message.content != PLAIN[:4]
    server.executor.refused.clear()
    r = server.client.post("/v1/chat/completions", json={
        "messages": user("weather?"), "tools": [WEATHER], "tool_choice": "required",
        "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text


@pytest.mark.parametrize("body, param, words", [
    ({"tool_choice": "required"}, "tool_choice", "only allowed with tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope' is not among the tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "unique"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "pattern"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "function"),
    ({"tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice", ""),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "own arguments"),
    ({"messages": [{"role": "tool", "content": "21"}]}, "messages", "tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages",
     "only an assistant message"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, "messages",
     "not valid JSON"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages", "content: Field required"),
    ({"messages": [{"role": "user", "content": "x", "reasoning_content": "hm"}]}, "messages",
     "only an assistant message has reasoning"),
    ({"messages": [{"role": "assistant", "content": "x", "reasoning": "a", "reasoning_content": "b"}]},
     "messages", "two names of one field"),
])
def test_bad_tool_requests_are_refused(server, body: dict, param: str, words: str) -> None:
    r = server.client.post("/v1/chat/completions", json={"messages": user("hi")} | body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"] and err["type"] == "invalid_request_error", err


# ---- without them ---------------------------------------------------------------------------

def test_without_parsers_tags_stay_content_and_auto_is_refused(plain_server) -> None:
    r = plain_server.post("/v1/chat/completions", json={"messages": user("weather?"), "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "--tool-call-parser hermes" in r.json()["error"]["message"]
    r = plain_server.post("/v1/chat/completions", json={"messages": user("weather?"), "tools": [WEATHER],
                                                         "tool_choice": "none"})
    message = r.json()["choices"][0]["message"]
    assert r.status_code == 200 and message["content"] == SCRIPTS["weather?"]
    assert message["tool_calls"] is None and message["reasoning_content"] is None


# ---- the template's inputs, offline ---------------------------------------------------------

def test_llm_chat_passes_tools_and_template_kwargs() -> None:
    from minivllm import LLM, SamplingParams

    with LLM(str(ROOT / "fixtures" / "tiny-qwen3"), device="cpu", num_blocks=16, max_model_len=64) as llm:
        # A template that shows its inputs (the fixture's own concatenates the contents only).
        llm.tokenizer.chat_template = ("{{ enable_thinking }}|{{ tools | map(attribute='function.name') | join(',') }}"
                                       "|{% for m in messages %}{{ m.content }}{% endfor %}"
                                       "{% if add_generation_prompt %}>{% endif %}")
        messages = user("1+2=")
        text = llm.chat_prompt_text(messages, [WEATHER, ADD], {"enable_thinking": False})
        assert text == "False|get_weather,add|1+2=>"
        out = llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False, tools=[ADD],
                       chat_template_kwargs={"enable_thinking": True})[0]
        assert out.prompt_token_ids == tuple(llm.tokenizer.encode("True|add|1+2=>", add_special_tokens=False))
        out = llm.chat([*messages, {"role": "assistant", "content": "3"}], SamplingParams(max_tokens=1),
                       use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
        assert out.prompt_token_ids == tuple(llm.tokenizer.encode("||1+2=3", add_special_tokens=False))
        with pytest.raises(ValueError, match="add_generation_prompt"):
            llm.chat(messages, chat_template_kwargs={"add_generation_prompt": False}, use_tqdm=False)


def test_front_renders_as_the_llm_does(model_dir: Path) -> None:
    """The engine-process server's front renders prompts with the same method."""
    front = LLMFront(str(model_dir))
    text = front.chat_prompt_text(user("hi"), [WEATHER], {"enable_thinking": False})
    assert text.startswith("<|im_start|>system\n# Tools") and text.endswith("<think>\n\n</think>\n\n")
    assert front.chat_prompt_ids(user("hi")) == front.tokenizer.encode(front.chat_prompt_text(user("hi")),
                                                                         add_special_tokens=False)


def test_a_think_tag_written_by_the_user_opens_no_reasoning(server) -> None:
    """Only the template's own opening of the reply counts: a user asking about the tag (an
    open ``<think>`` in the conversation) still gets content."""
    reply = server.openai.chat.completions.create(
        model=MODEL, messages=user("what does the <think> tag do?")).choices[0].message
    assert reply.content == PLAIN and reply.model_extra["reasoning"] is None
    assert "the <think> tag" in server.executor.prompts[-1]


def test_the_final_message_continued_or_no_generation_prompt(server) -> None:
    """``continue_final_message`` leaves the assistant's message open (its open ``<think>``
    puts the reply in the reasoning); ``add_generation_prompt`` false ends the prompt with the
    conversation; both true, or continuing a user message, are refused."""
    cont = {"role": "assistant", "content": "<think>\nhm"}
    r = server.client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [*user("hello"), cont], "continue_final_message": True,
        "add_generation_prompt": False})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["reasoning"] == PLAIN and message["content"] is None
    assert server.executor.prompts[-1].endswith("<|im_start|>assistant\n<think>\nhm")
    r = server.client.post("/v1/chat/completions", json={"model": MODEL, "messages": user("hello"),
                                                         "add_generation_prompt": False})
    assert r.status_code == 200 and server.executor.prompts[-1].endswith("hello<|im_end|>\n")
    for body, words in (({"messages": [*user("hello"), cont], "continue_final_message": True},
                         "add_generation_prompt"),
                        ({"messages": user("hello"), "continue_final_message": True, "add_generation_prompt": False},
                         "the final message must be the assistant's")):
        r = server.client.post("/v1/chat/completions", json={"model": MODEL, **body})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_a_streamed_call_sends_its_name_then_its_arguments_as_written(server) -> None:
    """Fed the reply token by token (as the engine's detokenizer hands it over), a choice's
    parser sends the name as soon as the call's head is complete, then argument pieces as
    they are written, not the whole call at its end. (Through the server a lagging stream
    may merge deltas, so this is checked at the parser, with the model's real tokens.)"""
    from minivllm.server.chat_output import chat_output_parser
    from minivllm.server.protocol import ChatCompletionRequest

    tokenizer = server.executor.tokenizer
    reply = SCRIPTS["weather?"]
    pieces = [tokenizer.decode(t) for t in tokenizer.encode(reply, add_special_tokens=False)]
    assert "".join(pieces) == reply
    req = ChatCompletionRequest(model=MODEL, messages=user("weather?"), tools=[WEATHER])
    stream = chat_output_parser(ServerConfig(MODEL, reasoning_parser="qwen3", tool_call_parser="hermes"), req,
                                "<|im_start|>assistant\n").stream(0)
    calls = [(i, tc) for i, p in enumerate(pieces) for d in stream.feed(p) for tc in d.tool_calls or ()]
    assert not stream.finish()
    (start_at, start), rest = calls[0], calls[1:]
    assert start.function.name == "get_weather" and start.function.arguments == ""
    assert "".join(tc.function.arguments for _, tc in rest) == '{"city": "Paris"}'
    assert len({i for i, _ in rest}) >= 3 and start_at <= rest[0][0]  # piece by piece


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_tags_inside_a_calls_arguments_are_argument_text(server, tool_choice: str) -> None:
    """An argument string holding ``</tool_call>`` and ``<think>`` neither ends the call nor
    opens reasoning: the call parses, free or forced."""
    server.executor.refused.clear()
    whole, _ = both_ways(server, messages=user("tags?"), tools=[WEATHER], tool_choice=tool_choice)
    choice = whole.choices[0]
    (tc,) = choice.message.tool_calls
    assert json.loads(tc.function.arguments) == {"city": "</tool_call> and <think> are text"}
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning"] is None and server.executor.refused == []


SUM = {"type": "json_schema", "json_schema": {"name": "sum", "schema": {
    "type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"]}}}


def test_structured_output_applies_after_the_reasoning(server, plain_server) -> None:
    """With the reasoning parser on, the model thinks first and the schema holds for the
    answer (as vLLM applies a grammar once the reasoning ends); without the parser, the schema
    holds from the first token, so the scripted <think> is refused."""
    server.executor.refused.clear()
    whole, _ = both_ways(server, messages=user("json?"), response_format=SUM)
    m = whole.choices[0].message
    assert (m.model_extra["reasoning"], json.loads(m.content)) == ("\nFive, as JSON.\n", {"sum": 5})
    assert server.executor.refused == []
    r = plain_server.post("/v1/chat/completions", json={"model": MODEL, "messages": user("json?"),
                                                        "response_format": SUM})
    assert r.status_code == 200, r.text
    assert not r.json()["choices"][0]["message"]["content"].startswith("<think>")  # refused by the grammar


MARKED = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"


@pytest.mark.parametrize("trusted", [False, True], ids=["server template", "request template trusted"])
def test_served_names_and_chat_templates(model_dir: Path, trusted: bool) -> None:
    """``--served-model-name A B``: both answer, responses carry the first; ``--chat-template``
    replaces the tokenizer's; a request's own template only on a trusting server."""
    config = ServerConfig(MODEL, aliases=("alias",), chat_template=MARKED, trust_request_chat_template=trusted)
    url, executor, stop = start_server(model_dir, config)
    try:
        with httpx.Client(base_url=url, timeout=TIMEOUT) as client:
            assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [MODEL, "alias"]
            r = client.post("/v1/chat/completions", json={"model": "alias", "messages": user("hello")})
            assert r.status_code == 200 and r.json()["model"] == MODEL, r.text
            assert executor.prompts[-1] == "[user] hello\n[assistant] "
            own = {"model": MODEL, "messages": user("hello"), "chat_template": "<{{ messages[0].content }}>"}
            r = client.post("/v1/chat/completions", json=own)
            if trusted:
                assert r.status_code == 200 and executor.prompts[-1] == "<hello>", r.text
            else:
                assert r.status_code == 400 and "--trust-request-chat-template" in r.json()["error"]["message"]
    finally:
        stop()


def test_skip_special_tokens(plain_server) -> None:
    """Special tokens are left out of the text unless ``skip_special_tokens`` is false, streamed or not."""
    for skip, want in ((None, "ab"), (False, "a<|im_start|>b")):
        body = {"model": MODEL, "messages": user("special?"), **({} if skip is None else {"skip_special_tokens": skip})}
        r = plain_server.post("/v1/chat/completions", json=body)
        assert r.json()["choices"][0]["message"]["content"] == want, r.text
        r = plain_server.post("/v1/chat/completions", json=body | {"stream": True})
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == want


def test_usage_has_no_prompt_tokens_details_by_default(plain_server) -> None:
    usage = plain_server.post("/v1/chat/completions", json={"model": MODEL, "messages": user("hello")}).json()["usage"]
    assert set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens"}
