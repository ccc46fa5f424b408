"""``benchmarks.throughput.profile_decode`` profiles decode steps only: the prompts' chunked
prefills (which carry the first sequences' decode rows with them) are stepped through
before the profiled window, and the engine is left idle after it (CPU: no kernels to time,
so the steps' bookkeeping is what is checked)."""

from __future__ import annotations

import os

from benchmarks.throughput import profile_decode
from minivllm import LLM

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "tiny-qwen3")


def test_profile_decode_times_pure_decode_steps_and_leaves_the_engine_idle() -> None:
    # A step budget of 16 tokens: 4 prompts of 12 take several steps, partly chunked, while
    # the first admitted already decode.
    llm = LLM(FIXTURE, device="cpu", num_blocks=64, max_model_len=64, max_num_batched_tokens=16,
              skip_tokenizer_init=True)
    engine = llm.engine
    before = engine.stats.num_decode_tokens, engine.stats.num_chunked_prefills
    r = profile_decode(llm, id_limit=100, batch=4, steps=5, prompt_len=12)
    assert r["batch"] == 4 and r["decode_steps"] == 5 and r["kernel_us_per_step"] == 0.0  # no CUDA kernels
    assert engine.stats.num_chunked_prefills > before[1]                # the prefills were chunked
    assert engine.stats.num_decode_tokens - before[0] >= 2 * 4 * 5      # two rounds of 5 full decode steps
    assert not engine.has_unfinished_requests()
    # Profiling again works: new request ids, the same shapes.
    assert profile_decode(llm, id_limit=100, batch=4, steps=5, prompt_len=12)["decode_steps"] == 5
    llm.close()
