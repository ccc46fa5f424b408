"""The Executor protocol: the scheduler's one view of whatever computes tokens."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from minivllm.engine.plan import StepPlan, StepResult


@runtime_checkable
class Executor(Protocol):
    """Runs planned steps over a paged KV cache it owns.

    The engine asks ``num_kv_blocks`` once at start-up (the pool the executor
    has room for; the CUDA executor sizes it from free memory) and then calls
    ``execute`` once per step.
    """

    def num_kv_blocks(self) -> int:
        """How many KV blocks of the engine's block size the executor holds."""
        ...

    def execute(self, plan: StepPlan) -> StepResult:
        """Write the plan's K/V, run the model, sample for ``plan.sample`` rows."""
        ...
