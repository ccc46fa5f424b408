"""Speculative decoding's proposers (``base.Proposer``): n-gram lookup, a draft model and
a model's MTP head."""

from __future__ import annotations

from minivllm.config import SpeculativeConfig
from minivllm.spec.base import Proposer
from minivllm.spec.draft_model import DraftModelProposer
from minivllm.spec.ngram import NgramProposer


def make_proposer(config: SpeculativeConfig | None) -> Proposer | None:
    """The proposer ``config`` names (None: no speculation)."""
    if config is None:
        return None
    return DraftModelProposer(config) if config.method in ("draft_model", "mtp") else NgramProposer(config)
