"""What a request asks of the sampler.

``SamplingParams`` is plain validated data and never imports torch, so the
engine can carry it. The torch implementation lives in
``minivllm/sampler/sampler.py``.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

# As in vLLM, a temperature this small is greedy: dividing logits by it could
# overflow float32 to inf (and inf - inf is nan).
GREEDY_TEMPERATURE = 1e-5


# Most top log-probabilities a request may ask for per position (vLLM's default max_logprobs).
MAX_LOGPROBS = 20
# Most completions per request (OpenAI's limit for ``n``).
MAX_N = 128
MAX_INT32 = 2**31 - 1


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def eos_token_set(eos_token_id: int | Sequence[int] | None) -> frozenset[int]:
    """The model's end-of-sequence ids as a set: one id, several (Llama-3.x checkpoints list
    ``[128001, 128008, 128009]``: a request stops at any of them), or none.

    Raises:
        TypeError: an id that is not an int.
    """
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, frozenset):
        return eos_token_id  # already a set of ids
    ids = [eos_token_id] if _is_int(eos_token_id) else list(eos_token_id)  # type: ignore[arg-type]
    bad = [i for i in ids if not _is_int(i)]
    if bad:
        raise TypeError(f"eos_token_id must be an int or a list of ints, got {eos_token_id!r}")
    return frozenset(int(i) for i in ids)


def is_greedy_temperature(temperature: float | np.ndarray) -> bool | np.ndarray:
    """The one rule for "greedy" (``SamplingParams.greedy`` and the sampler's batched numpy use it)."""
    return temperature < GREEDY_TEMPERATURE


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on what a request may generate (vLLM's ``StructuredOutputsParams``).

    Exactly one of the fields is set. The grammar is compiled by ``xgrammar`` against
    the tokenizer's vocabulary (``minivllm/structured.py``); the engine masks every
    sampled position to the tokens the grammar allows, and allows eos only where the
    grammar may end.

    Attributes:
        json: a JSON schema, as a dict or a JSON string (kept as canonical JSON text,
            so the params stay hashable).
        json_object: any JSON object (OpenAI's ``response_format: json_object``).
        regex: the output matches this regular expression.
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar (xgrammar's dialect, GBNF-style, with a ``root`` rule).
        disable_any_whitespace: JSON without whitespace between its tokens (vLLM's option;
            by default any whitespace is allowed there, which a weak model can fill forever).
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            # Keys in the order given: a schema's property order is its output's order.
            object.__setattr__(self, "json", json.dumps(self.json))  # input type only
        elif self.json is not None:
            if not isinstance(self.json, str):
                raise ValueError(f"structured_outputs.json must be a JSON schema (dict or str), got {self.json!r}")
            try:
                schema = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema object")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {v!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or not all(
                    isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                                 f"got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))  # input type only
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"structured_outputs.disable_any_whitespace must be a bool, "
                             f"got {self.disable_any_whitespace!r}")
        set_ = [name for name in _KINDS if getattr(self, name) not in (None, False)]
        if len(set_) != 1:
            raise ValueError("structured_outputs needs exactly one of json, json_object, regex, choice, "
                             f"grammar; got {set_ or 'none'}")

    @property
    def kind(self) -> str:
        """The field that is set: ``json``, ``json_object``, ``regex``, ``choice`` or ``grammar``."""
        return next(name for name in _KINDS if getattr(self, name) not in (None, False))

    def to_dict(self) -> dict[str, Any]:
        d = {self.kind: list(self.choice) if self.choice is not None else getattr(self, self.kind)}
        return {**d, "disable_any_whitespace": True} if self.disable_any_whitespace else d


_KINDS = ("json", "json_object", "regex", "choice", "grammar")  # StructuredOutputs: exactly one is set


class RequestOutputKind(enum.Enum):
    """When ``LLMEngine.step()`` reports a request (vLLM's ``RequestOutputKind``).

    Every output carries both the tokens so far (``token_ids``) and those new
    since the last one (``new_token_ids``), so vLLM's CUMULATIVE and DELTA are
    one kind here.
    """

    DELTA = "delta"            # every step that gives it a token, and when it ends
    FINAL_ONLY = "final_only"  # once, when it ends: what offline ``generate()`` asks for


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (validated; bad values raise ``ValueError``).

    Attributes:
        temperature: below ``GREEDY_TEMPERATURE`` (0 included) means greedy;
            otherwise logits are divided by it.
        top_k: keep the k most likely tokens; -1 or 0 disables.
        top_p: keep the smallest set whose probability reaches top_p; 1 disables.
        min_p: drop tokens whose probability is below min_p * max probability.
        max_tokens: most completion tokens.
        ignore_eos: keep generating past the eos token.
        stop_token_ids: extra tokens that end the request (included in the output); a
            list or tuple, kept as a tuple.
        seed: per-request generator seed; same seed -> same tokens in any batch.
        stop: strings that end the request when the completion's text contains one
            (checked after each token, on the text so far); the text is cut before
            it unless ``include_stop_str_in_output``. The token that completed it
            stays in ``token_ids``. Needs an engine with a tokenizer.
        include_stop_str_in_output: keep the stop string at the end of the text.
        n: completions of the prompt, 1..MAX_N (parallel samples, each its own sequence; the
            prompt is computed once and the others read its blocks from the prefix
            cache). With a ``seed``, sample i uses ``seed + i``.
        logprobs: with N (0..MAX_LOGPROBS), each completion token reports its own
            log-probability and the N most likely tokens' (N = 0: its own only),
            from the raw logits (before penalties, temperature and filters, as vLLM's
            default ``raw_logprobs``).
        prompt_logprobs: the same for every prompt token after the first (the first
            has none). A request asking for them reads nothing from the prefix cache:
            every prompt position must be computed.
        logit_bias: ``{token id: bias}`` added to the token's logit before sampling (-100 bans
            it, 100 all but forces it), as OpenAI's field; logprobs stay the raw ones.
        allowed_token_ids: only these tokens may be sampled (vLLM's); None: any.
        min_tokens: nothing stops the completion before it has this many tokens (vLLM's):
            eos and ``stop_token_ids`` are not sampled until then (a grammar that can only
            end still ends), and a stop string ending in its first ``min_tokens`` tokens'
            text does not count. 0..max_tokens.
        bad_words: words never generated (vLLM's): the engine tokenizes each, with and
            without a leading space, into ``bad_words_token_ids``.
        bad_words_token_ids: the token sequences never generated: a sequence's last token is
            not sampled where the completion so far ends with the rest of it (a one-token
            sequence: never). Filled from ``bad_words``; may be given directly, as token ids.
        skip_special_tokens: leave special tokens (eos, ``<|im_end|>``) out of the text (the
            token ids keep them); stop strings are matched on that text.
        presence_penalty: subtracted from the logit of every token that occurs in the
            completion so far; in [-2, 2].
        frequency_penalty: subtracted once per occurrence in the completion so far;
            in [-2, 2].
        repetition_penalty: tokens of the prompt or the completion so far have a
            positive logit divided by it and a negative one multiplied by it; > 0,
            1 disables. Penalties apply before temperature and filters, to greedy
            rows too.
        output_kind: a ``RequestOutputKind`` or its value: ``"delta"`` (streamed every
            step, the default) or ``"final_only"`` (one output at the end; the engine
            skips building the others, which matters at a few hundred requests a step).
        structured_outputs: a ``StructuredOutputs`` (or its dict form) constraining the
            completion to a grammar; needs an engine with a grammar backend and an eos
            token, and excludes ``ignore_eos``.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    min_tokens: int = 0
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    output_kind: RequestOutputKind = RequestOutputKind.DELTA
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not -1 <= self.top_k <= MAX_INT32:
            raise ValueError(f"top_k must be -1, 0 (disabled) or in [1, 2**31 - 1], got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0 < p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        m = self.min_p
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not (0 <= m <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {m!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        stop = self.stop_token_ids
        if not isinstance(stop, (tuple, list)) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in stop
        ):
            raise ValueError(f"stop_token_ids must be a list or tuple of ints >= 0, got {stop!r}")
        if isinstance(stop, list):
            # vLLM users pass a list; kept as a tuple so the frozen params stay immutable
            # and hashable. Normalising the input's type here is the only write after init.
            object.__setattr__(self, "stop_token_ids", tuple(stop))
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        stop_str = (self.stop,) if isinstance(self.stop, str) else self.stop  # vLLM accepts one string
        if not isinstance(stop_str, (tuple, list)) or not all(isinstance(x, str) and x for x in stop_str):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(stop_str))  # input type only, as for stop_token_ids
        bias = self.logit_bias
        items = bias.items() if isinstance(bias, Mapping) else bias
        try:
            pairs = tuple(sorted((t, float(b)) for t, b in items))
        except (TypeError, ValueError):
            pairs = None
        if pairs is None or not all(_is_int(t) and t >= 0 and _is_number(b) and -100 <= b <= 100 for t, b in pairs):
            raise ValueError(f"logit_bias must map token ids >= 0 to numbers in [-100, 100], got {bias!r}")
        if len({t for t, _ in pairs}) != len(pairs):
            raise ValueError(f"logit_bias names a token twice: {bias!r}")
        object.__setattr__(self, "logit_bias", pairs)  # input type only: a dict becomes sorted pairs
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not isinstance(allowed, (tuple, list)) or not allowed or not all(
                    _is_int(t) and t >= 0 for t in allowed):
                raise ValueError(f"allowed_token_ids must be None or a non-empty list of ints >= 0, got {allowed!r}")
            object.__setattr__(self, "allowed_token_ids", tuple(sorted(set(allowed))))
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an int in [0, max_tokens ({self.max_tokens})], "
                             f"got {self.min_tokens!r}")
        words = (self.bad_words,) if isinstance(self.bad_words, str) else self.bad_words
        if not isinstance(words, (tuple, list)) or not all(isinstance(w, str) and w.strip() for w in words):
            raise ValueError(f"bad_words must be a string or a list of non-blank strings, got {self.bad_words!r}")
        object.__setattr__(self, "bad_words", tuple(words))  # input type only
        ids = self.bad_words_token_ids
        if not isinstance(ids, (tuple, list)) or not all(
                isinstance(w, (tuple, list)) and w and all(_is_int(t) and t >= 0 for t in w) for w in ids):
            raise ValueError(f"bad_words_token_ids must be a list of non-empty lists of token ids >= 0, got {ids!r}")
        object.__setattr__(self, "bad_words_token_ids", tuple(tuple(w) for w in ids))  # input type only
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens must be a bool, got {self.skip_special_tokens!r}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(f"include_stop_str_in_output must be a bool, got {self.include_stop_str_in_output!r}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an int in [1, {MAX_N}], got {self.n!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {v!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if not _is_number(r) or not math.isfinite(r) or r <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {r!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            kinds = [k.value for k in RequestOutputKind]
            if self.output_kind not in kinds:
                raise ValueError(f"output_kind must be a RequestOutputKind or one of {kinds}, "
                                 f"got {self.output_kind!r}")
            object.__setattr__(self, "output_kind", RequestOutputKind(self.output_kind))  # input type only
        so = self.structured_outputs
        if isinstance(so, Mapping):
            unknown = sorted(set(so) - {f.name for f in dataclasses.fields(StructuredOutputs)})
            if unknown:
                raise ValueError(f"unknown structured_outputs key(s): {unknown}")
            object.__setattr__(self, "structured_outputs", StructuredOutputs(**so))  # input type only
        elif so is not None and not isinstance(so, StructuredOutputs):
            raise ValueError(f"structured_outputs must be a StructuredOutputs, a dict or None, got {so!r}")
        if self.structured_outputs is not None and self.ignore_eos:
            raise ValueError("structured_outputs and ignore_eos cannot be combined: the grammar ends "
                             "the completion with eos")
        # Whether the row's logits change before sampling (logit_bias, allowed_token_ids): kept,
        # not a property, so that the executor's per-step pass reads it in C (attrgetter).
        object.__setattr__(self, "shapes_logits", bool(self.logit_bias) or self.allowed_token_ids is not None)
        # Whether a row may sample under token rules (min_tokens, bad words): its token bitmask.
        object.__setattr__(self, "has_token_rules", self.min_tokens > 0 or bool(self.bad_words_token_ids))

    @property
    def has_penalties(self) -> bool:
        """Whether sampling needs the sequence's token history."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        """Whether this request takes the argmax (``is_greedy_temperature``)."""
        return bool(is_greedy_temperature(self.temperature))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["stop"] = list(self.stop)
        d["logit_bias"] = [list(pair) for pair in self.logit_bias]
        d["allowed_token_ids"] = None if self.allowed_token_ids is None else list(self.allowed_token_ids)
        d["bad_words"] = list(self.bad_words)
        d["bad_words_token_ids"] = [list(w) for w in self.bad_words_token_ids]
        d["output_kind"] = self.output_kind.value
        d["structured_outputs"] = (self.structured_outputs.to_dict()
                                   if self.structured_outputs is not None else None)
        return d

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "SamplingParams":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"unknown SamplingParams key(s): {unknown}")
        return cls(**values)


def tokenize_bad_words(words: Sequence[str], encode: Any) -> tuple[tuple[int, ...], ...]:
    """``bad_words`` as token sequences, as vLLM's ``SamplingParams.update_from_tokenizer``:
    each word as written (leading spaces stripped) and with one leading space, the latter
    kept only where it is another sequence of the same length (a word that tokenizes apart
    from the text before it, and one that does not). ``encode(text)`` -> token ids, without
    special tokens.

    Raises:
        ValueError: a word that encodes to no token.
    """
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(encode(word.lstrip()))
        if not bare:
            raise ValueError(f"bad_words: {word!r} encodes to no token")
        out.append(bare)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return tuple(dict.fromkeys(out))
