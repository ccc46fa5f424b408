"""The OpenAI-compatible server on loopback, over the tiny trained Qwen3 fixture.

One uvicorn server (port 0, API key set) over one LLM for the module, and a second
LLM for expected answers (only the server's thread may use its engine). Clients:
the official ``openai`` package and raw HTTP (httpx, sockets). The fixture adds numbers
("12+34=" -> "46"), so answers are checkable.
Tests that need the executor's logprobs and penalties come last: an executor
without them fails the engine thread, and every later request with it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import select
import socket
import subprocess
import sys
import textwrap
import threading
import time
import types
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402
import openai  # noqa: E402
import uvicorn  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.config import CacheConfig, SchedulerConfig  # noqa: E402
from minivllm.engine.llm_engine import LLMEngine  # noqa: E402
from minivllm.server.app import build_app  # noqa: E402
from minivllm.server.engine_loop import AsyncEngine, EngineDeadError  # noqa: E402
from minivllm.server.protocol import ServerConfig  # noqa: E402
from tests.server.utils import wait_for  # noqa: E402
from sim.fake_executor import FakeExecutor  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "tiny-qwen3")
MODEL = "tiny-qwen3"
API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
TIMEOUT = 20.0  # seconds: every wait in this file is bounded


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(FIXTURE, device="cpu", num_blocks=64, max_num_seqs=16, max_model_len=64) as llm:
        yield llm


@pytest.fixture(scope="module")
def offline() -> Iterator[LLM]:
    """A second LLM for the expected answers: the server's engine belongs to its thread."""
    with LLM(FIXTURE, device="cpu", num_blocks=64, max_num_seqs=16, max_model_len=64) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(llm: LLM, offline: LLM) -> Iterator[types.SimpleNamespace]:
    app = build_app(llm, ServerConfig(MODEL, api_key=API_KEY))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()  # clients may connect now; uvicorn accepts once started
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with httpx.Client(base_url=url, timeout=TIMEOUT, headers=AUTH) as client, \
            openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT) as oai:
        yield types.SimpleNamespace(url=url, port=port, client=client, openai=oai,
                                    engine=app.state.server.engine, llm=llm, offline=offline)
    srv.should_exit = True
    thread.join(TIMEOUT)
    sock.close()


# ---- helpers ------------------------------------------------------------------------

def greedy(llm: LLM, prompt: str, max_tokens: int, ignore_eos: bool = False) -> str:
    """The offline answer (from ``offline``, never the server's LLM: its engine is the
    server thread's)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    return llm.generate(prompt, params, use_tqdm=False)[0].text


def num_tokens(llm: LLM, text: str) -> int:
    return len(llm.tokenizer.encode(text, add_special_tokens=False))


def sse_events(lines: Iterator[str]) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


def stream_json(client: httpx.Client, path: str, body: dict) -> list[dict]:
    """The chunks of a streamed response (``[DONE]`` checked and dropped)."""
    with client.stream("POST", path, json=body | {"stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return [json.loads(e) for e in events[:-1]]


def stream_texts(chunks: list[dict], key: str = "text") -> dict[int, str]:
    """Per choice index, the concatenated text (``key``: "text" or chat's "content")."""
    texts: dict[int, str] = {}
    for c in chunks:
        for ch in c["choices"]:
            part = ch[key] if key == "text" else ch["delta"].get("content", "")
            texts[ch["index"]] = texts.get(ch["index"], "") + part
    return texts


def finish_reasons(chunks: list[dict]) -> dict[int, list[str]]:
    reasons: dict[int, list[str]] = {}
    for c in chunks:
        for ch in c["choices"]:
            reasons.setdefault(ch["index"], [])
            if ch["finish_reason"] is not None:
                reasons[ch["index"]].append(ch["finish_reason"])
    return reasons


def metrics(server: types.SimpleNamespace) -> dict[str, float]:
    """Every sample of ``/metrics`` by name, labels appended as ``{k=v,...}``."""
    r = server.client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def assert_error(resp: httpx.Response, status: int, words: str, param: str | None = None) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status, err
    assert words in err["message"], err["message"]
    if param is not None:
        assert err["param"] == param, err


def completion(server: types.SimpleNamespace, **body: Any) -> dict:
    r = server.client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


# ---- answers ------------------------------------------------------------------------

def test_completion_equals_generate(server) -> None:
    want = greedy(server.offline, "12+34=", 5)
    body = completion(server, model=MODEL, prompt="12+34=", max_tokens=5, temperature=0)
    assert body["object"] == "text_completion" and body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["text"] == want == "46" and choice["finish_reason"] == "stop"
    assert choice["logprobs"] is None
    n = num_tokens(server.llm, "12+34=")
    # "46" and the eos token that ended it.
    assert body["usage"] == {"prompt_tokens": n, "completion_tokens": 3, "total_tokens": n + 3}


def test_completion_of_several_prompts_and_token_ids(server) -> None:
    ids = server.llm.tokenizer.encode("50+27=", add_special_tokens=False)
    body = completion(server, prompt=["12+34=", "8+81="], max_tokens=5, temperature=0)
    assert [c["text"] for c in body["choices"]] == ["46", "89"]
    assert body["usage"]["prompt_tokens"] == num_tokens(server.llm, "12+34=") + num_tokens(server.llm, "8+81=")
    assert completion(server, prompt=ids, max_tokens=5, temperature=0)["choices"][0]["text"] == "77"


def test_openai_client_completions_stream_equals_whole(server) -> None:
    oai = server.openai
    kw = dict(model=MODEL, prompt="1+2=", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    whole = oai.completions.create(**kw)
    assert whole.choices[0].text == greedy(server.offline, "1+2=", 20, ignore_eos=True)
    assert whole.choices[0].finish_reason == "length"
    prompt_len = num_tokens(server.llm, "1+2=")
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_len, 20)
    chunks = list(oai.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    # The usage rides alone on the last chunk; the others carry usage null.
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_openai_client_chat_stream_equals_whole(server) -> None:
    oai = server.openai
    messages = [{"role": "user", "content": "23+45="}]
    want = server.offline.chat(messages, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0].text
    whole = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
    assert want == "68" and whole.object == "chat.completion"
    assert whole.choices[0].message.content == want and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "stop" and whole.choices[0].logprobs is None
    prompt_len = len(server.llm.chat_prompt_ids(messages))
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_len, 3)
    chunks = list(oai.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=5,
                                              temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_streaming_without_include_usage_has_no_usage(server) -> None:
    chunks = stream_json(server.client, "/v1/completions", {"prompt": "1+2=", "max_tokens": 4,
                                                            "temperature": 0})
    assert chunks and all("usage" not in c for c in chunks)
    chunks = stream_json(server.client, "/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "1+2="}], "max_tokens": 4,
                          "stream_options": {"include_usage": False}})
    assert chunks and all("usage" not in c for c in chunks)


def test_n_choices_stream_equals_whole(server) -> None:
    """n=3 sampled with a seed: three indexed choices, each streamed exactly as in the whole
    response, one finish reason each, usage counting the prompt once."""
    oai = server.openai
    kw = dict(model=MODEL, prompt="1+2=", max_tokens=12, temperature=1.0, seed=7, n=3,
              extra_body={"ignore_eos": True})
    whole = oai.completions.create(**kw)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in whole.choices)
    prompt_len = num_tokens(server.llm, "1+2=")
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_len, 3 * 12)
    chunks = [c.model_dump() for c in oai.completions.create(**kw, stream=True,
                                                             stream_options={"include_usage": True})]
    assert stream_texts(chunks[:-1]) == {c.index: c.text for c in whole.choices}
    assert finish_reasons(chunks[:-1]) == {0: ["length"], 1: ["length"], 2: ["length"]}
    assert chunks[-1]["usage"] == whole.usage.model_dump()
    # Greedy choices are all the same answer; two prompts x n=2 index prompt-major.
    greedy_n = completion(server, prompt=["12+34=", "8+81="], n=2, max_tokens=5, temperature=0)
    assert [(c["index"], c["text"]) for c in greedy_n["choices"]] == [(0, "46"), (1, "46"), (2, "89"),
                                                                      (3, "89")]
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "23+45="}],
                                       n=3, max_tokens=5, temperature=0)
    assert [(c.index, c.message.content) for c in chat.choices] == [(0, "68"), (1, "68"), (2, "68")]
    assert chat.usage.completion_tokens == 9
    assert chat.usage.prompt_tokens == len(server.llm.chat_prompt_ids([{"role": "user", "content": "23+45="}]))


