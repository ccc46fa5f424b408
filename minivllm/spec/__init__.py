"""Speculative decoding's proposers, behind one interface (``base.Proposer``)."""
