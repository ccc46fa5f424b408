"""``RequestOutput.stop_reason``: the stop token id or stop string that ended a request,
None when eos, length or an abort ended it (vLLM's order: eos before stop token ids).
Over the fake executor, whose greedy tokens ``fake_next_token`` predicts."""

from __future__ import annotations

import pytest

from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.outputs import RequestOutput
from minivllm.sampling import SamplingParams
from sim.fake_executor import FakeExecutor, fake_next_token

VOCAB = 1000
PROMPT = [5, 6, 7]


class _TokenText:
    """A text stream that writes token t as ``<t>``."""

    def add(self, token_ids: list[int]) -> str:
        return "".join(f"<{t}>" for t in token_ids)


def _engine(eos: int | None, async_scheduling: bool) -> LLMEngine:
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                         async_scheduling=async_scheduling)
    return LLMEngine(sc, CacheConfig(block_size=4, num_blocks=32), FakeExecutor(VOCAB, 4, 32),
                     eos_token_id=eos, text_streams=lambda prompt, params: _TokenText())


def _greedy(n: int) -> list[int]:
    ctx = list(PROMPT)
    for _ in range(n):
        ctx.append(fake_next_token(ctx, VOCAB))
    return ctx[len(PROMPT):]


def _finals(engine: LLMEngine) -> dict[str, RequestOutput]:
    finals: dict[str, RequestOutput] = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            return finals
        for o in engine.step():
            assert o.stop_reason is None or o.finished   # only a finished request has one
            if o.finished:
                finals[o.request_id] = o
        engine.check_invariants()
    raise AssertionError("engine did not drain")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stop_reason_names_the_stop_token_or_string_and_none_for_eos_and_length(async_scheduling: bool) -> None:
    tokens = _greedy(6)
    assert len(set(tokens)) == 6, "the test needs six distinct greedy tokens"
    engine = _engine(eos=tokens[4], async_scheduling=async_scheduling)
    requests = {
        "stop_id": SamplingParams(max_tokens=10, stop_token_ids=[tokens[1]]),
        # The eos token is also a stop id here: eos is judged first, as in vLLM.
        "eos": SamplingParams(max_tokens=10, stop_token_ids=[tokens[4]]),
        "stop_str": SamplingParams(max_tokens=10, stop=[f"<{tokens[2]}>"]),
        "length": SamplingParams(max_tokens=2),
        "streamed": SamplingParams(max_tokens=10, stop_token_ids=[tokens[3]], output_kind="delta"),
    }
    for rid, params in requests.items():
        engine.add_request(rid, PROMPT, params)
    finals = _finals(engine)
    got = {rid: (o.finish_reason, o.stop_reason, o.token_ids) for rid, o in finals.items()}
    assert got == {
        "stop_id": ("stop", tokens[1], tuple(tokens[:2])),
        "eos": ("stop", None, tuple(tokens[:5])),
        "stop_str": ("stop", f"<{tokens[2]}>", tuple(tokens[:3])),
        "length": ("length", None, tuple(tokens[:2])),
        "streamed": ("stop", tokens[3], tuple(tokens[:4])),
    }


def test_an_aborted_request_has_no_stop_reason() -> None:
    engine = _engine(eos=None, async_scheduling=True)
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=20, stop_token_ids=[VOCAB - 1]))
    engine.step()
    engine.abort_request("r")
    final = _finals(engine)["r"]
    assert (final.finish_reason, final.stop_reason) == ("abort", None)
