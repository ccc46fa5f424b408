"""What the engine needs of a proposer: draft tokens for the sequences about to decode.

The engine (torch-free) asks once per step, with every token of those sequences known
(``LLMEngine``: a step with drafts is planned only after the step before it is applied),
and cuts what it gets to each sequence's room (``max_drafts``). Proposers that run on the
host (n-gram lookup) answer at once; the simulator's fake proposer is one more
(``sim/fake_proposer.py``).

A proposer ``on_device`` (a draft model) is never asked: the executor makes its drafts
within the step that scores them, on the device, so no draft crosses to the host before
it is verified. The engine plans how many each row takes (``StepPlan.drafts_on_device``,
the chunk's draft tokens ``DRAFT_ON_DEVICE``) and learns them from the step's result
(``StepResult.drafts``). Rows under a grammar or a token rule take none from it: their
masks need every draft on the host before the step.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

# A draft token the executor makes within the step (a placeholder in ``StepPlan.token_ids``).
DRAFT_ON_DEVICE = -3


class Proposer(Protocol):
    """Suggests draft tokens (``docs/design.md``, "Speculative decoding")."""

    num_speculative_tokens: int  # most drafts per sequence and step (k)
    on_device: bool  # drafts made by the executor within the step: ``propose`` is never called

    def config(self) -> dict[str, Any]:
        """What rebuilds it: ``speculative_config`` as a dict (a trace's ``config.speculative``)."""
        ...

    def propose(self, contexts: Sequence[Sequence[int]], max_drafts: Sequence[int],
                names: Sequence[str]) -> list[list[int]]:
        """Per sequence (prompt and completion tokens, all known), at most ``max_drafts[i]``
        (<= k) draft tokens that may follow; [] where it has no guess. ``names``: the
        sequences' names (``outputs.sequence_name``), for proposers that keep state per
        sequence."""
        ...
