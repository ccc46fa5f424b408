"""Structured outputs with xgrammar: the product's ``GrammarBackend`` (``engine/grammar.py``).

``XGrammarBackend`` compiles a request's ``StructuredOutputs`` once against the tokenizer's
vocabulary (compiled grammars are cached by spec) and gives each constrained sequence an
``xgrammar.GrammarMatcher``. The engine fills the masks of a step's rows in one call,
``fill_bitmasks``, which xgrammar's batch matcher spreads over threads.

xgrammar imports torch, so this module is imported by the front end (``llm.py``), never
by the engine; the tokenizer information is built on the first constrained request, so an
engine that never sees one pays nothing.
"""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from typing import Any, Callable, Sequence

import numpy as np

from minivllm.sampling import StructuredOutputs

MAX_COMPILED = 256  # distinct grammars kept compiled; the least recently used goes first

# Keywords that already restrict a string's characters: a string schema with one of them is
# left as it is by ``valid_json_strings``.
_STRING_RULES = ("pattern", "format", "enum", "const")


def valid_json_strings(schema: Any) -> Any:
    """``schema`` (a JSON schema, as parsed) with every length-limited string rewritten so
    that xgrammar's grammar of it writes valid JSON.

    xgrammar 0.2.9 turns ``minLength`` / ``maxLength`` into a repetition of any character
    but ``"``, ``\\``, CR and LF, which lets the other raw control characters (tab, NUL ...)
    into the string: not JSON. A string with a length limit (and none of ``_STRING_RULES``)
    becomes ``pattern`` ``^.{min,max}$`` instead, which xgrammar keeps to printable text
    without escapes (so such a string holds no quote, backslash or control character).
    """
    if isinstance(schema, list):
        return [valid_json_strings(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: valid_json_strings(v) for k, v in schema.items()}
    types = out.get("type")
    is_string = types == "string" or (isinstance(types, list) and types == ["string"])
    if is_string and ("minLength" in out or "maxLength" in out) and not any(k in out for k in _STRING_RULES):
        low, high = out.pop("minLength", 0), out.pop("maxLength", None)
        out["pattern"] = f"^.{{{low},{'' if high is None else high}}}$"
    return out


class XGrammarMatcher:
    """One sequence's ``xgrammar.GrammarMatcher`` (``engine.grammar.GrammarMatcher``)."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return bool(self.matcher.accept_token(token_id))

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)


class XGrammarBackend:
    """Grammars for one model: its vocabulary size and eos ids, and a tokenizer.

    Args:
        tokenizer_info: makes the ``xgrammar.TokenizerInfo`` when first needed (e.g.
            ``from_huggingface``); see ``for_tokenizer`` and ``for_vocab``.
        vocab_size: the model's vocabulary (logit rows), which may exceed the tokenizer's.
    """

    def __init__(self, tokenizer_info: Callable[[], Any], vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._make_info = tokenizer_info
        self._compiler: Any = None
        self._batch: Any = None
        self._compiled: OrderedDict[StructuredOutputs, Any] = OrderedDict()

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> "XGrammarBackend":
        """For a Hugging Face tokenizer; eos ids end a grammar."""
        def info() -> Any:
            import xgrammar as xgr
            return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=sorted(eos_token_ids))
        return cls(info, vocab_size)

    @classmethod
    def for_vocab(cls, encoded_vocab: Sequence[str], eos_token_ids: Sequence[int]) -> "XGrammarBackend":
        """For a vocabulary given as each token's text (tests drive the simulator with one)."""
        def info() -> Any:
            import xgrammar as xgr
            return xgr.TokenizerInfo(list(encoded_vocab), xgr.VocabType.RAW, vocab_size=len(encoded_vocab),
                                     stop_token_ids=sorted(eos_token_ids))
        return cls(info, len(encoded_vocab))

    def _compile(self, spec: StructuredOutputs) -> Any:
        import xgrammar as xgr
        if self._compiler is None:
            threads = max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                 else os.cpu_count() or 1))
            self._compiler = xgr.GrammarCompiler(self._make_info(), max_threads=threads)
            self._batch = xgr.BatchGrammarMatcher(threads)
        c = self._compiler
        try:
            if spec.json is not None:
                schema = json.dumps(valid_json_strings(json.loads(spec.json)))
                return c.compile_json_schema(schema, any_whitespace=not spec.disable_any_whitespace)
            if spec.json_object:
                return c.compile_json_schema('{"type": "object"}', any_whitespace=not spec.disable_any_whitespace)
            if spec.regex is not None:
                return c.compile_regex(spec.regex)
            if spec.choice is not None:
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec.choice))
            assert spec.grammar is not None
            return c.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's errors for a bad grammar
            raise ValueError(f"structured_outputs.{spec.kind}: {_message(e)}") from None

    def matcher(self, spec: StructuredOutputs) -> XGrammarMatcher:
        compiled = self._compiled.get(spec)
        if compiled is None:
            compiled = self._compiled[spec] = self._compile(spec)
            if len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(spec)
        import xgrammar as xgr
        return XGrammarMatcher(xgr.GrammarMatcher(compiled))

    def fill_bitmasks(self, matchers: list[Any], bitmask: np.ndarray, rows: list[int]) -> None:
        """Fill ``bitmask[rows[i]]`` from ``matchers[i]`` (``XGrammarMatcher``s), in parallel."""
        self._batch.batch_fill_next_token_bitmask([m.matcher for m in matchers], bitmask, rows)


def _message(e: Exception) -> str:
    """xgrammar's error without its log prefix (``[time] file.cc:line: ``)."""
    line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", line)


class NoGrammars:
    """A ``GrammarBackend`` that refuses every grammar, saying why (no tokenizer, or tensor
    parallelism, which does not apply masks)."""

    def __init__(self, vocab_size: int, reason: str) -> None:
        self.vocab_size = vocab_size
        self.reason = reason

    def matcher(self, spec: StructuredOutputs) -> Any:
        raise ValueError(f"structured_outputs are not available: {self.reason}")

    def fill_bitmasks(self, matchers: list[Any], bitmask: np.ndarray, rows: list[int]) -> None:
        raise AssertionError("no matcher was ever made")
