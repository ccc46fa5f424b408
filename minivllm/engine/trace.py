"""The trace format: a config plus timed input events (and, when recorded, expected decisions).

On disk a trace is JSONL (``docs/design.md``, "The simulator")::

    {"version": 1, "seed": 7, "config": {"cache": {..}, "scheduler": {..}}, "vocab_size": 97, "eos_token_id": 3}
    {"step": 0, "op": "add", "request_id": "r0", "prompt_token_ids": [..], "sampling": {..}}
    {"step": 4, "op": "abort", "request_id": "r0"}
    {"step": 4, "op": "expect", "scheduled": {"r1": 1}, "preempted": [], "finished": {}, "free_blocks": 5}

Input events of step k are applied, in file order, just before the k-th call of
``LLMEngine.step()`` (counting from 0); an expect line describes that call's
decisions. ``config`` may also hold ``"executor": {"num_blocks": N}``, the fake
executor's pool, which the engine adopts when ``cache.num_blocks`` is null, and for a
hybrid model ``"state_slots"`` and ``"state_snapshots"``, its recurrent states.

The format belongs to the engine, not to the simulator: ``TraceRecorder`` (an
``EngineObserver``, ``minivllm.engine.observer``) writes live traffic in it, and the
simulator (``sim/``) generates, runs and replays traces in it. A trace recorded from
live traffic has ``"fake_model": "recorded"`` in its header: replaying it, the fake
model returns the tokens the live model sampled (the expect lines' ``finished``)
instead of its hash, so the replay does not depend on the model.

The recorder writes only what the engine decided: each finished sequence's tokens and
finish reason. Whatever a replay on a fake tokenizer needs beyond that (e.g. which
stop string ended a completion, in the fake text) the replay derives from these facts
(``sim.runner.replay_inputs``); nothing here knows the fake model.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Iterable, Literal, Mapping, Sequence, Union, get_args

from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.sampling import SamplingParams

if TYPE_CHECKING:
    from minivllm.engine.llm_engine import LLMEngine, StepRecord

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
        speculative: the proposer's config (``config.speculative`` in the file), or None:
            a ``SpeculativeConfig`` as a dict, or one the simulator reads itself
            (``sim.fake_proposer``).
        executor_state_slots, executor_state_snapshots: a hybrid model's recurrent states
            (``Executor.state_pool``; ``config.executor`` in the file): 0 slots for a model
            without state.
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
    speculative: Mapping[str, Any] | None = None
    executor_state_slots: int = 0
    executor_state_snapshots: int = 0

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
        executor: dict[str, int] = {}
        if self.cache.num_blocks is None or self.executor_num_blocks != self.cache.num_blocks:
            executor["num_blocks"] = self.executor_num_blocks
        if self.executor_state_slots:
            executor.update(state_slots=self.executor_state_slots, state_snapshots=self.executor_state_snapshots)
        if executor:
            config["executor"] = executor
        if self.speculative is not None:
            config["speculative"] = dict(self.speculative)
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
    _check_keys(config, {"cache", "scheduler"}, {"executor", "speculative"}, f"{source}:1 config")
    cache = CacheConfig.from_dict(config["cache"])
    executor = config.get("executor", {})
    _check_keys(executor, set(), {"num_blocks", "state_slots", "state_snapshots"}, f"{source}:1 config.executor")
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
        speculative=config.get("speculative"), executor_state_slots=int(executor.get("state_slots", 0)),
        executor_state_snapshots=int(executor.get("state_snapshots", 0)),
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
# Recording live traffic

class TraceRecorder:
    """An ``EngineObserver`` that writes an engine's traffic to a JSONL trace as it runs.

    Pass it to ``LLMEngine(observer=...)`` or ``LLM(observer=...)``; the engine needs a
    ``vocab_size`` (``LLM`` gives the model's). It opens the file when attached, so it
    can be built, and pickled, before the engine exists (the server builds its engine
    in another process).

    Args:
        trace_path: the JSONL file (overwritten).
        seed: written in the header (the live sampler's seed; informative only).

    It writes the config with the pool the engine really got, every add and abort with
    the step it came before, and one expect line per ``step()`` (``engine.last_step``:
    scheduled, preempted, finished with the tokens and finish reasons, free blocks, token
    counters), under a header that says ``"fake_model": "recorded"``. Only what changes
    the engine is recorded: a refused add, an abort of a finished request and a ``step()``
    of an idle engine change nothing and are left out (steps are counted without the idle
    ones). So every recorded input is followed by recorded steps until the engine drains,
    which is where a replay stops too; a server idling between requests leaves no gaps.

    The header is written with the first recorded event, so the scheduling mode
    may still be switched (``set_async_scheduling``) before any traffic. Lines
    are flushed whenever the engine is idle and by ``close()``.
    """

    def __init__(self, trace_path: str | os.PathLike[str], seed: int = 0) -> None:
        self.trace_path = os.fspath(trace_path)
        self._seed = seed
        self._file: IO[str] | None = None
        self._started = False
        self._num_steps = 0   # recorded steps so far: the step of the next input event

    def attach(self, engine: LLMEngine) -> None:
        """Open the trace file for ``engine``.

        Raises:
            ValueError: the engine has no ``vocab_size``. RuntimeError: already attached.
        """
        if self._file is not None:
            raise RuntimeError(f"TraceRecorder({self.trace_path!r}) already records an engine")
        if engine.vocab_size is None:
            raise ValueError("TraceRecorder: the engine has no vocab_size, and a trace needs it")
        self._file = open(self.trace_path, "w", encoding="utf-8")

    def _write(self, engine: LLMEngine, line: dict[str, Any]) -> None:
        assert self._file is not None, "attach() opens the file before any event"
        if not self._started:
            self._started = True
            self._file.write(json.dumps(self._header(engine)) + "\n")
        self._file.write(json.dumps(line) + "\n")

    def _header(self, engine: LLMEngine) -> dict[str, Any]:
        assert engine.vocab_size is not None
        cache = dataclasses.replace(engine.cache_config, num_blocks=engine.num_blocks)
        state = engine.scheduler.block_manager.state
        slots, snapshots = (state.num_slots, state.num_snapshots) if state is not None else (0, 0)
        return Trace(seed=self._seed, cache=cache, scheduler=engine.scheduler_config,
                     executor_num_blocks=engine.num_blocks, vocab_size=engine.vocab_size,
                     eos_token_id=engine.eos_token_id, events=(), fake_model="recorded",
                     speculative=engine.proposer.config() if engine.proposer is not None else None,
                     executor_state_slots=slots, executor_state_snapshots=snapshots).header()

    def on_add_request(self, engine: LLMEngine, request_id: str, prompt_token_ids: Sequence[int],
                       params: SamplingParams) -> None:
        """An accepted request, at the step it came before."""
        self._write(engine, AddEvent(self._num_steps, request_id, tuple(int(t) for t in prompt_token_ids),
                                     params).to_json())

    def on_abort_request(self, engine: LLMEngine, request_id: str) -> None:
        """An abort that aborted something."""
        self._write(engine, AbortEvent(self._num_steps, request_id).to_json())

    def on_step(self, engine: LLMEngine, record: StepRecord) -> None:
        """A step of a busy engine, as an expect line."""
        self._write(engine, ExpectEvent.from_record(self._num_steps, record).to_json())
        self._num_steps += 1
        if not engine.has_unfinished_requests():
            assert self._file is not None
            self._file.flush()

    def on_set_async_scheduling(self, engine: LLMEngine, on: bool) -> None:
        """Allowed before any traffic only: a trace has one config.

        Raises:
            RuntimeError: the trace already holds events in the other mode.
        """
        if self._started and on != engine.async_scheduling:
            raise RuntimeError(f"set_async_scheduling: the trace {self.trace_path} is recorded with "
                               f"async_scheduling={engine.async_scheduling}; it cannot change mid-trace")

    def close(self) -> None:
        """Flush and close the trace file (idempotent)."""
        if self._file is not None:
            self._file.close()