def test_chat_stream_of_n_choices(server) -> None:
    body = {"messages": [{"role": "user", "content": "23+45="}], "n": 2, "max_tokens": 5,
            "temperature": 0, "stream_options": {"include_usage": True}}
    chunks = stream_json(server.client, "/v1/chat/completions", body)
    roles = [ch["index"] for c in chunks for ch in c["choices"] if ch["delta"].get("role")]
    assert sorted(roles) == [0, 1]
    assert stream_texts(chunks[:-1], "content") == {0: "68", 1: "68"}
    assert finish_reasons(chunks[:-1]) == {0: ["stop"], 1: ["stop"]}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("stop, include, cut", [
    (["35"], False, "770"),          # "3" and "5" are separate tokens with eos tokens between
    ("35", True, "77035"),
    (["zz", "0"], False, "77"),
    (["99"], False, None),           # never matches: runs to max_tokens
])
def test_stop_strings(server, stop, include, cut) -> None:
    full = greedy(server.offline, "50+27=", 20, ignore_eos=True)
    assert full.startswith("77035")
    kw = dict(model=MODEL, prompt="50+27=", max_tokens=20, temperature=0, stop=stop,
              extra_body={"ignore_eos": True, "include_stop_str_in_output": include})
    whole = server.openai.completions.create(**kw)
    assert whole.choices[0].text == (full if cut is None else cut)
    assert whole.choices[0].finish_reason == ("length" if cut is None else "stop")
    chunks = [c.model_dump() for c in server.openai.completions.create(**kw, stream=True)]
    # Text that might begin a stop string is held back, so no chunk ever shows a cut part.
    assert stream_texts(chunks) == {0: whole.choices[0].text}
    assert finish_reasons(chunks) == {0: [whole.choices[0].finish_reason]}


def test_chat_stop_string(server) -> None:
    messages = [{"role": "user", "content": "23+45="}]
    whole = server.openai.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                                  temperature=0, stop="8")
    assert whole.choices[0].message.content == "6" and whole.choices[0].finish_reason == "stop"
    chunks = stream_json(server.client, "/v1/chat/completions",
                         {"messages": messages, "max_tokens": 5, "temperature": 0, "stop": ["8"]})
    assert stream_texts(chunks, "content") == {0: "6"}


# ---- refusals -----------------------------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "1+1="}]}
LONG_PROMPT = "1+" * 40 + "1="   # 82 tokens > max_model_len 64


