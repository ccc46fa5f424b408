"""A draft model (vLLM's ``method: "draft_model"``): a smaller model with the target's
vocabulary guesses the next k tokens, greedily; or the model's own MTP head (``method:
"mtp"``, Qwen3.5), which does the same from the target's hidden states.

Their drafts are made on the device, within the step that verifies them
(``executor/draft.py``, ``executor/mtp.py``): the engine only says how many each row takes.
This side of them is what the torch-free engine holds.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from minivllm.config import SpeculativeConfig


class DraftModelProposer:
    """``spec.base.Proposer`` for drafts the executor's draft model or MTP head makes (``on_device``)."""

    on_device = True

    def __init__(self, config: SpeculativeConfig) -> None:
        if config.method not in ("draft_model", "mtp"):
            raise ValueError(f"DraftModelProposer needs method 'draft_model' or 'mtp', got {config.method!r}")
        self.speculative_config = config
        self.num_speculative_tokens = config.num_speculative_tokens

    def config(self) -> dict[str, Any]:
        return dataclasses.asdict(self.speculative_config)

    def propose(self, contexts: Sequence[Sequence[int]], max_drafts: Sequence[int],
                names: Sequence[str]) -> list[list[int]]:
        raise RuntimeError("a draft model's (or MTP head's) drafts are made by the executor within the step; "
                           "the engine never asks for them (spec/base.py)")

