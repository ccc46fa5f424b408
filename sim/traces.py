"""Traces: a config plus timed input events (and, when recorded, expected decisions).

On disk a trace is JSONL (``docs/design.md``, "The simulator")::

    {"version": 1, "seed": 7, "config": {"cache": {..}, "scheduler": {..}}, "vocab_size": 97, "eos_token_id": 3}
    {"step": 0, "op": "add", "request_id": "r0", "prompt_token_ids": [..], "sampling": {..}}
    {"step": 4, "op": "abort", "request_id": "r0"}
    {"step": 4, "op": "expect", "scheduled": {"r1": 1}, "preempted": [], "finished": {}, "free_blocks": 5}

Input events of step k are applied, in file order, just before the k-th call of
``LLMEngine.step()`` (counting from 0); an expect line describes that call's
decisions. ``config`` may also hold ``"executor": {"num_blocks": N}``, the fake
executor's pool, which the engine adopts when ``cache.num_blocks`` is null.

A trace recorded from live traffic (``LLM(record_trace=PATH)``, ``sim.recorder``)
has ``"fake_model": "recorded"`` in its header: replaying it, the fake model
returns the tokens the live model sampled (the expect lines' ``finished``)
instead of its hash, so the replay does not depend on the model (``FakeExecutor``).

``generate_trace(seed)`` draws a random trace designed to reach the hard corners:
arrivals over time, shared prefixes (among live requests and across finished
ones), prompts that need chunking, pools small enough to preempt and evict,
aborts of waiting/running/finished requests, eos and stop hits, ``ignore_eos``,
``max_model_len`` hits and requests that must be rejected when added. Half the
traces run with asynchronous scheduling (one step in flight).
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, Union, get_args

from minivllm.config import POLICIES, CacheConfig, SchedulerConfig, cdiv
from minivllm.engine.llm_engine import StepRecord
from minivllm.sampling import SamplingParams

TRACE_VERSION = 1

# What the fake executor returns when a sequence samples: ``hash``, the fake model of
# docs/design.md; ``recorded``, the tokens a live run sampled (traces of real traffic).
FakeModel = Literal["hash", "recorded"]


@dataclass(frozen=True)
class AddEvent:
    """``engine.add_request(request_id, prompt_token_ids, sampling)`` before step ``step``."""

    step: int
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams

    def to_json(self) -> dict[str, Any]:
        """The JSONL line of this event."""
        return {"step": self.step, "op": "add", "request_id": self.request_id,
                "prompt_token_ids": list(self.prompt_token_ids), "sampling": _sampling_to_json(self.sampling)}


@dataclass(frozen=True)
class AbortEvent:
    """``engine.abort_request(request_id)`` before step ``step``."""

    step: int
    request_id: str

    def to_json(self) -> dict[str, Any]:
        """The JSONL line of this event."""
        return {"step": self.step, "op": "abort", "request_id": self.request_id}


@dataclass(frozen=True)
class ExpectEvent:
    """What step ``step`` decided, as recorded from ``engine.last_step``."""

    step: int
    scheduled: dict[str, int]
    preempted: tuple[str, ...]
    finished: dict[str, tuple[int, ...]]
    free_blocks: int
    # The step's token counters (``StepRecord``); None in traces recorded before they existed.
    prefill_tokens: int | None = None
    decode_tokens: int | None = None
    # The finish reason of each name in ``finished``; None in traces recorded before it existed.
    finish_reasons: dict[str, str] | None = None

    @classmethod
    def from_record(cls, step: int, rec: StepRecord) -> "ExpectEvent":
        """Step ``step``'s decisions as ``engine.last_step`` recorded them."""
        return cls(step, dict(rec.scheduled), tuple(rec.preempted),
                   {k: tuple(v) for k, v in rec.finished.items()}, rec.num_free_blocks,
                   rec.num_prefill_tokens, rec.num_decode_tokens, dict(rec.finish_reasons))

    def to_json(self) -> dict[str, Any]:
        """The JSONL line of this event."""
        d: dict[str, Any] = {
            "step": self.step, "op": "expect", "scheduled": dict(self.scheduled),
            "preempted": list(self.preempted),
            "finished": {k: list(v) for k, v in self.finished.items()},
            "free_blocks": self.free_blocks,
        }
        if self.prefill_tokens is not None:
            d["prefill_tokens"], d["decode_tokens"] = self.prefill_tokens, self.decode_tokens
        if self.finish_reasons is not None:
            d["finish_reasons"] = dict(self.finish_reasons)
        return d