@pytest.mark.parametrize("path, body, status, words, param", [
    ("/v1/completions", {"model": "gpt-4", "prompt": "1"}, 404, "'gpt-4' does not exist", "model"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "prompt"),
    ("/v1/completions", {"prompt": [500]}, 400, "outside the vocabulary", "prompt"),
    ("/v1/completions", {"prompt": LONG_PROMPT}, 400,
     "maximum context length (max_model_len) is 64 tokens, and the prompt has 82 tokens", "prompt"),
    ("/v1/completions", {"prompt": ["1", LONG_PROMPT]}, 400, "the prompt 1 has 82 tokens", "prompt"),
    ("/v1/completions", {"prompt": "1+1=", "max_tokens": 100}, 400,
     "you requested 104 tokens (4 in the prompt, 100 in max_tokens)", "max_tokens"),
    # The default of 16 does not fit either: named as the default, not as if it had been sent.
    ("/v1/completions", {"prompt": "1+" * 26 + "1="}, 400, "fewer than the default max_tokens of 16",
     "max_tokens"),
    ("/v1/completions", {"prompt": "1+1=", "max_tokens": 0}, 400, "max_tokens must be", "max_tokens"),
    ("/v1/completions", {"prompt": "1+1=", "top_p": 0}, 400, "top_p must be", "top_p"),
    ("/v1/completions", {"prompt": "1+1=", "temperature": "hot"}, 400, "temperature:", "temperature"),
    ("/v1/completions", {"prompt": "1+1=", "best_of": 2}, 400, "best_of: unknown field", "best_of"),
    ("/v1/completions", {"prompt": "1+1=", "n": 0}, 400, "n must be an int in [1, 128]", "n"),
    ("/v1/completions", {"prompt": "1+1=", "n": 1.5}, 400, "n: Input should be", "n"),
    ("/v1/completions", {"prompt": "1+1=", "n": 129}, 400, "n: Input should be less than or equal to 128",
     "n"),
    ("/v1/completions", {"prompt": "1+1=", "top_k": 1 << 70}, 400, "top_k: Input should be less than", "top_k"),
    ("/v1/completions", {"prompt": "1+1=", "stop_token_ids": [1 << 64]}, 400, "stop_token_ids.0: Input",
     "stop_token_ids"),
    ("/v1/completions", {"prompt": "1+1=", "stop_token_ids": [3, 100]}, 400,
     "stop_token_ids: [100] outside the vocabulary [0, 100)", "stop_token_ids"),
    ("/v1/completions", {"prompt": "1+1=", "stop_token_ids": [-1]}, 400, "outside the vocabulary",
     "stop_token_ids"),
    ("/v1/completions", {"prompt": "1+1=", "stop": ""}, 400, "stop must be", "stop"),
    ("/v1/completions", {"prompt": "1+1=", "stop": ["x", ""]}, 400, "stop must be", "stop"),
    ("/v1/completions", {"prompt": "1+1=", "stop": 5}, 400, "stop: matches none", "stop"),
    ("/v1/completions", {"prompt": "1+1=", "seed": "x"}, 400, "seed: Input should be", "seed"),
    ("/v1/completions", {"prompt": "1+1=", "seed": 1.5}, 400, "seed: Input should be", "seed"),
    ("/v1/completions", {"prompt": "1+1=", "presence_penalty": 3}, 400, "presence_penalty must be",
     "presence_penalty"),
    ("/v1/completions", {"prompt": "1+1=", "presence_penalty": "a"}, 400, "presence_penalty: Input",
     "presence_penalty"),
    ("/v1/completions", {"prompt": "1+1=", "frequency_penalty": -2.5}, 400, "frequency_penalty must be",
     "frequency_penalty"),
    ("/v1/completions", {"prompt": "1+1=", "repetition_penalty": 0}, 400, "repetition_penalty must be",
     "repetition_penalty"),
    ("/v1/completions", {"prompt": "1+1=", "logprobs": 21}, 400, "logprobs must be", "logprobs"),
    ("/v1/completions", {"prompt": "1+1=", "logprobs": -1}, 400, "logprobs must be", "logprobs"),
    ("/v1/completions", {"prompt": "1+1=", "stream_options": {"include_usage": True}}, 400,
     "stream_options: only allowed when stream is true", "stream_options"),
    ("/v1/completions", {"prompt": "1+1=", "stream": True, "stream_options": {"x": 1}}, 400,
     "stream_options.x: unknown field", "stream_options"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt: Field required", "prompt"),
    ("/v1/completions", {"prompt": [True]}, 400, "prompt: matches none of its accepted types", "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt: matches none", "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages: Input should be", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "bot", "content": "x"}]}, 400, "messages.0.role",
     "messages"),
    ("/v1/chat/completions", CHAT | {"model": "gpt-4"}, 404, "'gpt-4' does not exist", "model"),
    ("/v1/chat/completions", CHAT | {"top_logprobs": 2}, 400,
     "top_logprobs: only allowed when logprobs is true", "top_logprobs"),
    ("/v1/chat/completions", CHAT | {"logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs: Input should be less than or equal to 20", "top_logprobs"),
    ("/v1/chat/completions", CHAT | {"n": -1}, 400, "n must be", "n"),
    ("/v1/chat/completions", CHAT | {"max_completion_tokens": 0}, 400, "max_completion_tokens must be",
     "max_completion_tokens"),
    ("/v1/chat/completions", CHAT | {"max_tokens": 0}, 400, "max_tokens must be", "max_tokens"),
    ("/v1/chat/completions", CHAT | {"max_completion_tokens": 61}, 400,
     "you requested 65 tokens (4 in the messages, 61 in max_completion_tokens)", "max_completion_tokens"),
    ("/v1/chat/completions", CHAT | {"max_tokens": 61}, 400, "61 in max_tokens", "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}]}, 400,
     "the messages have 82 tokens, which leaves no room", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "1+1="}, {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]},
     400, "messages.0.content: part 1: content parts of type 'image_url' are not supported", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
     "messages.0.content: part 0: a text part is", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ["1+1="]}]}, 400,
     "part 0: a content part is an object", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400,
     "messages.0.content: Input should be a valid string", "messages"),
    ("/v1/chat/completions", CHAT | {"response_format": {"type": "json_schema"}}, 400,
     "json_schema: required when type is 'json_schema'", "response_format"),
    ("/v1/chat/completions", CHAT | {"response_format": {"type": "yaml"}}, 400, "response_format.type:",
     "response_format"),
    ("/v1/chat/completions", CHAT | {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
     400, "one structured-output constraint, this one has 2 (response_format, guided_regex)",
     "response_format"),
    ("/v1/chat/completions", CHAT | {"frequency_penalty": 9}, 400, "frequency_penalty must be",
     "frequency_penalty"),
])
def test_bad_request_is_refused(server, path, body, status, words, param) -> None:
    assert_error(server.client.post(path, json=body), status, words, param)


def test_types_a_lax_reading_coerces_are_coerced_as_vllm_does(server) -> None:
    """pydantic's lax mode, as vLLM's server reads requests: "2" is 2, 1 is true."""
    r = server.client.post("/v1/completions", json={"prompt": "1+1=", "max_tokens": "2", "n": "2", "logprobs": True,
                                                    "temperature": "0", "ignore_eos": 1})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2 and all(len(c["logprobs"]["tokens"]) == 2 for c in choices)
    r = server.client.post("/v1/chat/completions", json=CHAT | {"logprobs": 1, "max_tokens": 1})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"]["content"], r.text


def test_malformed_json_unknown_route_and_wrong_method(server) -> None:
    r = server.client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(r, 400, "the request body is not valid JSON: Expecting property name enclosed in double "
                         "quotes (at character 1)")
    assert r.json()["error"]["param"] is None   # not the character offset
    r = server.client.post("/v1/chat/completions", content=b'{"messages": []]',
                           headers={"content-type": "application/json"})
    assert_error(r, 400, "not valid JSON")
    assert r.json()["error"]["param"] is None
    r = server.client.post("/v1/completions", content=b"", headers={"content-type": "application/json"})
    assert_error(r, 400, "the request body is empty")
    assert r.json()["error"]["param"] is None
    assert_error(server.client.post("/v1/completions", json=[1, 2]), 400, "valid dictionary")
    assert_error(server.client.get("/v1/nothing"), 404, "Not Found")
    assert_error(server.client.get("/v1/completions"), 405, "Method Not Allowed")


def test_api_key_guards_v1_only(server) -> None:
    """As in vLLM: every /v1 route needs the key (an unknown one too: no probing without
    it); /health and /metrics stay open to probes and scrapers that carry none."""
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as bare:
        assert bare.get("/health").json() == {"status": "ok"}
        r = bare.get("/metrics")
        assert r.status_code == 200 and "minivllm_requests_running" in r.text
        assert_error(bare.get("/nothing"), 404, "Not Found")
        assert_error(bare.get("/v1nothing"), 404, "Not Found")   # not under /v1/
        for method, path in [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                             ("GET", "/v1/models"), ("GET", "/v1/nothing"), ("GET", "/v1")]:
            r = bare.request(method, path, json={"prompt": "1+1="})
            assert_error(r, 401, "missing API key")
            assert r.headers["www-authenticate"] == "Bearer"
            for wrong in (f"Bearer {API_KEY}x", API_KEY, "Bearer", f"Basic {API_KEY}"):
                assert_error(bare.request(method, path, headers={"Authorization": wrong}), 401,
                             "invalid API key")
            assert_error(bare.request(method, path, headers={"x-api-key": API_KEY + "x"}), 401,
                         "invalid API key in the x-api-key header")
        # The Anthropic clients' header carries the key as well; Authorization, when sent, decides.
        assert bare.get("/v1/models", headers={"x-api-key": API_KEY}).status_code == 200
        assert_error(bare.get("/v1/models", headers={"x-api-key": API_KEY, "Authorization": "Bearer no"}), 401,
                     "invalid API key in the Authorization header")
    with openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0,
                       timeout=TIMEOUT) as bad_client, pytest.raises(openai.AuthenticationError):
        bad_client.completions.create(model=MODEL, prompt="1+1=", max_tokens=2)


