"""``/metrics`` under vLLM's names and labels, scraped from a server on loopback over the tiny
trained fixture ("12+34=" -> "46", then eos) after requests that end by stop, by length,
and by their client's abort (one streamed, one not), and from a server whose engine runs in
its own process.

A wrapper of the engine's ``step`` tallies the tokens the engine's outputs carry (what
``vllm:generation_tokens`` must count, an aborted request's undelivered tokens included) and
holds a step, once the aborted request has a token, until the server posts the abort: the
abort lands mid-request, never after the request ended by itself.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402
import openai  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.engine.llm_engine import StepRecord  # noqa: E402
from minivllm.server.app import build_app  # noqa: E402
from minivllm.server.engine_loop import AsyncEngine, ScheduleWatch  # noqa: E402
from minivllm.server.engine_process import LLMFront, ProcessAsyncEngine  # noqa: E402
from minivllm.server.metrics import ServerMetrics, WeightedHistogram  # noqa: E402
from minivllm.server.protocol import ServerConfig  # noqa: E402
from tests.server.utils import served  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "tiny-qwen3")
OPTIONS: dict[str, Any] = dict(device="cpu", num_blocks=64, max_num_seqs=16, max_model_len=64)
MODEL = "tiny/served-name"
TIMEOUT = 20.0
LABELS = {"model_name": MODEL, "engine": "0"}
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(text: str) -> Samples:
    """Every sample of a ``/metrics`` text, keyed by (name, sorted labels)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def vllm(samples: Samples, name: str, **labels: str) -> float:
    """The value of vLLM's ``name`` (``vllm:`` added) with vLLM's labels and ``labels``."""
    return samples[("vllm:" + name, tuple(sorted((LABELS | labels).items())))]


class StepTap:
    """Wraps ``engine.step``: tallies the tokens of its outputs per request; armed, holds the
    first step after a running request has a token until the server posts an abort
    (``AsyncEngine.abort``, wrapped too)."""

    def __init__(self, llm: LLM, server_engine: AsyncEngine) -> None:
        self.engine, self.real_step = llm.engine, llm.engine.step
        self.tokens: dict[str, int] = {}
        self.armed = self.produced = False
        self.holding, self.abort_posted = threading.Event(), threading.Event()
        real_abort = server_engine.abort

        def abort(request_ids: Any) -> None:
            real_abort(request_ids)
            self.abort_posted.set()

        server_engine.abort = abort  # type: ignore[method-assign]
        self.engine.step = self.step  # type: ignore[method-assign]

    def arm(self) -> None:
        self.produced = False
        self.holding.clear()
        self.abort_posted.clear()
        self.armed = True

    def step(self) -> list:
        if self.armed and self.produced:
            self.holding.set()
            assert self.abort_posted.wait(TIMEOUT), "no abort came"
        outputs = self.real_step()
        for o in outputs:
            self.tokens[o.request_id] = self.tokens.get(o.request_id, 0) + len(o.new_token_ids)
        if self.armed and any(seq.output_token_ids for seq in self.engine.requests.values()):
            self.produced = True
        return outputs


@pytest.fixture(scope="module")
def server() -> Iterator[types.SimpleNamespace]:
    with LLM(FIXTURE, **OPTIONS) as llm:
        engine = AsyncEngine.from_llm(llm, ServerMetrics(MODEL))
        app = build_app(llm, ServerConfig(MODEL), engine)
        with served(app, TIMEOUT) as (url, _), \
                openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT) as oai:
            yield types.SimpleNamespace(url=url, llm=llm, engine=engine, openai=oai)


def prompt_len(llm: LLM, prompt: str) -> int:
    return len(llm.prompt_token_ids(0, prompt))


def abort_streamed(server: types.SimpleNamespace, tap: StepTap, prompt: str) -> None:
    """A streamed completion whose client leaves after its first chunk."""
    tap.arm()
    stream = server.openai.completions.create(model=MODEL, prompt=prompt, max_tokens=50, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    assert tap.abort_posted.wait(TIMEOUT) and server.engine.wait_idle(TIMEOUT)
    tap.armed = False


def abort_whole(server: types.SimpleNamespace, tap: StepTap, prompt: str) -> Samples:
    """A non-streamed completion (its tokens reach the server only at its end) whose client
    leaves mid-request; returns ``/metrics`` as it was while the request held its blocks."""
    tap.arm()
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 50, "ignore_eos": True}).encode()
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert tap.holding.wait(TIMEOUT), "the request never got a token"
        during = scrape(httpx.get(server.url + "/metrics", timeout=TIMEOUT).text)
    assert tap.abort_posted.wait(TIMEOUT) and server.engine.wait_idle(TIMEOUT)
    tap.armed = False
    return during


