"""The hook through which something outside the engine watches its traffic.

An ``LLMEngine`` built with an ``observer`` tells it of every change it
accepted, as it happens: a request added, a request aborted, a step of an
engine that had work. ``minivllm.engine.trace.TraceRecorder`` writes these as a trace
that the simulator replays; the engine itself knows nothing of traces.

Each call passes the engine, so an observer need not keep a reference to it:
an engine and its observer form no reference cycle, and dropping the engine's
owner frees both at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

from minivllm.sampling import SamplingParams

if TYPE_CHECKING:
    from minivllm.engine.llm_engine import LLMEngine, StepRecord

__all__ = ["EngineObserver"]


@runtime_checkable
class EngineObserver(Protocol):
    """Told by an ``LLMEngine`` what changes it; see the module docstring.

    Only accepted changes are reported: a refused add, an abort of a finished
    request and a ``step()`` of an idle engine change nothing and are not.
    """

    def attach(self, engine: "LLMEngine") -> None:
        """Once, at the end of the engine's construction (its pool size is known).

        Raises:
            ValueError / RuntimeError: the observer cannot watch this engine.
        """
        ...

    def on_add_request(self, engine: "LLMEngine", request_id: str, prompt_token_ids: Sequence[int],
                       params: SamplingParams) -> None:
        """After ``add_request`` queued the request."""
        ...

    def on_abort_request(self, engine: "LLMEngine", request_id: str) -> None:
        """After ``abort_request`` aborted a live request."""
        ...

    def on_step(self, engine: "LLMEngine", record: "StepRecord") -> None:
        """After a ``step()`` that began with work to do; ``record`` is its ``last_step``."""
        ...

    def on_set_async_scheduling(self, engine: "LLMEngine", on: bool) -> None:
        """Before the engine switches its scheduling mode (it refuses unless idle); raising
        refuses the switch."""
        ...

    def close(self) -> None:
        """The engine is closed: release what the observer holds (idempotent)."""
        ...