def test_oversized_body_is_413(server) -> None:
    big = {"prompt": "1+1=", "user": "x" * (2 << 20)}
    assert_error(server.client.post("/v1/completions", json=big), 413, "larger than the limit of 1048576")

    def chunked() -> Iterator[bytes]:  # no Content-Length: the size shows only as it arrives
        yield b'{"prompt": "1+1=", "user": "'
        for _ in range(24):
            yield b"x" * (64 << 10)
        yield b'"}'

    r = server.client.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.request.headers.get("transfer-encoding") == "chunked"
    assert_error(r, 413, "larger than the limit")
    # Just under the limit is read whole (and then refused for its content, not its size).
    near = b'{"prompt": "1+1=", "max_tokens": 0, "user": "' + b"x" * ((1 << 20) - 100) + b'"}'
    assert_error(server.client.post("/v1/completions", content=near,
                                    headers={"content-type": "application/json"}), 400, "max_tokens")


def test_bad_requests_do_not_disturb_a_concurrent_one(server) -> None:
    want = greedy(server.offline, "1+2=", 40, ignore_eos=True)
    good = {"prompt": "1+2=", "max_tokens": 40, "temperature": 0, "ignore_eos": True}

    with ThreadPoolExecutor(1) as pool:
        result = pool.submit(stream_json, server.client, "/v1/completions", good)
        for bad in ({"prompt": ""}, {"prompt": LONG_PROMPT}, {"prompt": "1", "x": 1}, {"prompt": "1", "n": 0},
                    {"prompt": "1", "stop": [""]}, {"prompt": "1", "logprobs": 99},
                    {"prompt": "1", "repetition_penalty": -1.0}, {"prompt": "1", "seed": "s"}):
            assert server.client.post("/v1/completions", json=bad).status_code == 400
        assert server.client.post("/v1/completions", json={"model": "x", "prompt": "1"}).status_code == 404
        assert server.client.post("/v1/completions", content=b"{", headers={
            "content-type": "application/json"}).status_code == 400
        assert server.client.post("/v1/completions", json={"user": "x" * (2 << 20)}).status_code == 413
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as bare:
            assert bare.post("/v1/completions", json=good).status_code == 401
        assert stream_texts(result.result(TIMEOUT)) == {0: want}
    assert completion(server, prompt="12+34=", max_tokens=5, temperature=0)["choices"][0]["text"] == "46"
    assert server.engine.wait_idle(TIMEOUT) and server.engine.error is None


# ---- load, disconnects, metrics ----------------------------------------------------

def test_64_concurrent_streaming_clients_are_batched(server) -> None:
    pairs = [(10 + a * 7 % 80, 11 + a * 13 % 77) for a in range(64)]
    before = metrics(server)

    async def one(client: httpx.AsyncClient, a: int, b: int) -> tuple[str, list[str]]:
        body = {"model": MODEL, "prompt": f"{a}+{b}=", "max_tokens": 6, "temperature": 0, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = sse_events([line async for line in r.aiter_lines()])
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        return stream_texts(chunks)[0], finish_reasons(chunks)[0]

    async def run_all() -> list[tuple[str, list[str]]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT, headers=AUTH, limits=limits) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, a, b) for a, b in pairs)), 2 * TIMEOUT)

    results = asyncio.run(run_all())
    assert [text for text, _ in results] == [str(a + b) for a, b in pairs]
    assert all(reasons == ["stop"] for _, reasons in results)
    assert server.engine.wait_idle(TIMEOUT)  # its last step recorded
    after = metrics(server)

    def steps_above(m: dict[str, float], size: float) -> float:  # steps that ran > size sequences
        return m["minivllm_batch_size_count"] - m[f"minivllm_batch_size_bucket{{le={size}}}"]

    assert steps_above(after, 1.0) > steps_above(before, 1.0), "no step ran more than one sequence"
    # max_num_seqs is 16: some step ran at least 9 sequences.
    assert steps_above(after, 8.0) > steps_above(before, 8.0)
    assert after["minivllm_requests_total"] - before["minivllm_requests_total"] == 64
    assert after["minivllm_requests_finished_total{finish_reason=stop}"] - \
        before.get("minivllm_requests_finished_total{finish_reason=stop}", 0) == 64


@pytest.fixture
def slow_steps(server) -> Iterator[None]:
    """Engine steps of at least 20 ms, so a 58-token request outlives a client's exit by far
    (the tiny model steps in milliseconds); the engine thread looks ``step`` up every loop."""
    engine = server.engine.engine
    real_step = engine.step

    def slow_step() -> list:
        time.sleep(0.02)
        return real_step()

    engine.step = slow_step
    yield
    del engine.step


KILLED_CLIENT = textwrap.dedent("""
    import json, socket, sys, threading
    port, key = int(sys.argv[1]), sys.argv[2]
    body = json.dumps({"prompt": "1+1=", "max_tokens": 58, "ignore_eos": True, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\\r\\nHost: x\\r\\nContent-Type: application/json\\r\\n"
              b"Authorization: Bearer " + key.encode() + b"\\r\\n"
              b"Content-Length: " + str(len(body)).encode() + b"\\r\\n\\r\\n" + body)
    got = b""
    while b"data: " not in got:
        got += s.recv(4096)
    print("streaming", flush=True)
    threading.Event().wait()  # until the test kills this process
""")


def test_killed_client_is_aborted_and_its_blocks_freed(server, slow_steps) -> None:
    assert server.engine.wait_idle(TIMEOUT)
    before = metrics(server)
    assert before["minivllm_kv_blocks_used"] == 0
    proc = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, str(server.port), API_KEY],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert select.select([proc.stdout], [], [], TIMEOUT)[0], "the client got no stream"
        assert proc.stdout.readline().strip() == "streaming"  # type: ignore[union-attr]
        wait_for(lambda: (m := metrics(server))["minivllm_kv_blocks_used"] > 0
                 and m["minivllm_requests_running"] == 1, "the request to hold blocks")
    finally:
        proc.kill()
        proc.wait(TIMEOUT)

    def freed() -> bool:
        m = metrics(server)
        return (m["minivllm_requests_aborted_total"] == before["minivllm_requests_aborted_total"] + 1
                and m["minivllm_kv_blocks_used"] == 0 and m["minivllm_requests_running"] == 0)

    wait_for(freed, "the killed client's request to be aborted and its blocks freed")
    assert not server.engine.engine.has_unfinished_requests()


def test_nonstreaming_client_disconnect_aborts_its_request(server, slow_steps) -> None:
    aborted_before = metrics(server)["minivllm_requests_aborted_total"]
    with pytest.raises(httpx.ReadTimeout):
        server.client.post("/v1/completions", json={"prompt": "1+1=", "max_tokens": 58, "ignore_eos": True},
                           timeout=0.3)
    wait_for(lambda: metrics(server)["minivllm_requests_aborted_total"] == aborted_before + 1,
             "the abort")
    assert server.engine.wait_idle(TIMEOUT)


