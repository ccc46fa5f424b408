"""The OpenAI-compatible server on loopback, over the tiny trained Qwen3 fixture.

One LLM and one uvicorn server (port 0) for the module: the engine start costs seconds.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import types
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402
import uvicorn  # noqa: E402

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.config import CacheConfig, SchedulerConfig  # noqa: E402
from minivllm.engine.llm_engine import LLMEngine  # noqa: E402
from minivllm.server.app import build_app  # noqa: E402
from minivllm.server.engine_loop import AsyncEngine, EngineDeadError  # noqa: E402
from sim.fake_executor import FakeExecutor  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "tiny-qwen3")
MODEL = "tiny-qwen3"
TIMEOUT = 20.0  # seconds: every wait in this file is bounded


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(FIXTURE, device="cpu", num_blocks=64, max_num_seqs=16, max_model_len=64) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(llm: LLM) -> Iterator[types.SimpleNamespace]:
    app = build_app(llm, MODEL)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()  # clients may connect now; uvicorn accepts once started
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with httpx.Client(base_url=url, timeout=TIMEOUT) as client:
        yield types.SimpleNamespace(url=url, client=client, engine=app.state.server.engine, llm=llm)
    srv.should_exit = True
    thread.join(TIMEOUT)
    sock.close()


def greedy(llm: LLM, prompt: str, max_tokens: int, ignore_eos: bool = False) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    return llm.generate(prompt, params, use_tqdm=False)[0].text


def sse_events(lines: Iterator[str]) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


def stream_text(events: list[str]) -> str:
    assert events[-1] == "[DONE]"
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])


def assert_400(resp: httpx.Response, words: str) -> None:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "code"} and err["code"] == 400
    assert words in err["message"], err["message"]


def test_completion_equals_generate(server) -> None:
    want = greedy(server.llm, "12+34=", 5)
    r = server.client.post("/v1/completions", json={"model": MODEL, "prompt": "12+34=",
                                                    "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["text"] == want == "46" and choice["finish_reason"] == "stop"
    prompt_len = len(server.llm.tokenizer.encode("12+34=", add_special_tokens=False))
    # "46" and the eos token that ended it.
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 3,
                             "total_tokens": prompt_len + 3}


def test_completion_of_several_prompts_and_token_ids(server) -> None:
    ids = server.llm.tokenizer.encode("50+27=", add_special_tokens=False)
    r = server.client.post("/v1/completions", json={"prompt": ["12+34=", "8+81="], "max_tokens": 5,
                                                    "temperature": 0})
    assert [c["text"] for c in r.json()["choices"]] == ["46", "89"]
    r = server.client.post("/v1/completions", json={"prompt": ids, "max_tokens": 5, "temperature": 0})
    assert r.json()["choices"][0]["text"] == "77"


def test_streaming_deltas_concatenate_to_the_text(server) -> None:
    want = greedy(server.llm, "1+2=", 20, ignore_eos=True)
    body = {"prompt": "1+2=", "max_tokens": 20, "temperature": 0, "ignore_eos": True, "stream": True}
    with server.client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert stream_text(events) == want
    last = json.loads(events[-2])
    assert last["object"] == "text_completion" and last["choices"][0]["finish_reason"] == "length"


def test_chat_completion_and_chat_stream(server) -> None:
    messages = [{"role": "user", "content": "23+45="}]
    want = server.llm.chat(messages, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0].text
    body = {"model": MODEL, "messages": messages, "max_tokens": 5, "temperature": 0}
    r = server.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["object"] == "chat.completion"
    assert got["choices"][0]["message"] == {"role": "assistant", "content": want} and want == "68"
    assert got["choices"][0]["finish_reason"] == "stop"
    with server.client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_concurrent_requests_are_batched(server) -> None:
    prompts = [f"{a}+{a + 3}=" for a in range(10, 18)]
    max_tokens = 24
    body = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    wants = [greedy(server.llm, p, max_tokens, ignore_eos=True) for p in prompts]
    steps_before = server.engine.engine.stats.num_steps

    async def run_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=body | {"prompt": p})
                                          for p in prompts))

    responses = asyncio.run(run_all())
    assert [r.json()["choices"][0]["text"] for r in responses] == wants
    steps = server.engine.engine.stats.num_steps - steps_before
    # Alone, each request takes max_tokens steps; batched they share most of them.
    assert steps < len(prompts) * max_tokens / 2, steps


@pytest.mark.parametrize("body, words", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": [500]}, "outside the vocabulary"),
    ({"prompt": "1+1=", "max_tokens": 100}, "max_model_len"),
    ({"prompt": "1+1=", "top_p": 0}, "top_p"),
    ({"prompt": "1+1=", "best_of": 2}, "best_of: unknown field"),
    ({"prompt": "1+1=", "n": 2}, "n>1 is not supported yet"),
    ({"prompt": "1+1=", "stop": ["x"]}, "stop is not supported yet"),
    ({"prompt": "1+1=", "logprobs": 1}, "logprobs is not supported yet"),
    ({"prompt": "1+1=", "presence_penalty": 0.5}, "presence_penalty is not supported yet"),
    ({"prompt": "1+1=", "frequency_penalty": 0.5}, "frequency_penalty is not supported yet"),
    ({"max_tokens": 4}, "prompt: Field required"),
    ({"prompt": [True]}, "prompt: matches none of its accepted types"),
])
def test_bad_request_gets_400(server, body, words) -> None:
    assert_400(server.client.post("/v1/completions", json=body), words)


def test_bad_requests_do_not_disturb_a_concurrent_one(server) -> None:
    want = greedy(server.llm, "1+2=", 40, ignore_eos=True)
    good = {"prompt": "1+2=", "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}

    def stream_good() -> str:
        with server.client.stream("POST", "/v1/completions", json=good) as r:
            return stream_text(sse_events(r.iter_lines()))

    with ThreadPoolExecutor(1) as pool:
        result = pool.submit(stream_good)
        for bad in ({"prompt": ""}, {"prompt": "1+1=", "max_tokens": 1000}, {"prompt": "1", "x": 1},
                    {"prompt": "1", "n": 2}, {"prompt": "1", "stop": ["x"]}):
            assert server.client.post("/v1/completions", json=bad).status_code == 400
        assert_400(server.client.post("/v1/chat/completions", json={"messages": []}), "messages")
        assert_400(server.client.post("/v1/completions", content=b"{not json",
                                      headers={"content-type": "application/json"}), "JSON")
        assert result.result(TIMEOUT) == want
    assert server.engine.wait_idle(TIMEOUT) and server.engine.error is None


def test_client_disconnect_aborts_its_request(server) -> None:
    aborted_before = server.engine.engine.stats.num_aborts
    body = {"messages": [{"role": "user", "content": "1+1="}], "max_tokens": 50,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["delta"]["role"] == "assistant"
        # Leaving both blocks closes the connection mid-stream.
    assert server.engine.wait_idle(TIMEOUT)
    assert server.engine.engine.stats.num_aborts == aborted_before + 1
    assert not server.engine.engine.has_unfinished_requests()


def test_health_models_metrics_and_unknown_model(server) -> None:
    assert server.client.get("/health").json() == {"status": "ok"}
    models = server.client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 64
    server.client.post("/v1/completions", json={"prompt": "2+2=", "max_tokens": 3})
    text = server.client.get("/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert "# TYPE minivllm_requests_total counter" in text
    assert values["minivllm_requests_total"] >= 1 and values["minivllm_engine_steps_total"] >= 1
    assert values["minivllm_generation_tokens_total"] >= 1
    assert values["minivllm_requests_running"] == 0 and values["minivllm_requests_waiting"] == 0
    r = server.client.post("/v1/completions", json={"model": "gpt-4", "prompt": "1"})
    assert r.status_code == 404 and "gpt-4" in r.json()["error"]["message"]
    assert server.client.get("/v1/nothing").json()["error"]["code"] == 404


def test_engine_failure_fails_waiting_requests(llm: LLM) -> None:
    """An exception out of step() reaches the waiting request (HTTP 500), not a hang."""
    engine = LLMEngine(SchedulerConfig(max_model_len=64), CacheConfig(block_size=4, num_blocks=32),
                       FakeExecutor(100, 4, 32))

    def broken_step() -> list:
        raise RuntimeError("device lost")

    engine.step = broken_step  # type: ignore[method-assign]
    fake_llm = types.SimpleNamespace(engine=engine, tokenizer=llm.tokenizer,
                                     prompt_token_ids=llm.prompt_token_ids)
    from fastapi.testclient import TestClient

    with TestClient(build_app(fake_llm, MODEL)) as client:
        r = client.post("/v1/completions", json={"prompt": "1+1=", "max_tokens": 3})
        assert r.status_code == 500 and "device lost" in r.json()["error"]["message"]
        assert client.get("/health").status_code == 500
        r = client.post("/v1/completions", json={"prompt": "1+1=", "max_tokens": 3})
        assert r.status_code == 500


def test_async_engine_refuses_after_close(llm: LLM) -> None:
    engine = AsyncEngine(LLMEngine(SchedulerConfig(max_model_len=64),
                                   CacheConfig(block_size=4, num_blocks=32), FakeExecutor(100, 4, 32)),
                         llm.tokenizer)
    engine.start()

    async def one() -> str:
        group = await engine.add_request("r0", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
        return "".join([d.text async for d in group])

    asyncio.run(one())
    engine.close()
    with pytest.raises(EngineDeadError):
        asyncio.run(one())
