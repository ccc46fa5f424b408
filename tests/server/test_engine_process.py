"""``serve --engine-process``: the engine in a spawned process, the server over it.

The same tiny trained fixture as ``test_server.py`` (it adds numbers: "12+34=" ->
"46"). Checked: answers equal the in-process engine's (greedy, seeded sampling with
n = 2, stop strings, logprobs), streamed and not; many concurrent requests; refused
requests; an abort frees its blocks; a dead engine process fails requests at once
(500) instead of hanging them; closing leaves no process behind; the engine process
sizes torch's threads from the CPUs it may use unless OMP_NUM_THREADS is set.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import types
from typing import Any, Iterator

import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.server.app import build_app  # noqa: E402
from minivllm.server.engine_loop import EngineDeadError  # noqa: E402
from minivllm.server.engine_process import LLMFront, ProcessAsyncEngine, engine_num_threads  # noqa: E402
from minivllm.server.protocol import ServerConfig  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "tiny-qwen3")
OPTIONS: dict[str, Any] = dict(device="cpu", num_blocks=64, max_num_seqs=16, max_model_len=64)
PROMPTS = ["12+34=", "50+27=", "8+81=", "66+19=", "45+45="]
TIMEOUT = 20.0


@pytest.fixture(scope="module")
def front() -> LLMFront:
    return LLMFront(FIXTURE)


@pytest.fixture(scope="module")
def offline() -> Iterator[LLM]:
    with LLM(FIXTURE, **OPTIONS) as llm:
        yield llm


@pytest.fixture(scope="module")
def client(front: LLMFront) -> Iterator[tuple[TestClient, ProcessAsyncEngine]]:
    engine = ProcessAsyncEngine(FIXTURE, OPTIONS, front.tokenizer)
    with TestClient(build_app(front, ServerConfig("tiny"), engine)) as c:
        yield c, engine
    assert not engine._proc.is_alive(), "the engine process outlived the app"


def completion(c: TestClient, **body: Any) -> dict[str, Any]:
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def streamed_texts(c: TestClient, **body: Any) -> dict[int, str]:
    texts: dict[int, str] = {}
    with c.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[6:])["choices"]:
                    texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
    return texts


def test_answers_equal_the_in_process_engine(client, offline: LLM) -> None:
    c, _ = client
    greedy = SamplingParams(temperature=0, max_tokens=6)
    want = [o.text for o in offline.generate(PROMPTS, greedy, use_tqdm=False)]
    assert want[0] == "46"
    got = completion(c, prompt=PROMPTS, max_tokens=6, temperature=0)["choices"]
    assert [ch["text"] for ch in got] == want
    assert streamed_texts(c, prompt=PROMPTS, max_tokens=6, temperature=0) == dict(enumerate(want))

    seeded = SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=5, ignore_eos=True)
    want_n = [o.text for o in offline.generate(["12+34="], seeded, use_tqdm=False)]
    got_n = completion(c, prompt="12+34=", temperature=1.0, max_tokens=8, n=2, seed=5, ignore_eos=True)
    assert [ch["text"] for ch in got_n["choices"]] == want_n
    assert got_n["usage"]["completion_tokens"] == 16

    stop = completion(c, prompt="12+34=", max_tokens=6, temperature=0, stop=["6"])["choices"][0]
    assert (stop["text"], stop["finish_reason"]) == ("4", "stop")
    lp = completion(c, prompt="12+34=", max_tokens=3, temperature=0, logprobs=2)["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) >= 1


def test_concurrent_requests_and_refusals(client) -> None:
    c, engine = client
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda p: completion(c, prompt=p, max_tokens=6, temperature=0)["choices"][0]["text"],
                                PROMPTS * 4))
    assert answers[:5] == answers[5:10] == answers[15:20] and answers[0] == "46"
    r = c.post("/v1/completions", json={"prompt": "1" * 100, "max_tokens": 5})
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]
    assert engine.wait_idle(TIMEOUT)
    assert engine.max_model_len == 64
    models = c.get("/v1/models").json()
    assert models["data"][0]["max_model_len"] == 64


def test_abort_frees_the_blocks(client) -> None:
    c, engine = client

    async def start_and_abort() -> None:
        group = await engine.add_request("abort-me", [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
        async for delta in group:
            if delta.token_ids:
                engine.abort(group.request_ids)
                break

    asyncio.run(start_and_abort())
    assert engine.wait_idle(TIMEOUT)
    metrics = c.get("/metrics").text
    assert "minivllm_kv_blocks_used 0.0" in metrics
    assert completion(c, prompt="12+34=", max_tokens=6, temperature=0)["choices"][0]["text"] == "46"


def test_dead_engine_process_fails_requests_instead_of_hanging(front: LLMFront) -> None:
    engine = ProcessAsyncEngine(FIXTURE, OPTIONS, front.tokenizer)
    with TestClient(build_app(front, ServerConfig("tiny"), engine), raise_server_exceptions=False) as c:
        assert completion(c, prompt="12+34=", max_tokens=6, temperature=0)["choices"][0]["text"] == "46"
        os.kill(engine.pid, signal.SIGKILL)
        engine._proc.join(TIMEOUT)
        assert c.get("/health").status_code == 500  # before any request finds out
        r = c.post("/v1/completions", json={"prompt": "12+34=", "max_tokens": 40, "ignore_eos": True})
        assert r.status_code == 500 and "engine" in r.json()["error"]["message"]
        assert c.get("/health").status_code == 500
        assert isinstance(engine.error, EngineDeadError)
    assert not engine._proc.is_alive()


def test_engine_process_start_failure_is_an_error_with_its_cause(front: LLMFront) -> None:
    with pytest.raises(RuntimeError, match="num_blocks"):
        ProcessAsyncEngine(FIXTURE, dict(OPTIONS, num_blocks=-1), front.tokenizer)


EXIT_WITHOUT_CLOSE = """
import asyncio, sys
from minivllm import SamplingParams
from minivllm.server.engine_process import LLMFront, ProcessAsyncEngine

