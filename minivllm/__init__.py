"""minivllm: a small, readable, verified vLLM-style inference engine for Qwen3.

Importing the package imports no torch; ``LLM`` loads it on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from minivllm.outputs import RequestOutput
from minivllm.sampling import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from minivllm.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "RequestOutputKind"]


def __getattr__(name: str) -> Any:
    # LLM pulls in torch and transformers; keep `import minivllm` light for the engine and sim.
    if name == "LLM":
        from minivllm.llm import LLM
        return LLM
    raise AttributeError(f"module 'minivllm' has no attribute {name!r}")
