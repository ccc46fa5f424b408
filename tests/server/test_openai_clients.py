"""The server as real OpenAI clients use it: the ``openai`` package and raw JSON, against a
server on loopback over the tiny trained Qwen3 fixture ("12+34=" -> "46", then eos).

Covered: chat without a limit runs to the end of the context; messages as clients send
them (text parts, ``name``, ``developer``); ``null`` as the default; a disconnect logs
nothing; ``stop_reason``; the newer ``max_completion_tokens`` wins; chat logprobs without
``top_logprobs``; structured-output fields -> ``SamplingParams`` and through the engine;
and a served process that exits once its engine process is dead.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import types
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402
import openai  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from pydantic import ValidationError  # noqa: E402

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.sampling import StructuredOutputs  # noqa: E402
from minivllm.server.app import build_app  # noqa: E402
from minivllm.server.protocol import ChatCompletionRequest, CompletionRequest, ServerConfig  # noqa: E402
from tests.server.utils import served, wait_for  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
FIXTURE = os.path.join(ROOT, "fixtures", "tiny-qwen3")
MODEL = "tiny-qwen3"
MAX_MODEL_LEN = 64
TIMEOUT = 20.0  # seconds: every wait in this file is bounded
EOS = 2
SIX = 27        # the token "6" (the fixture's vocabulary is digits and signs)


@pytest.fixture(scope="module")
def offline() -> Iterator[LLM]:
    """An LLM for expected answers and ``LLM.generate``: the server's engine is its thread's."""
    with LLM(FIXTURE, device="cpu", num_blocks=64, max_num_seqs=16, max_model_len=MAX_MODEL_LEN) as llm:
        yield llm


@pytest.fixture(scope="module")
def server() -> Iterator[types.SimpleNamespace]:
    with LLM(FIXTURE, device="cpu", num_blocks=64, max_num_seqs=16, max_model_len=MAX_MODEL_LEN) as llm:
        app = build_app(llm, ServerConfig(MODEL))
        with served(app, TIMEOUT) as (url, srv), httpx.Client(base_url=url, timeout=TIMEOUT) as client, \
                openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT) as oai:
            yield types.SimpleNamespace(url=url, port=int(url.rsplit(":", 1)[1]), client=client, openai=oai,
                                        llm=llm, uvicorn=srv, engine=app.state.server.engine)


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if not s.labels}


def post(server: types.SimpleNamespace, path: str, body: dict) -> dict:
    r = server.client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def sse(lines: Iterator[str]) -> list[Any]:
    """The events of a stream, ``[DONE]`` as the string."""
    return [e if e == "[DONE]" else json.loads(e)
            for e in (line[len("data: "):] for line in lines if line.startswith("data: "))]


def chat_prompt_len(server: types.SimpleNamespace, content: str) -> int:
    return len(server.llm.chat_prompt_ids([{"role": "user", "content": content}]))


# ---- the completion's length ---------------------------------------------------------

def test_chat_without_a_limit_runs_to_the_end_of_the_context(server) -> None:
    oai = server.openai
    for content in ("1+2=", "1+" * 28 + "1="):  # near the limit too: 58 tokens leave 6
        room = MAX_MODEL_LEN - chat_prompt_len(server, content)
        reply = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                            temperature=0, extra_body={"ignore_eos": True})
        assert (reply.choices[0].finish_reason, reply.usage.completion_tokens) == ("length", room)
    chunks = list(oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "1+2="}],
                                              temperature=0, stream=True,
                                              stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == MAX_MODEL_LEN - chat_prompt_len(server, "1+2=")
    # Without ignore_eos it ends where the model does, not at 16.
    reply = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "12+34="}],
                                        temperature=0)
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == ("46", "stop")


def test_legacy_completions_keep_the_default_of_16(server) -> None:
    whole = server.openai.completions.create(model=MODEL, prompt="1+2=", temperature=0,
                                             extra_body={"ignore_eos": True})
    assert (whole.choices[0].finish_reason, whole.usage.completion_tokens) == ("length", 16)


def test_max_completion_tokens_wins_over_max_tokens(server) -> None:
    reply = server.openai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "1+2="}], temperature=0, max_tokens=2,
        max_completion_tokens=5, extra_body={"ignore_eos": True})
    assert (reply.usage.completion_tokens, reply.choices[0].finish_reason) == (5, "length")
    # Only the older name: it counts.
    body = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "1+2="}],
                                                 "max_tokens": 2, "ignore_eos": True})
    assert body["usage"]["completion_tokens"] == 2


# ---- requests as clients write them ----------------------------------------------------

def test_messages_with_text_parts_a_name_and_the_developer_role(server) -> None:
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "1"}, {"type": "text", "text": "2"}]},
        {"role": "user", "name": "ann", "content": [{"type": "text", "text": "12+34="}]}]
    req = ChatCompletionRequest.model_validate({"messages": messages})
    # As the chat template reads them: developer is system; parts joined by newlines (vLLM's).
    assert [m.template_message() for m in req.messages] == [
        {"role": "system", "content": "1\n2"}, {"role": "user", "content": "12+34=", "name": "ann"}]
    reply = server.openai.chat.completions.create(model=MODEL, temperature=0, max_tokens=5, messages=messages)
    want = post(server, "/v1/chat/completions", {"messages": [{"role": "system", "content": "1\n2"},
                                                              {"role": "user", "content": "12+34="}],
                                                 "temperature": 0, "max_tokens": 5})
    assert reply.choices[0].message.content == want["choices"][0]["message"]["content"]
    assert reply.usage == openai.types.CompletionUsage(**want["usage"])


def _optional_fields(model: type) -> list[str]:
    return [name for name, f in model.model_fields.items() if not f.is_required()]


@pytest.mark.parametrize("path, model, required", [
    ("/v1/completions", CompletionRequest, {"prompt": "12+34="}),
    ("/v1/chat/completions", ChatCompletionRequest,
     {"messages": [{"role": "user", "content": "12+34=", "name": None}]}),
])
def test_null_for_every_optional_field_means_its_default(server, path, model, required) -> None:
    """Every optional field null at once (what a client sends for all it leaves unset)
    answers as if none were sent; greedy, so the two answers are comparable."""
    nulls = {name: None for name in _optional_fields(model)}
    assert {"stream", "echo", "logprobs", "top_k", "stream_options", "response_format"} & nulls.keys()
    got = post(server, path, required | nulls | {"temperature": 0})
    want = post(server, path, required | {"temperature": 0})
    key = "text" if path == "/v1/completions" else "message"
    assert got["choices"][0][key] == want["choices"][0][key] and got["usage"] == want["usage"]
    # Nested objects too.
    with server.client.stream("POST", path, json=required | {
            "temperature": 0, "stream": True, "stream_options": {"include_usage": None},
            "response_format": {"type": "text", "json_schema": None}}) as r:
        assert r.status_code == 200, r.read()
        events = sse(r.iter_lines())
    assert events[-1] == "[DONE]" and all("usage" not in e for e in events[:-1])


def test_a_disconnected_non_streaming_client_logs_no_error_and_frees_its_blocks(server) -> None:
    """The engine is held inside a step until the client is gone, so the disconnect lands
    while the request runs; then nothing may be logged at ERROR, and the abort frees its
    blocks."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(level=logging.ERROR)
    # uvicorn's loggers do not propagate to the root: listen on each.
    loggers = [logging.getLogger(name) for name in ("", "uvicorn", "uvicorn.error", "asyncio")]
    engine = server.engine.engine
    real_step = engine.step
    entered, release = threading.Event(), threading.Event()

    def held_step() -> list:
        entered.set()
        release.wait(TIMEOUT)
        return real_step()

    assert server.engine.wait_idle(TIMEOUT)
    before = metrics(server.url)
    for lg in loggers:
        lg.addHandler(handler)
    engine.step = held_step
    try:
        body = json.dumps({"prompt": "1+1=", "max_tokens": 50, "ignore_eos": True}).encode()
        with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            assert entered.wait(TIMEOUT), "the request never reached the engine"
        release.set()

        def done() -> bool:
            m = metrics(server.url)
            return (m["minivllm_requests_aborted_total"] == before["minivllm_requests_aborted_total"] + 1
                    and m["minivllm_kv_blocks_used"] == 0 and m["minivllm_requests_running"] == 0)

        wait_for(done, "the abort, and its blocks freed")
        # The handler's task ends after the abort is posted; uvicorn drops it from its tasks then.
        wait_for(lambda: not server.uvicorn.server_state.tasks, "the request's handler to end")
    finally:
        release.set()
        del engine.step
        for lg in loggers:
            lg.removeHandler(handler)
    assert not [r.getMessage() for r in records], [r.getMessage() for r in records]
    assert server.engine.wait_idle(TIMEOUT) and server.engine.error is None