def test_health_models_and_metrics(server) -> None:
    assert server.engine.wait_idle(TIMEOUT)
    models = server.client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 64
    prompt = "1+2+3+4+5+6+7+8+9+10="   # 21 tokens: one full block of 16 to share
    before = metrics(server)
    for _ in range(2):  # 3 tokens each whatever the model says (TPOT needs 2 or more)
        completion(server, prompt=prompt, max_tokens=3, temperature=0, ignore_eos=True)
    # The response can reach us before the engine thread records its last step (/metrics):
    # idle is set only after that.
    assert server.engine.wait_idle(TIMEOUT)
    m = metrics(server)
    assert m["minivllm_prefix_cache_hit_tokens_total"] - before["minivllm_prefix_cache_hit_tokens_total"] >= 16
    assert 0 < m["minivllm_prefix_cache_hit_rate"] < 1
    assert m["minivllm_prompt_tokens_total"] - before["minivllm_prompt_tokens_total"] == 42
    assert m["minivllm_generation_tokens_total"] - before["minivllm_generation_tokens_total"] >= 2
    assert m["minivllm_engine_steps_total"] > before["minivllm_engine_steps_total"]
    assert m["minivllm_requests_running"] == 0 and m["minivllm_requests_waiting"] == 0
    assert m["minivllm_kv_blocks_used"] == 0 and m["minivllm_kv_blocks_total"] == 64
    assert m["minivllm_time_to_first_token_seconds_count"] - \
        before["minivllm_time_to_first_token_seconds_count"] == 2
    assert m["minivllm_time_per_output_token_seconds_count"] > 0
    assert m["minivllm_time_per_output_token_seconds_sum"] > 0


def test_nonstreamed_requests_are_reported_once_and_keep_their_ttft(server) -> None:
    """A response sent whole asks the engine for its output only at the end (output_kind
    final_only, as vLLM's server); a streamed one gets one per token. Both observe time to
    first token, the non-streamed one from the engine's clock."""
    assert server.engine.wait_idle(TIMEOUT)
    seen: dict[str, list] = {}
    real = server.engine._deliver

    def spy(outputs: list) -> None:
        for o in outputs:
            seen.setdefault(o.request_id, []).append(o)
        real(outputs)

    server.engine._deliver = spy
    try:
        before = metrics(server)["minivllm_time_to_first_token_seconds_count"]
        body = dict(prompt="1+1=", max_tokens=5, temperature=0, ignore_eos=True)
        whole = completion(server, **body)
        streamed = stream_json(server.client, "/v1/completions", body)
        assert server.engine.wait_idle(TIMEOUT)
    finally:
        del server.engine._deliver
    assert whole["usage"]["completion_tokens"] == 5
    counts = sorted((len(outs), outs[-1].num_tokens) for outs in seen.values())
    assert counts == [(1, 5), (5, 5)], counts
    (final,) = next(outs for outs in seen.values() if len(outs) == 1)
    assert len(final.new_token_ids) == 5 and final.first_token_time is not None
    assert metrics(server)["minivllm_time_to_first_token_seconds_count"] - before == 2
    assert streamed[-1]["choices"][0]["finish_reason"] == "length"


def test_a_consumer_behind_the_engine_gets_each_choices_waiting_deltas_merged() -> None:
    """What waits in a group's queue comes out as one delta per choice (texts, tokens and
    logprobs joined in order, the last counts and finish reason), then what the engine
    sends later, one by one; an engine failure behind waiting deltas comes after them."""
    from minivllm.server.engine_loop import Delta, RequestGroup

    def d(index: int, text: str, tok: int, done: bool = False) -> Delta:
        return Delta(index, text, (tok,), ({tok: -0.5},), 3, tok, "length" if done else None)

    async def consume(group: RequestGroup, later: list[Any]) -> list[Any]:
        got = []
        try:
            async for delta in group:
                got.append(delta)
                if later:
                    group.queue.put_nowait(later.pop(0))
        except EngineDeadError as e:
            got.append(e)
        return got

    group = RequestGroup(["a"], n=2)
    for item in (d(0, "x", 1), d(1, "p", 1), d(0, "y", 2), d(0, "z", 3, done=True)):
        group.queue.put_nowait(item)
    got = asyncio.run(consume(group, [d(1, "q", 2, done=True)]))
    assert [(g.index, g.text, g.token_ids, g.num_completion_tokens, g.finish_reason) for g in got] == [
        (0, "xyz", (1, 2, 3), 3, "length"), (1, "p", (1,), 1, None), (1, "q", (2,), 2, "length")]
    assert got[0].logprobs == ({1: -0.5}, {2: -0.5}, {3: -0.5})

    group = RequestGroup(["b"])
    for item in (d(0, "x", 1), d(0, "y", 2), EngineDeadError("gone")):
        group.queue.put_nowait(item)
    got = asyncio.run(consume(group, []))
    assert [g.text if isinstance(g, Delta) else str(g) for g in got] == ["xy", "gone"]


