"""Random traces for the simulator; the format itself is ``minivllm.engine.trace``.

``generate_trace(seed)`` draws a random trace designed to reach the hard corners:
arrivals over time, shared prefixes (among live requests and across finished
ones), prompts that need chunking, pools small enough to preempt and evict,
aborts of waiting/running/finished requests, eos and stop hits, ``ignore_eos``,
``max_model_len`` hits, grammars, token rules (``min_tokens``, bad words), and
requests that must be rejected when added. Half the traces run with asynchronous
scheduling (one step in flight).

The format's names (events, ``Trace``, ``load``/``loads``) are re-exported here, so
the simulator's modules take everything about traces from one place.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from minivllm.config import POLICIES, CacheConfig, SchedulerConfig, cdiv
from minivllm.engine.trace import AbortEvent, AddEvent, ExpectEvent, InputEvent, Trace, load, loads
from minivllm.sampling import SamplingParams
from sim.fake_executor import fake_masked_next_token
from sim.oracle import fake_text

__all__ = ["AbortEvent", "AddEvent", "ExpectEvent", "InputEvent", "OVERRIDE_KEYS", "Trace",
           "flatten_overrides", "generate_trace", "load", "loads"]

_CACHE_KEYS = {f.name for f in dataclasses.fields(CacheConfig)}
_SCHED_KEYS = {f.name for f in dataclasses.fields(SchedulerConfig)}
_TOP_KEYS = {"vocab_size", "eos_token_id", "executor_num_blocks", "speculative", "hybrid"}
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
    # And one for the output kind (drawn later still), one for grammars (later again), and
    # one for token rules (later again).
    output_kinds: random.Random = field(default_factory=random.Random)
    grammars: random.Random = field(default_factory=random.Random)
    rules: random.Random = field(default_factory=random.Random)
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
    # Hybrid models' snapshots at every 1st..4th block boundary (and a prompt's last full block).
    c.setdefault("state_snapshot_interval", random.Random(f"interval-{seed}").choice([1, 1, 2, 3, 4]))
    cache = CacheConfig.from_dict({k: c[k] for k in _CACHE_KEYS if k in c})  # the rest: defaults
    sched = SchedulerConfig.from_dict({k: c[k] for k in _SCHED_KEYS})
    num_blocks = cache.num_blocks if cache.num_blocks is not None else c["executor_num_blocks"]
    d = _Draw(rng, c["vocab_size"], cache.block_size, sched.max_model_len, num_blocks,
              features=random.Random(f"features-{seed}"), output_kinds=random.Random(f"output-kinds-{seed}"),
              grammars=random.Random(f"grammars-{seed}"), rules=random.Random(f"rules-{seed}"))
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
        speculative=_draw_speculative(random.Random(f"speculative-{seed}"), ov),
        **_draw_state(random.Random(f"state-{seed}"), ov, sched.max_num_seqs),
    )


def _draw_state(rng: random.Random, ov: Mapping[str, Any], max_num_seqs: int) -> dict[str, int]:
    """A hybrid model (recurrent state beside the KV cache) for a quarter of the traces, or
    for every one with the override ``hybrid: true`` (its own stream: every other draw is as it
    was): state slots from 1 (admission waits for a slot) to more than seats, snapshots from
    none (hits never resume) to plenty (eviction binds them to blocks)."""
    hybrid = ov.get("hybrid")
    if hybrid is False or hybrid is None and rng.random() >= 0.25:
        return {}
    u = rng.random()
    slots = rng.randint(1, max_num_seqs) if u < 0.3 else max_num_seqs + rng.randint(0, 2)
    snapshots = rng.choice([0, rng.randint(1, 4), rng.randint(4, 48), rng.randint(4, 48)])
    return {"executor_state_slots": slots, "executor_state_snapshots": snapshots}


def _draw_speculative(rng: random.Random, ov: Mapping[str, Any]) -> dict[str, Any] | None:
    """Speculative decoding for 40% of the traces (its own stream: every other draw is as it
    was): mostly the fake proposer (k 1..8, hit rates 0..1; 40% of them standing for a draft
    model, drafting on the device), else n-gram lookup, which the traces' tiny alphabets and
    shared prefixes feed."""
    if "speculative" in ov:
        return ov["speculative"]
    if rng.random() >= 0.4:
        return None
    if rng.random() < 0.75:
        spec = {"method": "fake", "num_speculative_tokens": rng.randint(1, 8),
                "hit_rate": rng.choice([0.0, 0.3, 0.6, 0.8, 0.9, 1.0])}
        return {**spec, "on_device": True} if rng.random() < 0.4 else spec
    lo = rng.randint(1, 3)
    return {"method": "ngram", "num_speculative_tokens": rng.randint(1, 5), "prompt_lookup_min": lo,
            "prompt_lookup_max": lo + rng.randint(0, 2)}


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
        rules = _draw_token_rules(d, prompt, max_tokens, stop, eos_token_id)
        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos,
            **{"stop_token_ids": stop, **_draw_stop_strings(rng), **_draw_features(d.features), **rules},
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


def _draw_token_rules(d: _Draw, prompt: list[int], max_tokens: int, stop: tuple[int, ...],
                      eos_token_id: int | None) -> dict[str, Any]:
    """Token rules (``engine/token_rules.py``) for an eighth of the requests, drawn to bite:
    from the first few tokens the fake model would pick under a mask (``chain``),

    - ``min_tokens`` (half of them), with one of the chain's tokens before it made a stop
      token half the times, so that the ban changes the completion, and a stop string the
      chain writes before it a third of the others, which must not end the completion;
    - ``bad_words_token_ids`` (the other half, some with ``min_tokens`` too): mostly runs of
      1-3 chain tokens, whose first occurrence the ban then breaks; near misses (a chain
      token after a prefix it does not follow there, which must not be banned); some random.
    """
    rng = d.rules
    u = rng.random()
    if u >= 0.125:
        return {}
    banned = set(stop) | ({eos_token_id} if eos_token_id is not None else set())
    allowed = np.array([t for t in range(d.vocab_size) if t not in banned])
    chain, context = [], list(prompt)
    for _ in range(min(max_tokens, 4)):
        chain.append(fake_masked_next_token(context, allowed, d.vocab_size))
        context.append(chain[-1])
    f: dict[str, Any] = {}
    if u < 0.0625 or rng.random() < 0.3:
        f["min_tokens"] = rng.randint(1, max_tokens)
        v = rng.random()
        if v < 0.5:
            # before min_tokens, or (half the times, where the chain reaches it) the first
            # token it allows a stop at: both sides of the edge
            m = f["min_tokens"]
            pick = chain[m] if m < len(chain) and rng.random() < 0.5 else rng.choice(chain[:m])
            f["stop_token_ids"] = tuple(dict.fromkeys(stop + (pick,)))
        elif v < 0.8:  # a stop string the first min_tokens tokens write, which must not count
            end = rng.randrange(min(f["min_tokens"], len(chain)))
            f["stop"] = (fake_text(chain[max(0, end - rng.randint(0, 1)):end + 1]),)
    if u >= 0.0625:
        words = []
        for _ in range(rng.randint(1, 3)):
            u = rng.random()
            if u < 0.6:
                end = rng.randrange(len(chain))
                words.append(tuple(chain[max(0, end - rng.randint(0, 2)):end + 1]))
            elif u < 0.85:  # a near miss: a chain token after another prefix, never banned there
                end = rng.randrange(len(chain))
                other = [t for t in range(d.vocab_size) if end == 0 or t != chain[end - 1]]
                words.append((rng.choice(other), chain[end]))
            else:
                words.append(tuple(rng.randrange(d.vocab_size) for _ in range(rng.randint(1, 3))))
        f["bad_words_token_ids"] = tuple(dict.fromkeys(words))
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