# ---- stop_reason ---------------------------------------------------------------------

@pytest.mark.parametrize("extra, finish, stop_reason, text", [
    ({"stop_token_ids": [SIX]}, "stop", SIX, "4"),
    ({"stop": ["6"]}, "stop", "6", "4"),
    ({}, "stop", None, "46"),                          # eos
    ({"max_tokens": 1}, "length", None, "4"),
])
def test_stop_reason_of_completions_and_chat(server, extra, finish, stop_reason, text) -> None:
    kw = dict(model=MODEL, temperature=0, max_tokens=extra.pop("max_tokens", 5))
    stop = extra.pop("stop", None)
    whole = server.openai.completions.create(prompt="12+34=", stop=stop, extra_body=extra, **kw)
    choice = whole.choices[0]
    assert (choice.text, choice.finish_reason, choice.stop_reason) == (text, finish, stop_reason)
    chunks = list(server.openai.completions.create(prompt="12+34=", stop=stop, extra_body=extra, stream=True,
                                                   **kw))
    assert [c.choices[0].stop_reason for c in chunks] == [None] * (len(chunks) - 1) + [stop_reason]
    assert chunks[-1].choices[0].finish_reason == finish
    messages = [{"role": "user", "content": "12+34="}]
    reply = server.openai.chat.completions.create(messages=messages, stop=stop, extra_body=extra, **kw)
    assert (reply.choices[0].message.content, reply.choices[0].stop_reason) == (text, stop_reason)
    chunks = list(server.openai.chat.completions.create(messages=messages, stop=stop, extra_body=extra,
                                                        stream=True, **kw))
    assert [c.choices[0].stop_reason for c in chunks] == [None] * (len(chunks) - 1) + [stop_reason]


