"""What the engine needs of a proposer: draft tokens for the sequences about to decode.

The engine (torch-free) asks once per step, with every token of those sequences known
(``LLMEngine``: a step with drafts is planned only after the step before it is applied),
and cuts what it gets to each sequence's room (``max_drafts``). Proposers that run on the
host (n-gram lookup) answer at once; the simulator's fake proposer is one more
(``sim/fake_proposer.py``).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence


class Proposer(Protocol):
    """Suggests draft tokens (``docs/design.md``, "Speculative decoding")."""

    num_speculative_tokens: int  # most drafts per sequence and step (k)

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