InputEvent = Union[AddEvent, AbortEvent]


@dataclass(frozen=True)
class Trace:
    """A reproducible engine run: config, inputs, and optionally expected decisions.

    Attributes:
        seed: the generator seed (0 for hand-written traces).
        cache, scheduler: the engine's configs.
        executor_num_blocks: the fake executor's pool size (the engine's pool when
            ``cache.num_blocks`` is None).
        vocab_size, eos_token_id: the fake model's vocabulary and eos token(s: a list when the model has several).
        events: input events in the order they are applied (steps non-decreasing).
        expects: recorded decisions, one per step (empty for an unrecorded trace).
        description: free text saying what the trace is about (golden traces).
        fake_model: ``recorded`` for a trace of live traffic (see the module docstring).
    """

    seed: int
    cache: CacheConfig
    scheduler: SchedulerConfig
    executor_num_blocks: int
    vocab_size: int
    eos_token_id: int | list[int] | None
    events: tuple[InputEvent, ...]
    expects: tuple[ExpectEvent, ...] = ()
    description: str | None = None
    fake_model: FakeModel = "hash"

    def __post_init__(self) -> None:
        if self.fake_model not in get_args(FakeModel):
            raise ValueError(f"fake_model must be one of {get_args(FakeModel)}, got {self.fake_model!r}")
        steps = [e.step for e in self.events]
        if any(s < 0 for s in steps) or steps != sorted(steps):
            raise ValueError("trace input events must have non-negative, non-decreasing steps")
        if self.cache.num_blocks is not None and self.executor_num_blocks < self.cache.num_blocks:
            raise ValueError(
                f"executor pool ({self.executor_num_blocks}) smaller than cache.num_blocks ({self.cache.num_blocks})"
            )
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {self.vocab_size}")

    @property
    def num_blocks(self) -> int:
        """The engine's pool size."""
        return self.cache.num_blocks if self.cache.num_blocks is not None else self.executor_num_blocks

    @property
    def last_input_step(self) -> int:
        return self.events[-1].step if self.events else -1

    def header(self) -> dict[str, Any]:
        """The first JSONL line (the executor pool is written only when it is not cache.num_blocks)."""
        config: dict[str, Any] = {
            "cache": dataclasses.asdict(self.cache),
            "scheduler": dataclasses.asdict(self.scheduler),
        }
        if self.cache.num_blocks is None or self.executor_num_blocks != self.cache.num_blocks:
            config["executor"] = {"num_blocks": self.executor_num_blocks}
        head: dict[str, Any] = {
            "version": TRACE_VERSION, "seed": self.seed, "config": config,
            "vocab_size": self.vocab_size, "eos_token_id": self.eos_token_id,
        }
        if self.description is not None:
            head["description"] = self.description
        if self.fake_model != "hash":
            head["fake_model"] = self.fake_model
        return head

    def lines(self) -> list[dict[str, Any]]:
        """The JSONL lines: header, then per step its inputs followed by its expect line."""
        out = [self.header()]
        items: list[tuple[int, int, dict[str, Any]]] = []
        for e in self.events:
            items.append((e.step, 0, e.to_json()))
        for e in self.expects:
            items.append((e.step, 1, e.to_json()))
        items.sort(key=lambda t: (t[0], t[1]))  # stable: keeps input order within a step
        out.extend(d for _, _, d in items)
        return out

    def dumps(self) -> str:
        """The whole trace as JSONL text."""
        return "".join(json.dumps(d) + "\n" for d in self.lines())

    def save(self, path: str | Path) -> Path:
        """Write the trace to ``path`` (creating its folder); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.dumps(), encoding="utf-8")
        return path

    def with_expects(self, expects: Iterable[ExpectEvent]) -> "Trace":
        """The same inputs with these expected decisions."""
        return dataclasses.replace(self, expects=tuple(expects))


_DEFAULT_SAMPLING = SamplingParams().to_dict()


def _sampling_to_json(params: SamplingParams) -> dict[str, Any]:
    """Only the fields that differ from the defaults, to keep trace lines readable."""
    return {k: v for k, v in params.to_dict().items() if v != _DEFAULT_SAMPLING[k]}


def _check_keys(d: Mapping[str, Any], required: set[str], optional: set[str], where: str) -> None:
    missing = required - set(d)
    unknown = set(d) - required - optional
    if missing or unknown:
        raise ValueError(f"{where}: missing key(s) {sorted(missing)}, unknown key(s) {sorted(unknown)}")


def _parse_event(d: Mapping[str, Any], where: str) -> InputEvent | ExpectEvent:
    op = d.get("op")
    if op == "add":
        _check_keys(d, {"step", "op", "request_id", "prompt_token_ids", "sampling"}, set(), where)
        return AddEvent(int(d["step"]), str(d["request_id"]),
                        tuple(int(t) for t in d["prompt_token_ids"]),
                        SamplingParams.from_dict(d["sampling"]))
    if op == "abort":
        _check_keys(d, {"step", "op", "request_id"}, set(), where)
        return AbortEvent(int(d["step"]), str(d["request_id"]))
    if op == "expect":
        _check_keys(d, {"step", "op", "scheduled", "preempted", "finished", "free_blocks"},
                    {"prefill_tokens", "decode_tokens", "finish_reasons"}, where)
        counters = [d.get(k) for k in ("prefill_tokens", "decode_tokens")]
        if (counters[0] is None) != (counters[1] is None):
            raise ValueError(f"{where}: prefill_tokens and decode_tokens come together")
        reasons = d.get("finish_reasons")
        if reasons is not None and set(reasons) != set(d["finished"]):
            raise ValueError(f"{where}: finish_reasons must name exactly the finished sequences")
        return ExpectEvent(
            int(d["step"]), {str(k): int(v) for k, v in d["scheduled"].items()},
            tuple(str(r) for r in d["preempted"]),
            {str(k): tuple(int(t) for t in v) for k, v in d["finished"].items()},
            int(d["free_blocks"]), *(None if c is None else int(c) for c in counters),
            None if reasons is None else {str(k): str(v) for k, v in reasons.items()},
        )
    raise ValueError(f"{where}: unknown op {op!r}")


def trace_from_lines(lines: list[dict[str, Any]], source: str = "<trace>") -> Trace:
    """Build a trace from parsed JSONL lines (header first).

    Raises:
        ValueError: a wrong version, an unknown or missing key, a bad config value.
    """
    if not lines:
        raise ValueError(f"{source}: empty trace")
    head = lines[0]
    _check_keys(head, {"version", "seed", "config", "vocab_size", "eos_token_id"}, {"description", "fake_model"},
                f"{source}:1")
    if head["version"] != TRACE_VERSION:
        raise ValueError(f"{source}: trace version {head['version']!r}, this reader knows {TRACE_VERSION}")
    config = head["config"]
    _check_keys(config, {"cache", "scheduler"}, {"executor"}, f"{source}:1 config")
    cache = CacheConfig.from_dict(config["cache"])
    executor = config.get("executor", {})
    _check_keys(executor, set(), {"num_blocks"}, f"{source}:1 config.executor")
    exec_blocks = executor.get("num_blocks", cache.num_blocks)
    if exec_blocks is None:
        raise ValueError(f"{source}:1: cache.num_blocks is null and config.executor.num_blocks is missing")
    events: list[InputEvent] = []
    expects: list[ExpectEvent] = []
    for n, d in enumerate(lines[1:], start=2):
        e = _parse_event(d, f"{source}:{n}")
        (expects if isinstance(e, ExpectEvent) else events).append(e)
    return Trace(
        seed=int(head["seed"]), cache=cache, scheduler=SchedulerConfig.from_dict(config["scheduler"]),
        executor_num_blocks=int(exec_blocks), vocab_size=int(head["vocab_size"]),
        eos_token_id=head["eos_token_id"], events=tuple(events), expects=tuple(expects),
        description=head.get("description"), fake_model=head.get("fake_model", "hash"),
    )


def loads(text: str, source: str = "<trace>") -> Trace:
    """Parse a JSONL trace (blank lines are skipped)."""
    lines = []
    for n, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{source}:{n}: not JSON: {exc}") from exc
    return trace_from_lines(lines, source)


def load(path: str | Path) -> Trace:
    """Read a JSONL trace file."""
    return loads(Path(path).read_text(encoding="utf-8"), str(path))


# ---------------------------------------------------------------------------
# Random generation

_CACHE_KEYS = {f.name for f in dataclasses.fields(CacheConfig)}
_SCHED_KEYS = {f.name for f in dataclasses.fields(SchedulerConfig)}
_TOP_KEYS = {"vocab_size", "eos_token_id", "executor_num_blocks"}
OVERRIDE_KEYS: frozenset[str] = frozenset(_CACHE_KEYS | _SCHED_KEYS | _TOP_KEYS)


def flatten_overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Accept flat keys or nested ``{"cache": {..}, "scheduler": {..}}``; reject unknown keys."""
    flat: dict[str, Any] = {}
    for key, value in overrides.items():
        if key in ("cache", "scheduler") and isinstance(value, Mapping):
            allowed = _CACHE_KEYS if key == "cache" else _SCHED_KEYS
            bad = sorted(set(value) - allowed)
            if bad:
                raise ValueError(f"unknown {key} key(s) {bad}; valid: {sorted(allowed)}")
            flat.update(value)
        elif key in OVERRIDE_KEYS:
            flat[key] = value
        else:
            raise ValueError(f"unknown config key {key!r}; valid: {sorted(OVERRIDE_KEYS)}")
    return flat