def test_llm_generate_reports_the_stop_reason(offline: LLM) -> None:
    outs = offline.generate(["12+34=", "12+34=", "12+34="],
                            [SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[SIX]),
                             SamplingParams(temperature=0, max_tokens=5, stop=["6"]),
                             SamplingParams(temperature=0, max_tokens=5)], use_tqdm=False)
    assert [(o.finish_reason, o.stop_reason, o.token_ids) for o in outs] == [
        ("stop", SIX, (25, SIX)), ("stop", "6", (25, SIX)), ("stop", None, (25, SIX, EOS))]


# ---- structured outputs: request -> SamplingParams -------------------------------------

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CHAT = {"messages": [{"role": "user", "content": "12+34="}]}


@pytest.mark.parametrize("fields, want", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA,
                                                                 "strict": True}}},
     StructuredOutputs(json=SCHEMA)),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputs(json=SCHEMA)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredOutputs(json=json.dumps(SCHEMA))),
    ({"structured_outputs": {"json_object": True}}, StructuredOutputs(json_object=True)),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     StructuredOutputs(json=SCHEMA, disable_any_whitespace=True)),
    ({"structured_outputs": {"regex": "[0-9]+", "json": None}}, StructuredOutputs(regex="[0-9]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutputs(choice=("yes", "no"))),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredOutputs(grammar='root ::= "a"')),
    ({"guided_json": SCHEMA}, StructuredOutputs(json=SCHEMA)),
    ({"guided_regex": "a|b"}, StructuredOutputs(regex="a|b")),
    ({"guided_choice": ["x"]}, StructuredOutputs(choice=("x",))),
    ({"guided_grammar": 'root ::= "b"'}, StructuredOutputs(grammar='root ::= "b"')),
    ({"response_format": {"type": "text"}, "guided_regex": "a"}, StructuredOutputs(regex="a")),
])
def test_structured_output_fields_become_sampling_params(fields, want) -> None:
    for model, base in ((ChatCompletionRequest, CHAT), (CompletionRequest, {"prompt": "hi"})):
        params = model.model_validate(base | fields).to_sampling_params(8)
        assert params.structured_outputs == want
        assert params.max_tokens == 8


@pytest.mark.parametrize("fields, words", [
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "response_format: a request takes one structured-output constraint, this one has 2"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex: a request takes one"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs: structured_outputs needs "
                                                              "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs: structured_outputs needs exactly one"),
    ({"guided_json": "{not json"}, "guided_json: structured_outputs.json is not valid JSON"),
    ({"guided_choice": []}, "guided_choice: structured_outputs.choice must be a non-empty list"),
    ({"guided_regex": "a", "ignore_eos": True}, "structured_outputs and ignore_eos cannot be combined"),
])
def test_malformed_or_several_structured_constraints_are_refused(fields, words) -> None:
    with pytest.raises(ValueError, match=re.escape(words)):
        ChatCompletionRequest.model_validate(CHAT | fields).to_sampling_params(8)


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_schema"}},
    {"response_format": {"type": "json_object", "json_schema": {"name": "a", "schema": SCHEMA}}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
    {"response_format": {"type": "xml"}},
    {"structured_outputs": {"regexp": "a"}},
    {"guided_decoding_backend": "xgrammar"},
])
def test_structured_output_requests_of_the_wrong_shape_fail_validation(fields) -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(CHAT | fields)


