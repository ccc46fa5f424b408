"""Incremental detokenization for streaming: token ids in, final text deltas out.

Decoding each new token on its own is wrong in two ways. A byte-level BPE token
(GPT-2, Qwen) may hold only part of a UTF-8 character, so its text alone is U+FFFD;
and some tokenizers (SentencePiece/Metaspace, WordPiece) render a token differently
depending on its left neighbour (a leading space is dropped at the start of a
decode). Decoding the whole completion every step is right but O(length) per token.

``IncrementalDetokenizer`` decodes a small window instead: the tokens of the last
release (at first the prompt tail) as left context, then the pending tokens::

    ids:  dropped ... | released last time (context) | pending |
                      ^ prefix_offset                ^ read_offset   ^ len(ids)

    prefix_text = decode(ids[prefix_offset:read_offset])
    window_text = decode(ids[prefix_offset:])
    delta       = window_text[len(prefix_text):]

The delta is released only when ``window_text`` does not end with U+FFFD, i.e. the
pending bytes form whole characters; otherwise the tokens stay pending and are
decoded again with the next ones. After a release the window slides:
``prefix_offset, read_offset = read_offset, len(ids)``.

Invariant (byte-level BPE): ``prefix_offset`` and ``read_offset`` always sit on
character boundaries (a decode that does not end with U+FFFD ends on a whole
character), and a UTF-8 decode with replacement cut at a character boundary is the
concatenation of the decodes of the two sides. Hence the deltas, followed by
``flush()``, concatenate to exactly ``tokenizer.decode(completion_ids,
skip_special_tokens=...)``. For tokenizers whose decode depends on the left
neighbour the prompt tail in the first window supplies that neighbour, so the text
is the completion *as a continuation of the prompt* (e.g. it keeps a leading space
that a standalone decode of the completion would drop), which is what a client
appending deltas to the prompt wants.

Cost: at most two decodes per ``add()`` (the window, and after a release the new
prefix), each over the tokens released by the previous release plus the pending
ones: O(window) per call, O(1) amortized per token, never O(length). Ids left of
the window are dropped, so memory is O(window) too. Only a stream of tokens whose text keeps ending in U+FFFD (garbage
bytes, or a literal U+FFFD) grows the pending part; ``flush()`` releases it.

The module never imports torch or transformers: any object with an HF-style
``decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=...)`` works.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded as left context for the first completion tokens (vLLM uses
# 5 too): enough for a leading-space rule, small enough to stay O(1).
PROMPT_CONTEXT_TOKENS = 5


class Tokenizer(Protocol):
    """The part of an HF ``PreTrainedTokenizerBase`` the detokenizer uses."""

    def decode(
        self,
        token_ids: list[int],
        skip_special_tokens: bool = ...,
        clean_up_tokenization_spaces: bool | None = ...,
    ) -> str:
        """Text of ``token_ids``."""
        ...


class IncrementalDetokenizer:
    """Turns one request's completion token ids into text, a final delta at a time.

    Args:
        tokenizer: an HF tokenizer (fast tokenizers are tested) or anything with
            its ``decode`` signature.
        prompt_token_ids: the request's prompt; its last few tokens are the left
            context of the first completion tokens and never appear in the output.
        skip_special_tokens: drop special tokens (eos, ``<|im_end|>``) from the text.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # A fast HF tokenizer's Rust backend decodes the same text (we never ask for the
        # clean-up) without the Python wrapper's cost, which dominates a call: the server
        # decodes every streaming request every step (docs/tuning.md, "Host path").
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend_decode = getattr(backend, "decode", None)
        # Only the tail of the prompt is ever decoded, so only it is kept.
        # The window, ids[prefix_offset:]; ids left of it are dropped, so prefix_offset is 0.
        self._ids: list[int] = list(prompt_token_ids[max(0, len(prompt_token_ids) - PROMPT_CONTEXT_TOKENS):])
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._num_completion_tokens = 0
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """All completion text released so far (the concatenation of the deltas)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def num_completion_tokens(self) -> int:
        """Completion tokens added so far, released or pending."""
        return self._num_completion_tokens

    @property
    def num_pending_tokens(self) -> int:
        """Tokens added but not yet released, because their text ends mid-character."""
        return len(self._ids) - self._read_offset

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Append completion tokens; return the text that became final ("" if none)."""
        self._ids.extend(new_token_ids)
        self._num_completion_tokens += len(new_token_ids)
        if self.num_pending_tokens == 0:
            return ""
        window_text = self._decode(self._ids)
        if window_text.endswith(REPLACEMENT_CHAR):
            # Most likely an incomplete UTF-8 sequence: a later token completes it.
            return ""
        return self._release(window_text)

    def flush(self) -> str:
        """Release the pending tokens as they are (U+FFFD included); call at the end."""
        if self.num_pending_tokens == 0:
            return ""
        return self._release(self._decode(self._ids))

    def _release(self, window_text: str) -> str:
        # A tokenizer whose decode is not prefix-stable could break startswith; the
        # slice is then the best available guess (vLLM does the same).
        delta = window_text[len(self._prefix_text):]
        self._prefix_text = self._decode(self._ids[self._read_offset:])
        # Drop ids left of the new window so memory stays O(window), not O(length).
        del self._ids[:self._read_offset]
        self._read_offset = len(self._ids)
        self._chunks.append(delta)
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        if self._backend_decode is not None:
            return self._backend_decode(token_ids, skip_special_tokens=self._skip_special_tokens)
        # Cleanup rewrites " ." as "." depending on neighbours; it would break the
        # window invariant, and Qwen tokenizers turn it off anyway.
        return self._tokenizer.decode(
            token_ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
