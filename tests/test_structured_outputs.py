"""Structured outputs through the real model: xgrammar over the tokenizer, the token bitmask
applied to the logits before sampling (torch and the fused Triton sampler), offline through
``SamplingParams.structured_outputs`` in both scheduling modes. The engine's side (masks one
step ahead, preemption, aborts, n > 1) is proven in the simulator (tests/sim/test_grammar.py)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.engine.grammar import allowed_tokens, bitmask_width  # noqa: E402
from minivllm.ops.dispatch import Ops  # noqa: E402
from minivllm.sampler.sampler import Sampler, SamplingTensors, apply_token_bitmask  # noqa: E402
from minivllm.sampling import StructuredOutputs  # noqa: E402
from minivllm.structured import XGrammarBackend  # noqa: E402

# The two implementations of every sampling op: the torch references and the Triton kernels
# (under the interpreter on the CPU).
OPS = {"torch": Ops.build("torch", torch.device("cpu"), torch.float32),
       "kernel": Ops.build("triton", torch.device("cpu"), torch.float32)}


FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "tiny-qwen3"
SCHEMA = {"type": "object",
          "properties": {"sum": {"type": "integer", "minimum": 0, "maximum": 999},
                         "word": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
          "required": ["sum", "word", "ok"], "additionalProperties": False}


def _bitmask(allowed: list[list[int]], vocab: int) -> np.ndarray:
    bits = np.zeros((len(allowed), bitmask_width(vocab) * 32), dtype=np.uint8)
    for r, ids in enumerate(allowed):
        bits[r, ids] = 1
    return np.packbits(bits, axis=1, bitorder="little").view("<i4").astype(np.int32)


def test_apply_token_bitmask_keeps_exactly_the_allowed_tokens() -> None:
    vocab, rng = 77, np.random.default_rng(0)
    allowed = [sorted(rng.choice(vocab, size=k, replace=False).tolist()) for k in (1, 5, 40, 77)]
    mask = _bitmask(allowed, vocab)
    assert [allowed_tokens(row, vocab).tolist() for row in mask] == allowed  # the layout both sides read
    logits = torch.randn(len(allowed), vocab)
    out = apply_token_bitmask(logits, torch.from_numpy(mask))
    for r, ids in enumerate(allowed):
        finite = torch.isfinite(out[r]).nonzero().flatten().tolist()
        assert finite == ids and torch.equal(out[r, ids], logits[r, ids])


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "triton"])
def test_samplers_draw_only_allowed_tokens(kernel: bool) -> None:
    """Masked rows (mostly -inf) under greedy, temperature, top-k, top-p and min-p."""
    vocab, rng = 300, np.random.default_rng(1)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3),
              SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.3, top_p=0.5),
              SamplingParams(temperature=2.0, min_p=0.2)] * 4
    allowed = [sorted(rng.choice(vocab, size=int(rng.integers(1, 6)), replace=False).tolist()) for _ in params]
    logits = torch.randn(len(params), vocab) * 3
    masked = apply_token_bitmask(logits, torch.from_numpy(_bitmask(allowed, vocab)))
    t = SamplingTensors.build(params, np.arange(len(params)) + 10, vocab, torch.device("cpu"))
    for seed in range(3):
        tokens = Sampler(OPS["kernel" if kernel else "torch"], torch.Generator().manual_seed(seed))(masked, t).tolist()
        assert all(tok in ids for tok, ids in zip(tokens, allowed)), (tokens, allowed)


@pytest.fixture(scope="module")
def llm():
    with LLM(str(FIXTURE), seed=0) as engine:
        yield engine


def _check(kind: str, value, text: str) -> None:
    if kind == "json":
        obj = json.loads(text)
        assert set(obj) == {"sum", "word", "ok"} and isinstance(obj["sum"], int)
        assert isinstance(obj["word"], str) and len(obj["word"]) <= 6 and isinstance(obj["ok"], bool)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(value, text), text
    elif kind == "choice":
        assert text in value
    else:
        assert re.fullmatch(r"x[0-9]{1,2}y", text), text


KINDS = {"json": SCHEMA, "json_object": True, "regex": r"[0-9]{2}=[0-9]{1,3}", "choice": ["yes", "no", "maybe"],
         "grammar": 'root ::= "x" [0-9] [0-9]? "y"'}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_every_kind_generates_what_its_grammar_accepts(llm: LLM, async_scheduling: bool) -> None:
    llm.engine.set_async_scheduling(async_scheduling)
    try:
        prompts, params = [], []
        for kind, value in KINDS.items():
            for temperature in (0.0, 1.0):
                prompts.append("12+34=")
                params.append(SamplingParams(temperature=temperature, seed=5, max_tokens=48, n=2,
                                             structured_outputs={kind: value, "disable_any_whitespace": True}))
        params.append(SamplingParams(temperature=0, max_tokens=8))  # an unconstrained row beside them
        prompts.append("12+34=")
        outs = llm.generate(prompts, params, use_tqdm=False)  # n outputs per prompt, in order
        per_output = [p for p in params for _ in range(p.n)]
        assert len(outs) == len(per_output)
        for out, p in zip(outs[:-1], per_output):
            kind = p.structured_outputs.kind
            # The engine checks every sampled token against its matcher (a disallowed one is a
            # RuntimeError), so a completion cut by max_tokens is a prefix of the grammar. Any
            # JSON object lets this model write one long key; the others end within 48 tokens.
            if kind == "json_object" and out.finish_reason == "length":
                continue
            assert out.finish_reason == "stop", (kind, out.text)
            _check(kind, KINDS[kind], out.text)
        plain = llm.generate(["12+34="], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        assert outs[-1].token_ids == plain[0].token_ids  # the masks of the other rows did not leak
    finally:
        llm.engine.set_async_scheduling(False)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_masked_steps_sample_under_inference_mode(llm: LLM, async_scheduling: bool,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A masked step samples later, when its bitmask comes (outside ``submit``): under inference
    mode as an unmasked step does, since on CUDA its results land in a pinned buffer made there
    (an in-place copy into it outside that mode is a RuntimeError)."""
    executor = llm.engine.executor
    modes: list[tuple[bool, bool]] = []
    sample = executor.sampler.__call__

    def recording(logits, tensors, **kw):
        modes.append((torch.is_inference_mode_enabled(), bool(torch.isinf(logits).any())))
        return sample(logits, tensors, **kw)

    monkeypatch.setattr(executor, "sampler", recording)
    llm.engine.set_async_scheduling(async_scheduling)
    try:
        params = [SamplingParams(temperature=0, max_tokens=6, structured_outputs={"regex": "[0-9]{4}"}),
                  SamplingParams(temperature=0, max_tokens=6)]
        llm.generate(["12+34=", "50+27="], params, use_tqdm=False)
    finally:
        llm.engine.set_async_scheduling(False)
    assert any(masked for _, masked in modes)  # masked steps ran
    assert all(inference for inference, _ in modes), modes