@dataclass
class _Draw:
    """Mutable scratch state while drawing one trace."""

    rng: random.Random
    vocab_size: int
    block_size: int
    max_model_len: int
    num_blocks: int
    # Prompt tokens come from [0, alphabet): a tiny alphabet repeats equal blocks at
    # different positions, which only the *chained* block hash tells apart.
    alphabet: int = 0
    # Its own stream for the sampling features (n, logprobs), so adding them kept every
    # seed's requests as they were.
    features: random.Random = field(default_factory=random.Random)
    # And one for the output kind (drawn later still), and one for grammars (later again).
    output_kinds: random.Random = field(default_factory=random.Random)
    grammars: random.Random = field(default_factory=random.Random)
    events: list[InputEvent] = field(default_factory=list)
    valid: list[AddEvent] = field(default_factory=list)

    @property
    def cap(self) -> int:
        """Most total tokens (prompt + max_tokens) a request may have and surely be accepted."""
        return min(self.max_model_len, self.num_blocks * self.block_size)

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.alphabet or self.vocab_size) for _ in range(n)]


def _draw_config(rng: random.Random, ov: Mapping[str, Any]) -> dict[str, Any]:
    """Draw every config value, then apply overrides and the chunked-prefill rule."""
    c: dict[str, Any] = {}
    # 64: the engine's CUDA default, where short sequences never fill a block.
    c["block_size"] = ov.get("block_size", rng.choice([1, 2, 4, 8, 16, 64]))
    c["vocab_size"] = rng.choice([rng.randint(50, 120), rng.randint(50, 500)])
    c["eos_token_id"] = None if rng.random() < 0.1 else rng.randrange(c["vocab_size"])
    # Long contexts in 1-token blocks make huge pools, which slow every step's checks.
    c["max_model_len"] = rng.choice([rng.randint(8, 40), rng.randint(8, 40),
                                     rng.randint(40, 64 if c["block_size"] == 1 else 160)])
    c["chunked_prefill"] = rng.random() < 0.6
    c["policy"] = rng.choice(POLICIES)
    c["enable_prefix_caching"] = rng.random() < 0.65
    # Serial (1 seat) and tiny-budget traces take many steps each: keep them a minority.
    u = rng.random()
    c["max_num_seqs"] = 1 if u < 0.08 else rng.randint(2, 4) if u < 0.35 else rng.randint(4, 32)
    u = rng.random()
    c["max_num_batched_tokens"] = (rng.randint(1, 8) if u < 0.15 else rng.randint(8, 48) if u < 0.5
                                   else rng.randint(48, 512))
    c.update({k: v for k, v in ov.items() if k in ("block_size", "max_model_len", "chunked_prefill")})
    if not c["chunked_prefill"] and c["max_num_batched_tokens"] < c["max_model_len"]:
        c["max_num_batched_tokens"] = c["max_model_len"] + rng.choice([0, rng.randint(0, 64)])
    if "max_num_batched_tokens" in ov:
        c["max_num_batched_tokens"] = ov["max_num_batched_tokens"]
        if c["max_num_batched_tokens"] < 2 and "chunked_prefill" not in ov:
            c["chunked_prefill"] = True  # max_model_len >= 2 cannot fit a 1-token budget whole
        if not c["chunked_prefill"] and "max_model_len" not in ov:
            c["max_model_len"] = max(2, min(c["max_model_len"], c["max_num_batched_tokens"]))
    seq_blocks = cdiv(c["max_model_len"], c["block_size"])
    kind = rng.random()
    if kind < 0.3:  # tiny: preemption and eviction; some requests cannot fit at all
        nb = rng.randint(max(1, seq_blocks // 2), seq_blocks + 2)
    elif kind < 0.65:
        nb = rng.randint(seq_blocks, 3 * seq_blocks)
    else:
        nb = min(rng.randint(3 * seq_blocks, 8 * seq_blocks), max(3 * seq_blocks, 256))
    c["executor_num_blocks"] = ov.get("executor_num_blocks", ov.get("num_blocks") or nb)
    c["num_blocks"] = None if rng.random() < 0.1 else c["executor_num_blocks"]
    c.update(ov)
    return c


def generate_trace(seed: int, overrides: Mapping[str, Any] | None = None) -> Trace:
    """Draw a random trace (config and events) from ``seed``.

    Args:
        seed: any int; the same seed and overrides give the same trace.
        overrides: config values to force (flat keys of CacheConfig,
            SchedulerConfig, or ``vocab_size``/``eos_token_id``/``executor_num_blocks``).

    Raises:
        ValueError: an unknown override key, or overrides that make an invalid config.
    """
    ov = flatten_overrides(overrides or {})
    rng = random.Random(seed)
    c = _draw_config(rng, ov)
    # Its own stream, so a seed draws the same requests in either mode.
    c.setdefault("async_scheduling", random.Random(f"async-{seed}").random() < 0.5)
    cache = CacheConfig.from_dict({k: c[k] for k in _CACHE_KEYS if k in c})  # the rest: defaults
    sched = SchedulerConfig.from_dict({k: c[k] for k in _SCHED_KEYS})
    num_blocks = cache.num_blocks if cache.num_blocks is not None else c["executor_num_blocks"]
    d = _Draw(rng, c["vocab_size"], cache.block_size, sched.max_model_len, num_blocks,
              features=random.Random(f"features-{seed}"), output_kinds=random.Random(f"output-kinds-{seed}"),
              grammars=random.Random(f"grammars-{seed}"))
    if rng.random() < 0.15:
        d.alphabet = rng.randint(1, 3)
    if d.cap >= 2:
        _draw_requests(d, c["eos_token_id"])
    _draw_impossible(d)
    _draw_aborts(d)
    events = sorted(enumerate(d.events), key=lambda t: (t[1].step, t[0]))
    return Trace(
        seed=seed, cache=cache, scheduler=sched, executor_num_blocks=c["executor_num_blocks"],
        vocab_size=c["vocab_size"], eos_token_id=c["eos_token_id"], events=tuple(e for _, e in events),
    )


def _draw_prefixes(d: _Draw) -> list[list[int]]:
    """Shared prefixes: mostly whole blocks, sometimes a partial block on top."""
    rng, bs = d.rng, d.block_size
    prefixes = []
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        n = rng.randint(1, 3) * bs + rng.choice([0, 0, rng.randrange(bs)])
        n = min(n, d.cap - 1)
        if n >= 1:
            prefixes.append(d.tokens(n))
    return prefixes


def _draw_requests(d: _Draw, eos_token_id: int | None) -> None:
    rng = d.rng
    prefixes = _draw_prefixes(d)
    horizon = rng.choice([0, 4, 12, 30])
    for i in range(rng.choice([rng.randint(1, 8), rng.randint(5, 25)])):
        if prefixes and rng.random() < 0.6:
            prefix = rng.choice(prefixes)
            suffix = 0 if rng.random() < 0.2 else rng.randint(1, 12)
            prompt = (prefix + d.tokens(suffix))[: d.cap - 1]
        elif rng.random() < 0.15:  # long: needs chunking under small budgets
            prompt = d.tokens(rng.randint(1, d.cap - 1))
        else:
            prompt = d.tokens(rng.randint(1, min(24, d.cap - 1)))
        room = d.cap - len(prompt)
        if room <= 40 and rng.random() < 0.1:
            max_tokens = room  # exactly max_model_len, or exactly the whole pool
        else:
            max_tokens = rng.randint(1, min(room, rng.choice([4, 8, 16, 32])))
        stop = ()
        if rng.random() < 0.25:
            stop = tuple(rng.randrange(d.vocab_size) for _ in range(rng.randint(1, 3)))
        ignore_eos = rng.random() < 0.2
        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=stop,
            **_draw_stop_strings(rng), **_draw_features(d.features),
            # A quarter report only when they end, as offline generate() asks.
            output_kind="final_only" if d.output_kinds.random() < 0.25 else "delta",
            structured_outputs=_draw_grammar(d.grammars) if eos_token_id is not None and not ignore_eos else None,
        )
        step = 0 if rng.random() < 0.4 else rng.randint(0, horizon)
        add = AddEvent(step, f"r{i}", tuple(prompt), params)
        d.events.append(add)
        d.valid.append(add)


def _draw_features(rng: random.Random) -> dict[str, Any]:
    """Parallel samples for a sixth of the requests (n = 2..4, which schedule more
    sequences), logprobs and prompt logprobs for a tenth each (the fake model's, checked
    against the oracle's through preemption, chunking and async steps)."""
    f: dict[str, Any] = {}
    if rng.random() < 1 / 6:
        f["n"] = rng.randint(2, 4)
    if rng.random() < 0.1:
        f["logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.1:
        f["prompt_logprobs"] = rng.randint(0, 2)
    return f


def _draw_grammar(rng: random.Random) -> dict[str, Any] | None:
    """A grammar for a quarter of the requests that can have one (an eos to end it, eos not
    ignored): a choice of 1-4 words or a small regex over the fake letters (``sim.grammar``),
    some finite (they end with eos), some not (they end at max_tokens)."""
    if rng.random() >= 0.25:
        return None
    letters = "abcdefghij"
    if rng.random() < 0.4:
        return {"choice": ["".join(rng.choice(letters) for _ in range(rng.randint(1, 5)))
                           for _ in range(rng.randint(1, 4))]}

    def atom() -> str:
        u = rng.random()
        if u < 0.5:
            return rng.choice(letters)
        if u < 0.7:
            lo = rng.randrange(len(letters))
            return f"[{letters[lo]}-{letters[min(len(letters) - 1, lo + rng.randint(0, 4))]}]"
        if u < 0.8:
            return "."
        return "(" + "|".join(rng.choice(letters) * rng.randint(1, 2) for _ in range(rng.randint(2, 3))) + ")"

    def sequence() -> str:
        return "".join(atom() + rng.choice(["", "", "", "?", "*", "+"]) for _ in range(rng.randint(1, 4)))
    return {"regex": "|".join(sequence() for _ in range(rng.choice([1, 1, 2])))}


def _draw_stop_strings(rng: random.Random) -> dict[str, Any]:
    """Stop strings over the fake tokenizer's alphabet (sim.oracle.FAKE_ALPHABET) for a fifth
    of the requests: 1-3 characters, so some end a request and some never occur."""
    if rng.random() >= 0.2:
        return {}
    strings = tuple("".join(rng.choice("abcdefghij") for _ in range(rng.randint(1, 3)))
                    for _ in range(rng.randint(1, 2)))
    return {"stop": strings, "include_stop_str_in_output": rng.random() < 0.3}


def _draw_impossible(d: _Draw) -> None:
    """A few requests the engine must reject at ``add_request`` (ValueError, nothing enqueued)."""
    rng = d.rng
    if rng.random() >= 0.35:
        return
    L, pool = d.max_model_len, d.num_blocks * d.block_size
    for j in range(rng.randint(1, 3)):
        kinds = ["empty", "too_long"] + (["pool"] * 2 if pool + 2 <= L else []) + (["duplicate"] if d.valid else [])
        kind = rng.choice(kinds)
        step = rng.randint(0, 10)
        rid = f"x{j}"
        if kind == "empty":
            prompt, max_tokens = [], 1
        elif kind == "too_long":
            prompt = d.tokens(rng.randint(1, L))
            max_tokens = L - len(prompt) + rng.randint(1, 4)
        elif kind == "pool":  # needs more blocks than the pool holds, even without its last token
            # Mostly exactly one block too many (pool + 1 computed tokens): an admission
            # check that is one block too loose is caught only at this boundary.
            total = pool + 2 if rng.random() < 0.75 else rng.randint(pool + 2, L)
            prompt = d.tokens(rng.randint(1, total - 1))
            max_tokens = total - len(prompt)
        else:  # the same id as a request added in the same step, which is still waiting
            original = rng.choice(d.valid)
            step, rid = original.step, original.request_id
            prompt, max_tokens = d.tokens(rng.randint(1, 3)), 1
        d.events.append(AddEvent(step, rid, tuple(prompt), SamplingParams(temperature=0.0, max_tokens=max_tokens)))


def _draw_aborts(d: _Draw) -> None:
    """Aborts of waiting, running and finished requests, repeats, and of unknown ids."""
    rng = d.rng
    if not d.valid or rng.random() >= 0.35:
        return
    for _ in range(rng.randint(1, 3)):
        target = rng.choice(d.valid)
        step = target.step + rng.choice([0, rng.randint(0, 3), rng.randint(0, 30)])
        d.events.append(AbortEvent(step, target.request_id))
        if rng.random() < 0.1:
            d.events.append(AbortEvent(step + rng.randint(0, 3), target.request_id))
    if rng.random() < 0.1:
        d.events.append(AbortEvent(rng.randint(0, 10), "never-added"))
