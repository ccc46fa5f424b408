"""The Executor protocol: the scheduler's one view of whatever computes tokens."""

from __future__ import annotations

import atexit
import gc
from typing import Protocol, runtime_checkable

import numpy as np

from minivllm.engine.plan import StepPlan, StepResult
from minivllm.sampling import SamplingParams


@runtime_checkable
class StepHandle(Protocol):
    """A submitted step; ``result()`` waits for it (steps complete in submission order).

    A plan with masked rows (``StepPlan.masked``) samples only once the engine has given
    its token bitmask (``set_token_bitmask``), which it does before asking for the result
    and before submitting the next plan.
    """

    def result(self) -> StepResult:
        """Block until the step has run; return what it sampled."""
        ...

    def set_token_bitmask(self, bitmask: np.ndarray) -> None:
        """Give the step's grammar masks: int32 (S, W), one row per sampling row in plan
        order (every bit set for a row without a grammar; ``engine/grammar.py``)."""
        ...


@runtime_checkable
class Executor(Protocol):
    """Runs planned steps over a paged KV cache it owns.

    The engine asks ``num_kv_blocks`` once at start-up (the pool the executor
    has room for; the CUDA executor sizes it from free memory) and then, per
    step, either ``execute(plan)`` (synchronous) or ``submit(plan)`` and later
    ``handle.result()`` (one step ahead). Steps run in submission order, as on
    one CUDA stream, so a plan may feed a sequence the token it sampled in the
    previous plan by reference (``StepPlan.feeds_prev_sample``).
    """

    def num_kv_blocks(self) -> int:
        """How many KV blocks of the engine's block size the executor holds."""
        ...

    def state_pool(self) -> tuple[int, int]:
        """How many recurrent states the executor holds for running sequences and for prefix-cache
        snapshots (hybrid models, ``engine/state_cache.py``); (0, 0) for a model without state."""
        ...

    def submit(self, plan: StepPlan) -> StepHandle:
        """Start the step (write the plan's K/V, run the model, sample) without waiting for it."""
        ...

    def execute(self, plan: StepPlan) -> StepResult:
        """``submit(plan).result()``."""
        ...

    def verifies_drafts(self, params: SamplingParams) -> bool:
        """Whether a row with these params may be given drafts (``StepPlan.num_drafts``):
        the engine proposes only for rows its executor can score with them."""
        ...


class DoneStep:
    """The handle of a step that already ran (executors that compute on submit)."""

    def __init__(self, result: StepResult) -> None:
        self._result = result

    def result(self) -> StepResult:
        return self._result

    def set_token_bitmask(self, bitmask: np.ndarray) -> None:
        raise RuntimeError("this step has already sampled: a plan with masked rows must not "
                           "compute on submit")


_froze = False


def freeze_imported_objects() -> None:
    """Once per process, before the first executor is built: move every object alive then
    (torch, transformers and the other modules) out of the garbage collector's reach, as
    vLLM does: otherwise every full collection scans them all, a stall of its own
    (``docs/tuning.md``, "Host path").
    Once only: a second ``LLM`` in the process must not freeze the first, which may be a
    reference cycle (with a tokenizer its engine calls back into it) and could then never
    be freed, GPU memory included. Unfrozen at exit so the interpreter can still collect everything
    (nanobind reports frozen bindings as leaks otherwise).
    """
    global _froze
    if _froze:
        return
    _froze = True
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
