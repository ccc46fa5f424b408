"""An LLM's life on the CPU: dropped, it frees its executor at once (no reference cycle
for the collector to find); closed, it refuses work; a checkpoint without a usable
tokenizer is a clear error that says what to do."""

from __future__ import annotations

import gc
import shutil
import weakref
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.llm import TOKENIZER_FILE_SETS, has_tokenizer_files, load_tokenizer  # noqa: E402

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
TINY = FIXTURES / "tiny-qwen3"
TOKENIZER_FILES = {f for files in TOKENIZER_FILE_SETS for f in files}
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def make_llm(path: Path = TINY, **opts: Any) -> LLM:
    return LLM(str(path), **{"device": "cpu", "kernels": "torch", "block_size": 4, "num_blocks": 16, **opts})


@pytest.fixture
def without_tokenizer(tmp_path: Path) -> Path:
    """A copy of the tiny checkpoint without its tokenizer files."""
    out = tmp_path / "no-tokenizer"
    out.mkdir()
    for f in TINY.iterdir():
        if f.name not in TOKENIZER_FILES:
            shutil.copy(f, out / f.name)
    assert not has_tokenizer_files(str(out))
    return out


@pytest.mark.parametrize("skip_tokenizer_init", [False, True], ids=["tokenizer", "no-tokenizer"])
def test_a_dropped_llm_frees_its_executor_without_a_collection(skip_tokenizer_init: bool) -> None:
    """The executor, the model and every weight are freed by ``del llm`` alone. With a
    tokenizer, a request with a stop string gets a text stream from the engine."""
    llm = make_llm(skip_tokenizer_init=skip_tokenizer_init)
    if skip_tokenizer_init:
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    else:
        llm.generate(["12+34=", "5+5="], [GREEDY, SamplingParams(temperature=0, max_tokens=3, stop=["9"])],
                     use_tqdm=False)
    executor = weakref.ref(llm.engine.executor)
    model = weakref.ref(llm.engine.executor.model)
    # Every weight too: a parameter must not keep its layer (nor the layer its parameters)
    # alive through a cycle, or the weights outlive the model until a collection runs.
    weights = [weakref.ref(p) for p in llm.engine.executor.model.parameters()]
    gc.disable()  # what is freed below is freed by reference counting alone
    try:
        del llm
        assert executor() is None and model() is None
        assert not [w for w in weights if w() is not None]
    finally:
        gc.enable()


def test_close_is_idempotent_and_a_closed_llm_refuses_work() -> None:
    llm = make_llm()
    assert llm.generate("12+34=", GREEDY, use_tqdm=False)[0].finish_reason == "length"
    llm.close()
    llm.close()
    with pytest.raises(RuntimeError, match=r"close\(\)"):
        llm.generate("12+34=", GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="closed"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)


def test_close_frees_the_model_and_its_weights_while_the_llm_is_still_held() -> None:
    """``close()`` is how a caller that keeps the ``LLM`` object (a server's app state, a
    benchmark's loop) gives the memory back: the model, every weight and the KV pool are
    gone right after it, by reference counting alone, before the object itself is dropped."""
    llm = make_llm(skip_tokenizer_init=True)
    llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    executor = llm.engine.executor
    model = weakref.ref(executor.model)
    weights = [weakref.ref(p) for p in executor.model.parameters()]
    qkv = weakref.ref(executor.model.model.layers[0].self_attn.qkv_proj.weight)
    kv_cache = weakref.ref(executor.kv_cache)
    del executor
    gc.disable()
    try:
        llm.close()
        assert model() is None and qkv() is None
        assert not [w for w in weights if w() is not None]
        assert kv_cache() is None
    finally:
        gc.enable()
    assert llm.engine is not None  # still held: what was freed was freed by close()


def test_leaving_the_with_block_closes_the_llm_and_its_executor_once() -> None:
    calls = []
    with make_llm(skip_tokenizer_init=True) as llm:
        executor = llm.engine.executor
        own_close = getattr(executor, "close", None)

        def close() -> None:
            calls.append("close")
            if own_close is not None:
                own_close()

        executor.close = close  # type: ignore[method-assign]
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert calls == ["close"]
    with pytest.raises(RuntimeError, match=r"close\(\)"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    llm.close()
    assert calls == ["close"]


def test_a_checkpoint_without_tokenizer_files_says_to_skip_the_tokenizer(without_tokenizer: Path) -> None:
    with pytest.raises(ValueError, match="skip_tokenizer_init=True") as e:
        make_llm(without_tokenizer)
    assert str(without_tokenizer) in str(e.value) and "no tokenizer files" in str(e.value)
    llm = make_llm(without_tokenizer, skip_tokenizer_init=True)
    assert len(llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].token_ids) == 3
    llm.close()


def test_a_tokenizer_config_alone_is_not_a_tokenizer(without_tokenizer: Path) -> None:
    """transformers builds an empty tokenizer from it, which encodes any text to nothing."""
    shutil.copy(TINY / "tokenizer_config.json", without_tokenizer)
    assert not has_tokenizer_files(str(without_tokenizer))
    with pytest.raises(ValueError, match="no tokenizer files"):
        make_llm(without_tokenizer)


def test_a_tokenizer_that_fails_to_load_is_a_value_error(without_tokenizer: Path) -> None:
    (without_tokenizer / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="could not be loaded.*skip_tokenizer_init=True") as e:
        make_llm(without_tokenizer)
    assert str(without_tokenizer) in str(e.value) and e.value.__cause__ is not None


def test_a_tokenizer_of_special_tokens_only_is_refused(without_tokenizer: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    tok = Tokenizer(WordLevel({"<eos>": 0}, unk_token="<eos>"))
    tok.add_special_tokens(["<eos>"])
    tok.save(str(without_tokenizer / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"no vocabulary beyond its \d+ special token"):
        load_tokenizer(str(without_tokenizer))


@pytest.mark.parametrize("name", ["tiny-qwen3", "bpe-tokenizer"])
def test_the_fixture_tokenizers_are_accepted(name: str) -> None:
    assert len(load_tokenizer(str(FIXTURES / name))) >= 100


def test_two_engines_in_one_process_do_not_influence_each_other() -> None:
    """Two LLMs alive at once with different kernels and dtypes (torch references in
    float32; Triton kernels, the GEMV and the small-batch forward in bfloat16, under the
    interpreter), their steps interleaved: each gives exactly the tokens and logprobs it
    gives alone. Nothing that picks a kernel, PDL or a communicator is process-wide."""
    # A prefill and two decode steps (the second reads the cache the first wrote): each path
    # once; more tokens would only repeat them under the interpreter.
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=3)
    prompts = [[5, 6, 7, 8], [9, 10]]
    options = {"ref": dict(kernels="torch", dtype="float32"), "triton": dict(kernels="triton", dtype="bfloat16")}

    def run(llm: LLM) -> list:
        return [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]

    alone = {}
    for name, opts in options.items():
        with make_llm(skip_tokenizer_init=True, **opts) as llm:
            alone[name] = run(llm)
    with make_llm(skip_tokenizer_init=True, **options["ref"]) as ref, \
            make_llm(skip_tokenizer_init=True, **options["triton"]) as tri:
        assert ref.engine.executor.ops.triton is False and tri.engine.executor.ops.use_gemv is True
        together = {"triton": run(tri), "ref": run(ref)}
        together_again = {"ref": run(ref), "triton": run(tri)}
    assert together == alone and together_again == alone
