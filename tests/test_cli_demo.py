"""The trained tiny Qwen3 (fixtures/tiny-qwen3) answers its held-out additions
through the whole engine, under preemption, and through the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from minivllm import LLM, SamplingParams
from minivllm.__main__ import main as cli_main

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "tiny-qwen3")


@pytest.fixture(scope="module")
def heldout() -> list[tuple[int, int]]:
    with open(os.path.join(FIXTURE, "heldout.json")) as f:
        return [tuple(p) for p in json.load(f)["pairs"]]


def test_heldout_accuracy_through_the_engine_under_preemption(heldout) -> None:
    # 64 seats, 40 blocks of 4 slots: far fewer than 64 sequences of ~10 tokens need.
    llm = LLM(FIXTURE, device="cpu", block_size=4, num_blocks=40, max_num_seqs=64,
              max_num_batched_tokens=128)
    prompts = [f"{a}+{b}=" for a, b in heldout]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    correct = sum(o.text == str(a + b) and o.finish_reason == "stop" for o, (a, b) in zip(outs, heldout))
    accuracy = correct / len(heldout)
    print(f"held-out accuracy {correct}/{len(heldout)} = {accuracy:.1%}, "
          f"preemptions {llm.engine.stats.num_preemptions}")
    assert llm.engine.stats.num_preemptions > 0
    assert accuracy >= 0.95


def test_chat_template_and_stop_tokens() -> None:
    llm = LLM(FIXTURE, device="cpu", num_blocks=32, max_model_len=64)
    out = llm.chat([{"role": "user", "content": "23+45="}], SamplingParams(temperature=0, max_tokens=5),
                   use_tqdm=False)[0]
    assert out.text == "68" and out.token_ids[-1] == llm.tokenizer.eos_token_id
    six = llm.tokenizer.encode("6", add_special_tokens=False)[0]
    out = llm.generate("23+45=", SamplingParams(temperature=0, max_tokens=5, stop_token_ids=(six,)),
                       use_tqdm=False)[0]
    assert out.token_ids == (six,) and out.finish_reason == "stop" and out.stop_reason == six
    assert out.text == ""  # the stop token stays in token_ids, not in the text (as eos)
    eight = llm.tokenizer.encode("8", add_special_tokens=False)[0]
    out = llm.generate("23+45=", SamplingParams(temperature=0, max_tokens=5, stop_token_ids=(eight,)),
                       use_tqdm=False)[0]
    assert (out.text, out.token_ids[-1], out.stop_reason) == ("6", eight, eight)


def test_stop_strings_cut_the_text() -> None:
    llm = LLM(FIXTURE, device="cpu", num_blocks=32, max_model_len=64)
    greedy = dict(temperature=0, max_tokens=6)
    plain = llm.generate(["12+34="], SamplingParams(**greedy), use_tqdm=False)[0]
    assert plain.text == "46" and len(plain.token_ids) == 3  # '4', '6', eos
    cut = llm.generate(["12+34="], SamplingParams(**greedy, stop=["6"]), use_tqdm=False)[0]
    assert (cut.text, cut.finish_reason, len(cut.token_ids)) == ("4", "stop", 2)  # the '6' token stays
    kept = llm.generate(["12+34="], SamplingParams(**greedy, stop="6", include_stop_str_in_output=True),
                        use_tqdm=False)[0]
    assert (kept.text, kept.finish_reason) == ("46", "stop")
    never = llm.generate(["12+34="], SamplingParams(**greedy, stop=["zz"]), use_tqdm=False)[0]
    assert (never.text, never.token_ids) == (plain.text, plain.token_ids)
    bare = LLM(FIXTURE, device="cpu", num_blocks=32, max_model_len=64, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        bare.generate([[1, 2]], SamplingParams(stop=["x"]), use_tqdm=False)
    assert not bare.engine.has_unfinished_requests()


def test_cli_prints_completions(capsys) -> None:
    rc = cli_main(["generate", "--model", FIXTURE, "--device", "cpu", "--max-tokens", "5",
                   "12+34=", "50+27="])
    out = capsys.readouterr().out
    assert rc == 0 and "'12+34=' -> '46'" in out and "'50+27=' -> '77'" in out


def test_cli_engine_options_reach_the_engine() -> None:
    from minivllm.__main__ import _engine_options, _parser

    args = _parser().parse_args(["generate", "--model", FIXTURE, "--max-num-batched-tokens", "96",
                                 "--gpu-memory-utilization", "0.5", "--no-enable-prefix-caching", "x"])
    opts = _engine_options(args)
    assert opts == dict(max_num_batched_tokens=96, gpu_memory_utilization=0.5, enable_prefix_caching=False)
    llm = LLM(FIXTURE, device="cpu", num_blocks=32, max_model_len=64, **opts)
    assert llm.engine.scheduler_config.max_num_batched_tokens == 96
    assert not llm.engine.cache_config.enable_prefix_caching
    assert _engine_options(_parser().parse_args(["generate", "--model", FIXTURE, "x"])) == {}


def test_serve_runs_the_engine_in_its_own_process_unless_told() -> None:
    """vLLM's layout by default (why: ``docs/tuning.md``, "Host path")."""
    from minivllm.__main__ import _parser

    assert _parser().parse_args(["serve", FIXTURE]).engine_process is True
    assert _parser().parse_args(["serve", FIXTURE, "--no-engine-process"]).engine_process is False


def test_cli_reports_bad_input(capsys) -> None:
    assert cli_main(["generate", "--model", FIXTURE, "--device", "cpu", "--top-p", "0", "1+1="]) == 2
    assert "top_p" in capsys.readouterr().err


def test_cli_help() -> None:
    r = subprocess.run([sys.executable, "-m", "minivllm", "generate", "--help"],
                       capture_output=True, text=True, check=True)
    assert "--temperature" in r.stdout and "--max-tokens" in r.stdout