def test_choice_ends_on_one_of_the_choices(llm: LLM) -> None:
    out = llm.generate(["50+27="], SamplingParams(temperature=0, max_tokens=16,
                                                  structured_outputs={"choice": ["77", "78", "99"]}), use_tqdm=False)
    assert out[0].text in ("77", "78", "99")


def test_choices_with_quotes_and_backslashes_accept_exactly_those_strings() -> None:
    """A choice is a literal string, whatever it holds: ``"`` and ``\\`` in it must reach the
    grammar escaped, else a choice fails to compile or another string (its escaped spelling,
    a newline for ``\\n``) is accepted instead. One character a token, so every string spells."""
    chars = [chr(c) for c in range(32, 127)] + ["\n", "é", "<eos>"]
    eos = len(chars) - 1
    backend = XGrammarBackend.for_vocab(chars, [eos])
    choices = ('say "hi"', "C:\\dir\\new", '\\"', '"', "\\", "café")
    spec = StructuredOutputs(choice=choices)

    def accepts(text: str) -> bool:
        matcher = backend.matcher(spec)
        return all(matcher.accept_token(chars.index(ch)) for ch in text) and matcher.accept_token(eos)

    assert [c for c in choices if not accepts(c)] == []
    others = ('say \\"hi\\"', "say hi", "C:\\dir\new", "C:\\\\dir\\\\new", "C:\\dir", '\\\\"', "\\\\",
              '""', "", "caf\\u00e9", "say")
    assert [o for o in others if accepts(o)] == []