def test_vllm_metrics_after_stop_length_and_aborts(server) -> None:
    llm, oai = server.llm, server.openai
    assert server.engine.wait_idle(TIMEOUT)
    before = scrape(httpx.get(server.url + "/metrics", timeout=TIMEOUT).text)
    tap = StepTap(llm, server.engine)
    try:
        stop = oai.completions.create(model=MODEL, prompt="12+34=", max_tokens=8, temperature=0)
        chunks = list(oai.completions.create(model=MODEL, prompt="1+2=", max_tokens=5, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True}))
        abort_streamed(server, tap, "1+1=")
        during = abort_whole(server, tap, "2+2=")
    finally:
        del llm.engine.step, server.engine.abort
    after = scrape(httpx.get(server.url + "/metrics", timeout=TIMEOUT).text)

    def grew(name: str, **labels: str) -> float:
        return vllm(after, name, **labels) - vllm(before, name, **labels)

    assert (stop.choices[0].finish_reason, stop.choices[0].text) == ("stop", "46")
    assert chunks[-1].choices[0].finish_reason == "length"
    assert {k[0] for k in after if k[0].startswith("vllm:")} >= {
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
        "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
        "vllm:request_time_per_output_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
        "vllm:request_queue_time_seconds_count", "vllm:request_prompt_tokens_count",
        "vllm:request_generation_tokens_count"}
    for name, labels in after:  # every vLLM sample names the served model, as vLLM's do
        if name.startswith("vllm:"):
            assert LABELS.items() <= dict(labels).items(), (name, labels)

    # While the non-streamed request ran: one running, its blocks held.
    assert vllm(during, "num_requests_running") == 1
    used = during[("minivllm_kv_blocks_used", ())]
    assert used > 0 and vllm(during, "kv_cache_usage_perc") == used / OPTIONS["num_blocks"]

    assert [grew("request_success_total", finished_reason=r) for r in ("stop", "length", "abort")] == [1, 1, 2]
    # Every token the engine generated, the aborted requests' included (the non-streamed
    # one's reached the server only in the engine's abort output). The streamed abort has
    # 1 or 2: it lands before or after the step that follows the client's first chunk.
    tokens = sorted(tap.tokens.values())
    assert len(tokens) == 4 and tokens[0] >= 1 and sum(tokens) - stop.usage.completion_tokens - 5 >= 3
    assert grew("generation_tokens_total") == grew("request_generation_tokens_sum") == sum(tokens)
    assert grew("request_generation_tokens_bucket", le="1.0") == tokens.count(1)
    prompts = sum(prompt_len(llm, p) for p in ("12+34=", "1+2=", "1+1=", "2+2="))
    assert grew("prompt_tokens_total") == grew("request_prompt_tokens_sum") == prompts
    assert grew("prefix_cache_queries_total") == prompts  # no preemption: each prompt token once
    assert grew("prefix_cache_hits_total") == \
        after[("minivllm_prefix_cache_hit_tokens_total", ())] - before[("minivllm_prefix_cache_hit_tokens_total", ())]
    assert grew("num_preemptions_total") == 0
    for per_request in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                        "request_queue_time_seconds", "request_prompt_tokens", "request_generation_tokens"):
        assert grew(per_request + "_count") == 4, per_request
        assert vllm(after, per_request + "_bucket", le="+Inf") == vllm(after, per_request + "_count")
    assert grew("request_time_per_output_token_seconds_count") == sum(n > 1 for n in tokens)
    # One gap per token after each completion's first.
    assert grew("inter_token_latency_seconds_count") == sum(tokens) - 4
    assert vllm(after, "inter_token_latency_seconds_bucket", le="+Inf") == \
        vllm(after, "inter_token_latency_seconds_count")
    assert grew("inter_token_latency_seconds_sum") > 0
    assert grew("e2e_request_latency_seconds_sum") >= grew("request_queue_time_seconds_sum") > 0
    assert vllm(after, "num_requests_running") == vllm(after, "num_requests_waiting") == 0
    assert vllm(after, "kv_cache_usage_perc") == 0
    assert after[("minivllm_requests_aborted_total", ())] - before[("minivllm_requests_aborted_total", ())] == 2


