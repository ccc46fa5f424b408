"""The simulator's grammar backend: small regular expressions over the fake vocabulary.

The engine talks to grammars through ``minivllm.engine.grammar`` (matchers that fill token
bitmasks and accept tokens). The product's backend is xgrammar, which imports torch; the
simulator must not, so it has this one: ``StructuredOutputs.regex`` (and ``choice``, as an
alternation of literals) over the fake tokenizer's letters (``sim.oracle.FAKE_ALPHABET``:
token t reads as one letter, ``FAKE_ALPHABET[t % 10]``), compiled to an NFA and matched on
the set of states it can be in.

Supported syntax: letters a-j, ``.`` (any letter), classes ``[a-cf]``, groups ``( )``,
alternation ``|`` and the quantifiers ``* + ?``. Eos tokens carry no letter: one is allowed
exactly where the expression can end, and once one is accepted the matcher has terminated
(nothing more is allowed but eos).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from minivllm.engine.grammar import bitmask_width, fill_each
from minivllm.sampling import StructuredOutputs, eos_token_set
from sim.oracle import FAKE_ALPHABET as LETTERS


@dataclass
class _Nfa:
    """Thompson NFA: ``edges[s]`` maps a letter to next states, ``eps[s]`` are free moves."""

    edges: list[dict[str, set[int]]] = field(default_factory=list)
    eps: list[set[int]] = field(default_factory=list)

    def state(self) -> int:
        self.edges.append({})
        self.eps.append(set())
        return len(self.edges) - 1


class _Parser:
    """Recursive descent over the pattern; each rule returns a fragment (start, end)."""

    def __init__(self, pattern: str, nfa: _Nfa) -> None:
        self.p, self.i, self.nfa = pattern, 0, nfa

    def fail(self, what: str) -> ValueError:
        return ValueError(f"regex {self.p!r}: {what} at offset {self.i}")

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    def alternation(self) -> tuple[int, int]:
        frags = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            frags.append(self.sequence())
        if len(frags) == 1:
            return frags[0]
        start, end = self.nfa.state(), self.nfa.state()
        for a, b in frags:
            self.nfa.eps[start].add(a)
            self.nfa.eps[b].add(end)
        return start, end

    def sequence(self) -> tuple[int, int]:
        start = end = self.nfa.state()
        while self.peek() not in (None, "|", ")"):
            a, b = self.piece()
            self.nfa.eps[end].add(a)
            end = b
        return start, end

    def piece(self) -> tuple[int, int]:
        a, b = self.atom()
        q = self.peek()
        if q not in ("*", "+", "?"):
            return a, b
        self.i += 1
        start, end = self.nfa.state(), self.nfa.state()
        self.nfa.eps[start].add(a)
        self.nfa.eps[b].add(end)
        if q in ("*", "?"):
            self.nfa.eps[start].add(end)
        if q in ("*", "+"):
            self.nfa.eps[b].add(a)
        return start, end

    def atom(self) -> tuple[int, int]:
        c = self.peek()
        if c == "(":
            self.i += 1
            frag = self.alternation()
            if self.peek() != ")":
                raise self.fail("unclosed group")
            self.i += 1
            return frag
        if c == "[":
            letters = self.char_class()
        elif c == ".":
            self.i += 1
            letters = set(LETTERS)
        elif c is not None and c in LETTERS:
            self.i += 1
            letters = {c}
        else:
            raise self.fail(f"unsupported character {c!r}")
        a, b = self.nfa.state(), self.nfa.state()
        for ch in letters:
            self.nfa.edges[a].setdefault(ch, set()).add(b)
        return a, b

    def char_class(self) -> set[str]:
        close = self.p.find("]", self.i)
        if close < 0:
            raise self.fail("unclosed class")
        body, self.i = self.p[self.i + 1:close], close + 1
        letters: set[str] = set()
        j = 0
        while j < len(body):
            if j + 2 < len(body) and body[j + 1] == "-":
                lo, hi = body[j], body[j + 2]
                j += 3
            else:
                lo = hi = body[j]
                j += 1
            if lo not in LETTERS or hi not in LETTERS or lo > hi:
                raise self.fail(f"bad class [{body}]")
            letters.update(ch for ch in LETTERS if lo <= ch <= hi)
        if not letters:
            raise self.fail("empty class")
        return letters


class FakeRegex:
    """A compiled pattern: an NFA with its start and accepting state, and a cache of the
    moves between state sets (a lazily built DFA)."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.nfa = _Nfa()
        parser = _Parser(pattern, self.nfa)
        start, self.accept = parser.alternation()
        if parser.i != len(pattern):
            raise parser.fail("unbalanced ')'")
        self.start = self.closure({start})
        self._moves: dict[tuple[frozenset[int], str], frozenset[int]] = {}

    def closure(self, states: set[int]) -> frozenset[int]:
        todo, seen = list(states), set(states)
        while todo:
            for t in self.nfa.eps[todo.pop()] - seen:
                seen.add(t)
                todo.append(t)
        return frozenset(seen)

    def move(self, states: frozenset[int], letter: str) -> frozenset[int]:
        """The states after ``letter`` (empty: the letter is not allowed here)."""
        key = (states, letter)
        if key not in self._moves:
            nxt: set[int] = set()
            for s in states:
                nxt |= self.nfa.edges[s].get(letter, set())
            self._moves[key] = self.closure(nxt)
        return self._moves[key]

    def accepts(self, states: frozenset[int]) -> bool:
        return self.accept in states

    def fullmatch(self, text: str) -> bool:
        states = self.start
        for ch in text:
            states = self.move(states, ch)
            if not states:
                return False
        return self.accepts(states)