def test_structured_requests_through_the_openai_client(server) -> None:
    """Each way of asking reaches the engine's grammar: the answers keep to it."""
    oai, messages = server.openai, [{"role": "user", "content": "12+34="}]
    kw = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    for extra in ({"guided_choice": ["13", "99"]}, {"structured_outputs": {"choice": ["13", "99"]}}):
        reply = oai.chat.completions.create(**kw, extra_body=extra)
        assert reply.choices[0].message.content in ("13", "99")
    reply = oai.chat.completions.create(**kw, extra_body={"guided_regex": "7[0-9]"})
    assert re.fullmatch("7[0-9]", reply.choices[0].message.content)
    reply = oai.chat.completions.create(**kw, response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    done = oai.completions.create(model=MODEL, prompt="12+34=", max_tokens=8, temperature=0,
                                  extra_body={"guided_choice": ["5", "99"]})
    assert done.choices[0].text in ("5", "99")


@pytest.mark.parametrize("extra, param, words", [
    ({"guided_regex": "("}, "guided_regex", "structured_outputs.regex:"),
    ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs", "structured_outputs.grammar:"),
    ({"guided_choice": ["1"], "ignore_eos": True}, "guided_choice", "cannot be combined"),
])
def test_a_grammar_the_engine_refuses_is_a_400_naming_the_field_sent(server, extra, param, words) -> None:
    r = server.client.post("/v1/chat/completions", json=CHAT | {"max_tokens": 4} | extra)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and "chatcmpl-" not in err["message"] and err["param"] == param, err
    assert post(server, "/v1/completions", {"prompt": "12+34=", "max_tokens": 5, "temperature": 0}
                )["choices"][0]["text"] == "46"


# ---- a dead engine stops the server -----------------------------------------------------

def _engine_pid(server_pid: int) -> int:
    """The engine process among the server's children (the other is multiprocessing's
    resource tracker)."""
    with open(f"/proc/{server_pid}/task/{server_pid}/children") as f:
        children = [int(p) for p in f.read().split()]
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                return pid
    raise AssertionError(f"no engine process among {children}")


def test_the_server_exits_nonzero_once_its_engine_process_dies() -> None:
    """Requests in flight when the engine process is killed get a 500 body (streamed: an
    error event), and ``serve`` exits 1 instead of answering 500 for ever. One sequence at
    a time, so of three requests of 55 tokens at most one can end before the kill."""
    cmd = [sys.executable, "-m", "minivllm", "serve", FIXTURE, "--port", "0", "--device", "cpu",
           "--num-blocks", "64", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    started = threading.Event()
    url: list[str] = []

    def read_log() -> None:  # drained to the end, so the server never blocks on a full pipe
        for line in proc.stderr:  # type: ignore[union-attr]
            log.append(line)
            if m := re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line):
                url.append(m.group(1))
                started.set()

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    try:
        assert started.wait(120), "".join(log)[-3000:]
        body = {"prompt": "1+1=", "max_tokens": 55, "ignore_eos": True}

        def whole() -> tuple[int, dict]:
            r = httpx.post(url[0] + "/v1/completions", json=body, timeout=TIMEOUT)
            return r.status_code, r.json()

        def streamed() -> list[Any]:
            with httpx.stream("POST", url[0] + "/v1/completions", json=body | {"stream": True},
                              timeout=TIMEOUT) as r:
                return sse(r.iter_lines())

        with ThreadPoolExecutor(3) as pool:
            answers = [pool.submit(whole), pool.submit(whole), pool.submit(streamed)]
            wait_for(lambda: metrics(url[0]).get("minivllm_requests_total") == 3, "three admitted requests")
            os.kill(_engine_pid(proc.pid), signal.SIGKILL)
            results = [a.result(TIMEOUT) for a in answers]
        assert proc.wait(TIMEOUT) == 1, "".join(log)[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
        reader.join(TIMEOUT)
    failed = 0
    for status, answer in results[:2]:
        if status == 500:
            failed += 1
            assert answer["error"]["code"] == 500 and "engine" in answer["error"]["message"], answer
        else:
            assert status == 200 and answer["choices"][0]["finish_reason"] == "length", answer
    events = results[2]
    assert events[-1] == "[DONE]"
    if "error" in events[-2]:
        failed += 1
        assert events[-2]["error"]["code"] == 500
    else:
        assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert failed >= 2, results
    assert "the server stopped because its engine failed" in "".join(log)


# ---- logprobs (need the executor's side; kept last) ---------------------------------------

def test_chat_logprobs_without_top_logprobs(server) -> None:
    messages = [{"role": "user", "content": "12+34="}]
    reply = server.openai.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                                  temperature=0, logprobs=True)
    content = reply.choices[0].logprobs.content
    assert [e.token for e in content] == ["4", "6", server.llm.tokenizer.decode([EOS])]
    assert reply.usage.completion_tokens == len(content) == 3
    assert all(e.top_logprobs == [] and e.logprob <= 0 for e in content)
    chunks = list(server.openai.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                                        temperature=0, logprobs=True, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == content