def test_engine_process_reports_vllm_metrics() -> None:
    """The engine in its own process: queue times come from its steps over the pipe."""
    front = LLMFront(FIXTURE)
    engine = ProcessAsyncEngine(FIXTURE, OPTIONS, front.tokenizer, ServerMetrics(MODEL))
    with TestClient(build_app(front, ServerConfig(MODEL), engine)) as c:
        stop = c.post("/v1/completions", json=dict(model=MODEL, prompt="12+34=", max_tokens=8)).json()
        length = c.post("/v1/completions", json=dict(model=MODEL, prompt="1+2=", max_tokens=5,
                                                     ignore_eos=True)).json()
        assert engine.wait_idle(TIMEOUT)
        m = scrape(c.get("/metrics").text)
    assert [stop["choices"][0]["finish_reason"], length["choices"][0]["finish_reason"]] == ["stop", "length"]
    generated = stop["usage"]["completion_tokens"] + length["usage"]["completion_tokens"]
    assert vllm(m, "generation_tokens_total") == generated
    assert [vllm(m, "request_success_total", finished_reason=r) for r in ("stop", "length", "abort")] == [1, 1, 0]
    assert vllm(m, "request_queue_time_seconds_count") == vllm(m, "time_to_first_token_seconds_count") == 2
    assert vllm(m, "inter_token_latency_seconds_count") == generated - 2
    assert vllm(m, "num_requests_running") == 0


def test_schedule_watch_names_a_sequence_once_until_it_finishes() -> None:
    """What crosses from an engine process each step: only the sequences scheduled first."""
    watch = ScheduleWatch()
    assert watch.first_scheduled(StepRecord({"a": 6, "b": 4}, ())) == ("a", "b")
    assert watch.first_scheduled(StepRecord({"a": 1, "b": 1, "c": 5}, (), finished={"a": (7,)})) == ("c",)
    assert watch.first_scheduled(StepRecord({"b": 1, "c": 1}, ())) == ()
    assert watch.first_scheduled(StepRecord({"a": 3, "c": 1}, ())) == ("a",)  # a new "a"


def test_weighted_histogram_exposes_cumulative_buckets() -> None:
    registry = CollectorRegistry()
    h = WeightedHistogram("vllm:x_seconds", "x", (0.01, 0.025, 80.0), {"model_name": "m"}, registry)
    h.observe(0.02, 3)
    h.observe(0.01)   # on a bound: in that bucket (le is "<=")
    h.observe(100.0, 2)
    m = scrape(generate_latest(registry).decode())
    buckets = {le: m[("vllm:x_seconds_bucket", (("le", le), ("model_name", "m")))]
               for le in ("0.01", "0.025", "80.0", "+Inf")}
    assert buckets == {"0.01": 1, "0.025": 4, "80.0": 4, "+Inf": 6}
    assert m[("vllm:x_seconds_count", (("model_name", "m"),))] == 6
    assert m[("vllm:x_seconds_sum", (("model_name", "m"),))] == pytest.approx(0.01 + 0.06 + 200.0)


def test_speculative_decoding_metrics_under_vllms_names() -> None:
    """A server with n-gram drafts: vLLM's spec_decode counters equal the engine's totals
    (accepted per position summing to the accepted), and each choice's counts reach its
    ``RequestOutput``."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    with LLM(FIXTURE, speculative_config=spec, **OPTIONS) as llm, \
            served(build_app(llm, ServerConfig(MODEL)), TIMEOUT) as (url, _):
        before = scrape(httpx.get(url + "/metrics", timeout=TIMEOUT).text)
        assert vllm(before, "spec_decode_num_drafts_total") == 0
        body = {"model": MODEL, "prompt": "1+2+1+2+1+2+1+2=", "max_tokens": 12, "temperature": 0,
                "min_tokens": 12, "structured_outputs": {"regex": "(1\\+2\\+){6}"}}
        r = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "1+2+" * 3, r.text
        after = scrape(httpx.get(url + "/metrics", timeout=TIMEOUT).text)
        stats = copy.deepcopy(llm.engine.stats)  # the server's requests only
        out = llm.generate(["1+2+1+2+1+2+1+2="], SamplingParams(temperature=0, max_tokens=8,
                                                                             structured_outputs={"regex": "(1\\+2\\+){2}"}),
                           use_tqdm=False)[0]
    assert stats.num_accepted_tokens > 0
    assert vllm(after, "spec_decode_num_drafts_total") == stats.num_drafts
    assert vllm(after, "spec_decode_num_draft_tokens_total") == stats.num_draft_tokens
    assert vllm(after, "spec_decode_num_accepted_tokens_total") == stats.num_accepted_tokens
    per_position = [vllm(after, "spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
                    for i in range(len(stats.accepted_per_position))]
    assert per_position == stats.accepted_per_position and sum(per_position) == stats.num_accepted_tokens
    assert out.num_draft_tokens >= out.num_accepted_tokens > 0