def grammar_pattern(spec: StructuredOutputs) -> str:
    """The regular expression of a ``regex`` or ``choice`` spec (a choice: an alternation of
    its literals, which are letters only)."""
    if spec.regex is not None:
        return spec.regex
    if spec.choice is not None:
        return "|".join(f"({c})" for c in spec.choice)
    raise ValueError(f"the simulator's grammar backend supports regex and choice, not {spec.kind}")


class FakeMatcher:
    """One sequence's state in a ``FakeRegex`` (``minivllm.engine.grammar.GrammarMatcher``)."""

    def __init__(self, backend: "FakeGrammarBackend", regex: FakeRegex) -> None:
        self.backend, self.regex = backend, regex
        self.states = regex.start
        self.terminated = False
        self._before: list[frozenset[int]] = []  # the states before each accepted token

    def accept_token(self, token_id: int) -> bool:
        if self.terminated:
            return False
        if token_id in self.backend.eos:
            if not self.regex.accepts(self.states):
                return False
            self._before.append(self.states)
            self.terminated = True
            return True
        nxt = self.regex.move(self.states, self.backend.letter(token_id))
        if not nxt:
            return False
        self._before.append(self.states)
        self.states = nxt
        return True

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= len(self._before):
            raise ValueError(f"cannot roll back {num_tokens} of {len(self._before)} accepted tokens")
        if num_tokens:
            self.states = self._before[-num_tokens]
            del self._before[-num_tokens:]
            self.terminated = False  # eos is the last token a matcher accepts

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        words = np.zeros(bitmask.shape[1], dtype=np.int32)
        if not self.terminated:
            for letter in LETTERS:
                if self.regex.move(self.states, letter):
                    words |= self.backend.letter_rows[letter]
        if self.terminated or self.regex.accepts(self.states):
            words |= self.backend.eos_row
        bitmask[row] = words

    def is_terminated(self) -> bool:
        return self.terminated


class FakeGrammarBackend:
    """``GrammarBackend`` for the fake vocabulary: ``regex`` and ``choice`` specs."""

    def __init__(self, vocab_size: int, eos_token_id: int | list[int] | None) -> None:
        self.vocab_size = vocab_size
        self.eos = eos_token_set(eos_token_id)
        width = bitmask_width(vocab_size)
        ids = np.arange(vocab_size)
        self.letter_rows = {ch: _bits(ids[(ids % len(LETTERS) == k) & ~np.isin(ids, list(self.eos))], width)
                            for k, ch in enumerate(LETTERS)}
        self.eos_row = _bits(np.array(sorted(self.eos), dtype=np.int64), width)
        self._compiled: dict[str, FakeRegex] = {}

    @staticmethod
    def letter(token_id: int) -> str:
        return LETTERS[token_id % len(LETTERS)]

    def compile(self, spec: StructuredOutputs) -> FakeRegex:
        pattern = grammar_pattern(spec)
        if pattern not in self._compiled:
            self._compiled[pattern] = FakeRegex(pattern)
        return self._compiled[pattern]

    def matcher(self, spec: StructuredOutputs) -> FakeMatcher:
        return FakeMatcher(self, self.compile(spec))

    def fill_bitmasks(self, matchers: list[FakeMatcher], bitmask: np.ndarray, rows: list[int]) -> None:
        fill_each(matchers, bitmask, rows)  # type: ignore[arg-type]


def _bits(token_ids: np.ndarray, width: int) -> np.ndarray:
    """int32 (width,) bitmask row with exactly ``token_ids`` set."""
    bits = np.zeros(width * 32, dtype=np.uint8)
    bits[token_ids] = 1
    return np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)