def main():
    front = LLMFront(sys.argv[1])
    engine = ProcessAsyncEngine(sys.argv[1], dict(device="cpu", num_blocks=64, max_model_len=64,
                                                  tensor_parallel_size=2), front.tokenizer)
    engine.start()

    async def one():
        group = await engine.add_request("r", front.prompt_token_ids(0, "12+34="), SamplingParams(max_tokens=4))
        return "".join([d.text async for d in group])

    print("ANSWER", asyncio.run(one()), flush=True)
    with open(f"/proc/{engine.pid}/task/{engine.pid}/children") as f:  # its TP worker(s)
        workers = f.read().split()
    print("PIDS", engine.pid, *workers, flush=True)

if __name__ == "__main__":
    main()  # and exit without close(): the engine process (and its TP worker) must still end
"""


def test_tensor_parallel_engine_process_and_exit_without_close(tmp_path) -> None:
    """The engine process may start TP workers of its own (so it is no daemon), and an
    interpreter that exits without ``close`` still ends it: nothing is left running."""
    import subprocess
    import sys

    script = tmp_path / "serve_tp.py"
    script.write_text(EXIT_WITHOUT_CLOSE)
    proc = subprocess.run([sys.executable, str(script), FIXTURE], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    assert lines["ANSWER"] == "46"
    pids = [int(p) for p in lines["PIDS"].split()]
    assert len(pids) >= 2, "no tensor-parallel worker under the engine process"
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or "State:\tZ" in open(f"/proc/{pid}/status").read()


# ---- torch threads of the engine process -------------------------------------------

@pytest.mark.parametrize("cpus, default, threads", [
    ({0, 1}, 2, 1),                  # two cores: one for the engine, one for the server
    (set(range(16)), 16, 15),
    ({4, 5, 6, 7}, 4, 3),            # an affinity mask, not the machine's cores
    (set(range(64)), 32, 32),        # never more than torch's default (one per physical core)
    ({3}, 1, 1),                     # at least one
])
def test_engine_threads_are_the_usable_cpus_less_the_server_share(cpus, default, threads) -> None:
    assert engine_num_threads(cpus, default) == threads


class ThreadCountLLM:
    """An ``LLM`` stand-in for the engine process whose ``max_model_len`` (the number the
    process sends at start) is torch's thread count there when the model is built."""

    def __init__(self) -> None:
        import torch

        self.scheduler_config = types.SimpleNamespace(max_model_len=torch.get_num_threads())
        self.engine = types.SimpleNamespace(has_unfinished_requests=lambda: False)

    def close(self) -> None:
        """Nothing to free."""


def engine_process_threads() -> int:
    engine = ProcessAsyncEngine(ThreadCountLLM, {}, None)
    try:
        return engine.max_model_len
    finally:
        engine.close()


def fresh_torch_threads() -> int:
    """torch's thread count in a new process under this environment, before anyone sets it."""
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                           capture_output=True, text=True, timeout=120, check=True)
    return int(probe.stdout)


def test_engine_process_sizes_torch_threads_from_its_cpus(monkeypatch) -> None:
    """Unset, the engine process takes the usable CPUs less the server's share; a user's
    OMP_NUM_THREADS (conftest sets 1 for the suite) is left as it is."""
    cpus = os.sched_getaffinity(0)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    sized = engine_num_threads(cpus, fresh_torch_threads())
    assert engine_process_threads() == sized
    monkeypatch.setenv("OMP_NUM_THREADS", str(len(cpus)))  # all of them: not what sizing gives
    chosen = fresh_torch_threads()
    assert chosen != sized or len(cpus) == 1
    assert engine_process_threads() == chosen