@pytest.mark.parametrize("include_usage", [False, True])
def test_chunk_writer_writes_what_the_models_dump(include_usage: bool) -> None:
    """The streamed chunks written from strings equal the pydantic models' SSE, byte for
    byte: quotes, newlines, non-ASCII and emoji in the text, an empty text, each finish
    reason, stop reasons (none, a token id, a string), and (chat) a delta without content."""
    from minivllm.server.app import _ChunkWriter, _chunk_json, _sse
    from minivllm.server.protocol import (ChatCompletionChunk, ChatStreamChoice, CompletionChoice,
                                          CompletionStreamResponse, DeltaMessage)

    rid, created, model = 'cmpl-"x"\\1', 1_700_000_000, "tiny/qwen3 \u00e9"
    texts = ["", " t12", 'say "hi"\n\tnow\\', "caf\u00e9 \u4e2d\u6587 \U0001F600"]
    ends = [(None, None), ("length", None), ("stop", None), ("stop", 7), ("stop", 'x"\u00e9\n')]
    cases = [(i, t, f, r) for i, t in enumerate(texts) for f, r in ends]
    cw = _ChunkWriter("text_completion", rid, created, model, include_usage)
    hw = _ChunkWriter("chat.completion.chunk", rid, created, model, include_usage)
    for index, text, finish, reason in cases:
        want = _sse(_chunk_json(CompletionStreamResponse(
            id=rid, created=created, model=model,
            choices=[CompletionChoice(index=index, text=text, finish_reason=finish, stop_reason=reason)]),
            include_usage))
        assert cw.completion(index, text, finish, reason) == want
        delta = DeltaMessage(content=text) if text else DeltaMessage()
        body = _chunk_json(ChatCompletionChunk(id=rid, created=created, model=model, choices=[
            ChatStreamChoice(index=index, delta=delta, finish_reason=finish, stop_reason=reason)]),
            include_usage)
        body["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
        assert hw.chat(index, text or None, finish, reason) == _sse(body)


def test_each_app_has_its_own_registry(llm: LLM) -> None:
    a = build_app(llm, ServerConfig("a")).state.server.metrics
    b = build_app(llm, ServerConfig("b")).state.server.metrics
    a.requests.inc(5)
    assert a.registry is not b.registry
    assert b.registry.get_sample_value("minivllm_requests_total") == 0


def test_server_config_is_validated() -> None:
    for bad in (dict(model_name=""), dict(model_name="m", api_key=""), dict(model_name="m", max_body_bytes=0)):
        with pytest.raises(ValueError):
            ServerConfig(**bad)  # type: ignore[arg-type]


# ---- engine failures ----------------------------------------------------------------

def _fake_llm(llm: LLM, engine: LLMEngine) -> types.SimpleNamespace:
    return types.SimpleNamespace(engine=engine, tokenizer=llm.tokenizer, prompt_token_ids=llm.prompt_token_ids)


def _fake_engine() -> LLMEngine:
    return LLMEngine(SchedulerConfig(max_model_len=64), CacheConfig(block_size=4, num_blocks=32),
                     FakeExecutor(100, 4, 32))


def test_engine_failure_fails_waiting_requests(llm: LLM) -> None:
    """An exception out of step() reaches the waiting request (HTTP 500), not a hang."""
    engine = _fake_engine()

    def broken_step() -> list:
        raise RuntimeError("device lost")

    engine.step = broken_step  # type: ignore[method-assign]
    from fastapi.testclient import TestClient

    with TestClient(build_app(_fake_llm(llm, engine), ServerConfig(MODEL))) as client:
        r = client.post("/v1/completions", json={"prompt": "1+1=", "max_tokens": 3})
        assert r.status_code == 500 and "device lost" in r.json()["error"]["message"]
        assert client.get("/health").status_code == 500
        r = client.post("/v1/completions", json={"prompt": "1+1=", "max_tokens": 3})
        assert r.status_code == 500


def test_choice_the_engine_never_finishes_is_a_500_not_a_hang(llm: LLM) -> None:
    engine = _fake_engine()
    real_step = engine.step

    def step_losing_choice_1() -> list:
        return [o for o in real_step() if o.index != 1]

    engine.step = step_losing_choice_1  # type: ignore[method-assign]
    from fastapi.testclient import TestClient

    with TestClient(build_app(_fake_llm(llm, engine), ServerConfig(MODEL))) as client:
        r = client.post("/v1/completions", json={"prompt": "1+1=", "max_tokens": 3, "n": 2})
        assert r.status_code == 500 and "without finishing choice 1" in r.json()["error"]["message"]
        r = client.post("/v1/completions", json={"prompt": "1+1=", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def test_handler_bug_is_a_500_with_the_openai_body(llm: LLM) -> None:
    app = build_app(_fake_llm(llm, _fake_engine()), ServerConfig(MODEL))

    def broken(req: Any) -> list[list[int]]:
        raise KeyError("oops")

    app.state.server.completion_prompts = broken
    from fastapi.testclient import TestClient

    with TestClient(app, raise_server_exceptions=False) as client:
        assert_error(client.post("/v1/completions", json={"prompt": "1"}), 500, "KeyError: 'oops'")


def test_engine_failure_while_admitting_fails_that_request(llm: LLM) -> None:
    """An exception out of the engine while a request is being admitted (not a refusal)
    stops the engine, and that request fails with EngineDeadError rather than waiting forever."""
    engine = AsyncEngine(_fake_engine(), llm.tokenizer)

    def broken(*args: Any) -> None:
        raise RuntimeError("engine bug")

    engine.engine.validate_request = broken  # type: ignore[method-assign]
    engine.start()
    with pytest.raises(EngineDeadError, match="engine bug"):
        asyncio.run(asyncio.wait_for(engine.add_request("r0", [1, 2], SamplingParams(max_tokens=2)), TIMEOUT))
    engine.close()


def test_async_engine_refuses_after_close(llm: LLM) -> None:
    engine = AsyncEngine(_fake_engine(), llm.tokenizer)
    engine.start()

    async def one() -> str:
        group = await engine.add_request("r0", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
        return "".join([d.text async for d in group])

    asyncio.run(one())
    engine.close()
    with pytest.raises(EngineDeadError):
        asyncio.run(one())


# ---- logprobs and penalties (need the executor's side; kept last) -------------------

@pytest.fixture(scope="module")
def hf_model() -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(FIXTURE, dtype="float32").eval()


def reference_logprobs(hf_model: Any, ids: list[int]) -> Any:
    """log_softmax of the raw logits at every position of ``ids``: (len(ids), vocab)."""
    import torch

    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def test_completion_logprobs_match_a_direct_computation(server, hf_model) -> None:
    prompt_ids = server.llm.tokenizer.encode("50+27=", add_special_tokens=False)
    out = server.offline.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                              use_tqdm=False)[0]
    completion_ids = list(out.token_ids)
    ref = reference_logprobs(hf_model, prompt_ids + completion_ids)
    body = completion(server, prompt="50+27=", max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    lp = body["choices"][0]["logprobs"]
    text = server.llm.tokenizer.decode
    assert lp["tokens"] == [text([t], skip_special_tokens=False) for t in completion_ids]
    assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 6
    offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(6)]
    assert lp["text_offset"] == offsets
    for i, t in enumerate(completion_ids):
        row = ref[len(prompt_ids) - 1 + i]
        assert lp["token_logprobs"][i] == pytest.approx(row[t].item(), abs=1e-3)
        top = row.topk(3)
        want = {text([j], skip_special_tokens=False): v for j, v in zip(top.indices.tolist(), top.values.tolist())}
        assert lp["top_logprobs"][i] == pytest.approx(want, abs=1e-3)   # greedy: the token is the top one
    # Streamed: the same lists, chunk by chunk; logprobs=0 keeps the sampled token's own only.
    chunks = stream_json(server.client, "/v1/completions", {"prompt": "50+27=", "max_tokens": 6,
                                                            "temperature": 0, "ignore_eos": True,
                                                            "logprobs": 3})
    joined = {k: [x for c in chunks for x in c["choices"][0]["logprobs"][k]] for k in lp}
    assert joined == lp
    zero = completion(server, prompt="50+27=", max_tokens=2, temperature=0, logprobs=0)
    assert [len(d) for d in zero["choices"][0]["logprobs"]["top_logprobs"]] == [1, 1]


def test_chat_logprobs(server, hf_model) -> None:
    messages = [{"role": "user", "content": "23+45="}]
    prompt_ids = server.llm.chat_prompt_ids(messages)
    body = {"messages": messages, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    r = server.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert "".join(e["token"] for e in content[:-1]) == "68" and content[-1]["token"] == "<eos>"
    ids = server.llm.tokenizer.encode("68", add_special_tokens=False) + [2]
    ref = reference_logprobs(hf_model, prompt_ids + ids)
    for i, (e, t) in enumerate(zip(content, ids)):
        assert e["logprob"] == pytest.approx(ref[len(prompt_ids) - 1 + i, t].item(), abs=1e-3)
        assert e["bytes"] == list(e["token"].encode()) and len(e["top_logprobs"]) == 2
        assert e["top_logprobs"][0]["token"] == e["token"]   # greedy
        assert e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"]
    chunks = stream_json(server.client, "/v1/chat/completions", body)
    streamed = [x for c in chunks for ch in c["choices"] if ch.get("logprobs") for x in ch["logprobs"]["content"]]
    assert streamed == content
    via_openai = server.openai.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                                       temperature=0, logprobs=True, top_logprobs=0)
    assert [e.token for e in via_openai.choices[0].logprobs.content] == [e["token"] for e in content]
    assert all(e.top_logprobs == [] for e in via_openai.choices[0].logprobs.content)


def reference_penalized_greedy(hf_model: Any, prompt: list[int], max_tokens: int, presence: float = 0.0,
                               frequency: float = 0.0, repetition: float = 1.0) -> list[int]:
    """Greedy decoding with the penalties as ``SamplingParams`` defines them, from raw logits."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = hf_model(torch.tensor([ids])).logits[0, -1].float()
            seen = torch.zeros_like(logits, dtype=torch.bool)
            seen[ids] = True
            logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
            counts = torch.bincount(torch.tensor(ids[len(prompt):], dtype=torch.long),
                                    minlength=logits.numel()).float()
            logits = logits - presence * (counts > 0).float() - frequency * counts
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("penalty", [{"frequency_penalty": 1.5}, {"presence_penalty": 2.0},
                                     {"repetition_penalty": 3.0}])
def test_penalties_change_outputs_as_defined(server, hf_model, penalty) -> None:
    prompt_ids = server.llm.tokenizer.encode("12+34=", add_special_tokens=False)
    names = {"frequency_penalty": "frequency", "presence_penalty": "presence", "repetition_penalty": "repetition"}
    want = reference_penalized_greedy(hf_model, prompt_ids, 12, **{names[k]: v for k, v in penalty.items()})
    plain = reference_penalized_greedy(hf_model, prompt_ids, 12)
    assert want != plain   # the penalty matters here
    text = server.llm.tokenizer.decode(want, skip_special_tokens=True)
    got = completion(server, prompt="12+34=", max_tokens=12, temperature=0, ignore_eos=True, **penalty)
    assert got["choices"][0]["text"] == text


def test_vllm_extras_that_shape_the_request(server, caplog: pytest.LogCaptureFixture,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``truncate_prompt_tokens`` keeps the prompt's last tokens; ``request_id`` names the
    response; ``priority`` 0 is served and another refused; OpenAI fields that change nothing
    here are accepted with one warning each."""
    r = server.client.post("/v1/completions", json={"prompt": "9+9=1+1=", "max_tokens": 2, "temperature": 0,
                                                    "truncate_prompt_tokens": 4, "request_id": "mine"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 4 and r.json()["id"] == "cmpl-mine"
    short = server.client.post("/v1/completions", json={"prompt": "1+1=", "max_tokens": 2, "temperature": 0})
    assert r.json()["choices"][0]["text"] == short.json()["choices"][0]["text"]
    r = server.client.post("/v1/chat/completions", json=CHAT | {"truncate_prompt_tokens": 3, "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3, r.text
    assert_error(server.client.post("/v1/completions", json={"prompt": "1", "truncate_prompt_tokens": 0}), 400,
                 "truncate_prompt_tokens", "truncate_prompt_tokens")
    assert_error(server.client.post("/v1/chat/completions", json=CHAT | {"priority": 2}), 400, "only priority 0",
                 "priority")
    from minivllm.server import protocol
    monkeypatch.setattr(protocol, "_warned", set())
    extras = {"store": True, "metadata": {"k": "v"}, "service_tier": "auto", "prediction": None, "priority": 0}
    with caplog.at_level(logging.WARNING, logger="minivllm.server.protocol"):
        for _ in range(2):
            r = server.client.post("/v1/chat/completions", json=CHAT | extras | {"max_tokens": 1})
            assert r.status_code == 200, r.text
    warned = [m for m in caplog.messages if "accepted and ignored" in m]
    assert len([m for m in warned if "'store'" in m]) == 1 and any("'metadata'" in m for m in warned)


def test_tokenize_detokenize_version_and_one_model(server) -> None:
    """vLLM's /tokenize (a prompt, or messages as the chat API renders them), /detokenize,
    /version and GET /v1/models/{id}."""
    c = server.client
    r = c.post("/tokenize", json={"prompt": "12+3=", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == server.llm.tokenizer.encode("12+3=") and body["count"] == len(body["tokens"]) == 5
    assert body["max_model_len"] == 64 and "".join(body["token_strs"]) == "12+3="
    chat = c.post("/v1/chat/completions", json=CHAT | {"max_tokens": 1}).json()
    r = c.post("/tokenize", json={"messages": CHAT["messages"]})
    assert r.json()["count"] == chat["usage"]["prompt_tokens"] and "token_strs" not in r.json()
    assert c.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": "12+3="}
    assert_error(c.post("/detokenize", json={"tokens": [1, 100]}), 400, "[100] outside the vocabulary", "tokens")
    assert_error(c.post("/tokenize", json={}), 400, "send a prompt or messages", "prompt")
    assert_error(c.post("/tokenize", json={"prompt": "1", "model": "other"}), 404, "does not exist", "model")
    assert isinstance(c.get("/version").json()["version"], str)
    listed = c.get("/v1/models").json()["data"][0]
    assert c.get(f"/v1/models/{listed['id']}").json() == listed
    assert_error(c.get("/v1/models/other"), 404, "'other' does not exist", "model")


def test_echo_and_prompt_scoring_as_lm_eval_asks(server) -> None:
    """``echo`` puts the prompt before the completion; with ``logprobs`` the prompt's tokens
    carry theirs (the first none), equal to the engine's ``prompt_logprobs``; ``max_tokens`` 0
    with ``echo`` scores the prompt alone (lm-eval-harness's log-likelihood request)."""
    c, prompt = server.client, "12+34="
    want = server.offline.generate(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1),
                                   use_tqdm=False)[0]
    r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True})
    assert r.json()["choices"][0]["text"] == prompt + want.text, r.text
    for stream in (False, True):
        body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0, "stream": stream}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: {") and json.loads(line[6:])["choices"]]
            text = "".join(e["choices"][0]["text"] for e in events)
            lp = {k: sum((e["choices"][0]["logprobs"][k] for e in events), []) for k in ("tokens", "token_logprobs")}
        else:
            choice = r.json()["choices"][0]
            text, lp = choice["text"], choice["logprobs"]
            assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 0
        assert text == prompt and "".join(lp["tokens"]) == prompt
        assert lp["token_logprobs"][0] is None
        ids = server.llm.tokenizer.encode(prompt)
        assert lp["token_logprobs"][1:] == pytest.approx(
            [max(d[t], -9999.0) for t, d in zip(ids[1:], want.prompt_logprobs[1:])], abs=1e-4)
    assert_error(c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0}), 400, "max_tokens must be",
                 "max_tokens")


def test_prompt_logprobs_in_vllms_shape(server) -> None:
    want = server.offline.generate("1+1=", SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2),
                                   use_tqdm=False)[0].prompt_logprobs
    r = server.client.post("/v1/completions", json={"prompt": "1+1=", "max_tokens": 1, "prompt_logprobs": 2})
    got = r.json()["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(want) == 4, r.text
    for entries, expected in zip(got[1:], want[1:]):
        assert {int(k) for k in entries} == set(expected)
        ranked = sorted(entries.values(), key=lambda e: e["rank"])
        assert [e["rank"] for e in ranked] == list(range(1, len(entries) + 1))
        assert [e["logprob"] for e in ranked] == sorted((e["logprob"] for e in ranked), reverse=True)
    r = server.client.post("/v1/chat/completions", json=CHAT | {"max_tokens": 1, "prompt_logprobs": 1})
    assert r.status_code == 200 and r.json()["prompt_logprobs"][0] is None and len(r.json()["prompt_logprobs"]) > 1
    assert_error(server.client.post("/v1/chat/completions", json=CHAT | {"prompt_logprobs": 1, "stream": True}),
                 400, "not returned by a streamed chat reply", "prompt_logprobs")


def test_return_token_ids_streamed_or_not(server) -> None:
    """vLLM's ``return_token_ids``: the prompt's ids and each choice's, which reassemble from a
    stream's chunks into the whole response's."""
    c, prompt_ids = server.client, server.llm.tokenizer.encode("12+34=")
    body = {"prompt": "12+34=", "max_tokens": 3, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    whole = c.post("/v1/completions", json=body).json()["choices"][0]
    assert whole["prompt_token_ids"] == prompt_ids and len(whole["token_ids"]) == 3
    assert whole["token_ids"][:2] == server.llm.tokenizer.encode("46")
    events = [json.loads(line[6:]) for line in c.post("/v1/completions", json=body | {"stream": True}).text.splitlines()
              if line.startswith("data: {")]
    assert events[0]["choices"][0]["prompt_token_ids"] == prompt_ids
    assert sum((e["choices"][0]["token_ids"] for e in events), []) == whole["token_ids"]
    chat = CHAT | {"max_tokens": 3, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    r = c.post("/v1/chat/completions", json=chat).json()
    assert r["prompt_token_ids"] == server.llm.chat_prompt_ids(CHAT["messages"]) and len(r["choices"][0]["token_ids"]) == 3
    events = [json.loads(line[6:]) for line in c.post("/v1/chat/completions", json=chat | {"stream": True}).text.splitlines()
              if line.startswith("data: {")]
    assert events[0]["prompt_token_ids"] == r["prompt_token_ids"]
    assert sum((e["choices"][0]["token_ids"] for e in events), []) == r["choices"][0]["token_ids"]
    plain = c.post("/v1/completions", json={"prompt": "12+34=", "max_tokens": 1}).json()["choices"][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None


def test_logit_bias_through_the_api(server) -> None:
    """OpenAI's ``logit_bias`` (token ids as string keys): 100 forces the token; keys that are no
    token id, or outside the vocabulary, are a 400 naming the field."""
    seven = server.llm.tokenizer.encode("7")[0]
    r = server.client.post("/v1/completions", json={"prompt": "1+1=", "max_tokens": 3, "temperature": 0,
                                                    "ignore_eos": True, "logit_bias": {str(seven): 100}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "777", r.text
    assert_error(server.client.post("/v1/completions", json={"prompt": "1", "logit_bias": {"x": 1}}), 400,
                 "logit_bias: keys must be token ids", "logit_bias")
    assert_error(server.client.post("/v1/chat/completions", json=CHAT | {"logit_bias": {"100": 1}}), 400,
                 "outside the vocabulary", "logit_bias")
    params = SamplingParams(logit_bias={3: 1.5}, allowed_token_ids=[4, 1])
    assert SamplingParams.from_dict(params.to_dict()) == params
    ones = server.llm.tokenizer.encode("1")
    r = server.client.post("/v1/completions", json={"prompt": "1+1=", "max_tokens": 3, "temperature": 1.0,
                                                    "ignore_eos": True, "allowed_token_ids": ones})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "111", r.text
    assert_error(server.client.post("/v1/completions", json={"prompt": "1", "allowed_token_ids": [100]}), 400,
                 "outside the vocabulary", "allowed_token_ids")


def test_min_tokens_and_bad_words_through_the_api(server) -> None:
    """vLLM's ``min_tokens`` (eos held back until then) and ``bad_words`` (tokenized by the
    server, with and without a leading space), streamed or not; bad values are a 400 naming
    the field."""
    c, body = server.client, {"prompt": "1+1=", "max_tokens": 8, "temperature": 0}
    assert c.post("/v1/completions", json=body).json()["choices"][0]["text"] == "2"
    r = c.post("/v1/completions", json=body | {"min_tokens": 5}).json()
    assert len(r["choices"][0]["text"]) == 5 and r["choices"][0]["finish_reason"] == "stop", r
    assert r["usage"]["completion_tokens"] == 6  # and the eos after them
    r = c.post("/v1/completions", json={**body, "prompt": "12+34=", "bad_words": ["46"]}).json()
    assert r["choices"][0]["text"] == "47", r
    chat = CHAT | {"max_tokens": 8, "temperature": 0}
    want = c.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
    events = [json.loads(line[6:]) for line in c.post(
        "/v1/chat/completions", json=chat | {"stream": True, "bad_words": [want]}).text.splitlines()
        if line.startswith("data: {")]
    got = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert got and want not in got, (want, got)
    assert_error(c.post("/v1/completions", json=body | {"min_tokens": 9}), 400, "min_tokens", "min_tokens")
    assert_error(c.post("/v1/completions", json=body | {"bad_words": [" "]}), 400, "bad_words", "bad_words")


def test_prefix_cache_hits_reach_usage() -> None:
    """``RequestOutput.num_cached_tokens`` into the Responses usage always, and into the chat and
    completions usage on a server with ``--enable-prompt-tokens-details``."""
    from tests.server.utils import served
    prompt = "1+2+3+4+5+6+7+8+9+1+2+3+4+5+6+7+8+9+1+2+3="
    with LLM(FIXTURE, device="cpu", num_blocks=64, max_model_len=64) as llm, \
            served(build_app(llm, ServerConfig(MODEL, enable_prompt_tokens_details=True)), TIMEOUT) as (url, _), \
            httpx.Client(base_url=url, timeout=TIMEOUT) as client:
        body = {"prompt": prompt, "max_tokens": 2}
        first = client.post("/v1/completions", json=body).json()["usage"]
        again = client.post("/v1/completions", json=body).json()["usage"]
        assert first["prompt_tokens_details"] == {"cached_tokens": 0}, first
        block = llm.engine.cache_config.block_size
        assert again["prompt_tokens_details"]["cached_tokens"] == (len(prompt) - 1) // block * block > 0
        chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 2}
        client.post("/v1/chat/completions", json=chat)
        usage = client.post("/v1/chat/completions", json=chat).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0
        r = client.post("/v1/responses", json={"input": prompt, "max_output_tokens": 2}).json()
        assert r["usage"]["input_tokens_details"]["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