def test_bad_grammars_and_engines_without_grammars_are_clear_errors(llm: LLM) -> None:
    with pytest.raises(ValueError, match="structured_outputs.regex: .*parenthesis"):
        llm.generate(["1"], SamplingParams(structured_outputs={"regex": "("}), use_tqdm=False)
    with pytest.raises(ValueError, match="structured_outputs.json"):
        llm.generate(["1"], SamplingParams(structured_outputs={"json": {"type": "no-such-type"}}), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    with LLM(str(FIXTURE), skip_tokenizer_init=True) as bare:
        with pytest.raises(ValueError, match="skip_tokenizer_init"):
            bare.generate([[1, 2]], SamplingParams(structured_outputs={"choice": ["a"]}), use_tqdm=False)


def test_a_schemas_property_order_is_the_outputs_order(llm: LLM) -> None:
    """A schema sent as a dict keeps its keys' order (not sorted): the grammar, and so the
    output, writes the properties in the order the schema lists them."""
    schema = {"type": "object", "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "boolean"}},
              "required": ["zeta", "alpha"], "additionalProperties": False}
    assert list(json.loads(StructuredOutputs(json=schema).json)["properties"]) == ["zeta", "alpha"]
    out = llm.generate(["12+34="], SamplingParams(temperature=0, max_tokens=40, structured_outputs={
        "json": schema, "disable_any_whitespace": True}), use_tqdm=False)[0]
    assert out.finish_reason == "stop", out.text
    assert [k for k, _ in json.loads(out.text, object_pairs_hook=list)] == ["zeta", "alpha"]


CHARS = [chr(c) for c in range(32, 127)] + ["\t", "\x00", "\x1f", "\n"]


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"s": {"type": "string", "maxLength": 8}}, "required": ["s"]},
    {"type": "object", "properties": {"s": {"type": "string", "minLength": 1}}, "required": ["s"]},
    {"type": "object", "properties": {"s": {"type": "array", "items": {"type": "string", "maxLength": 8}}},
     "required": ["s"]},
], ids=["maxLength", "minLength", "in an array"])
def test_length_limited_strings_take_no_raw_control_characters(schema: dict) -> None:
    """xgrammar's own rule for a length-limited string lets raw control characters in (not
    JSON); the backend rewrites such strings, so every output of the grammar is JSON."""
    backend = XGrammarBackend.for_vocab(CHARS + ["<eos>"], eos_token_ids=[len(CHARS)])
    spec = StructuredOutputs(json=schema, disable_any_whitespace=True)
    head = '{"s": ' + ('["' if schema["properties"]["s"]["type"] == "array" else '"')
    tail = '"]}' if head.endswith('["') else '"}'
    for bad in ("\t", "\x00", "\x1f", "\n"):
        matcher = backend.matcher(spec)
        assert all(matcher.accept_token(CHARS.index(c)) for c in head + "ab"), head
        assert not matcher.accept_token(CHARS.index(bad)), repr(bad)
    matcher = backend.matcher(spec)
    assert all(matcher.accept_token(CHARS.index(c)) for c in head + "ab" + tail)
    assert matcher.accept_token(len(CHARS)) and matcher.is_terminated()
    mask = np.zeros((1, bitmask_width(len(CHARS) + 1)), dtype=np.int32)
    matcher = backend.matcher(spec)
    for c in head:
        matcher.accept_token(CHARS.index(c))
    matcher.fill_bitmask(mask, 0)
    allowed = {CHARS[t] for t in allowed_tokens(mask[0], len(CHARS) + 1) if t < len(CHARS)}
    assert "a" in allowed and not allowed & {"\t", "\x00", "\x1f", "\n"}


def test_strings_with_their_own_character_rules_are_left_as_they_are() -> None:
    from minivllm.structured import valid_json_strings
    kept = {"type": "string", "maxLength": 3, "pattern": "^[a-z]+$"}
    assert valid_json_strings({"properties": {"a": kept}}) == {"properties": {"a": kept}}
    assert valid_json_strings({"type": "string", "minLength": 2, "maxLength": 5}) == {
        "type": "string", "pattern": "^.{2,5}$"}
