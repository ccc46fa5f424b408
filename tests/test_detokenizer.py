"""Incremental detokenization against the tiny tokenizers in fixtures/.

``bpe-tokenizer`` (byte-level BPE): its vocabulary is so small that accented letters,
CJK and emoji are split over several tokens; ``test_fixture_splits_characters``
guards that, so the other tests cannot pass vacuously. ``metaspace-tokenizer``
(SentencePiece-style): its decoder drops the leading space of the first token of a
decode; ``test_metaspace_fixture_drops_first_space`` guards that.
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.detokenizer import PROMPT_CONTEXT_TOKENS, REPLACEMENT_CHAR, IncrementalDetokenizer

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "fixtures" / "bpe-tokenizer"
METASPACE_FIXTURE = ROOT / "fixtures" / "metaspace-tokenizer"
METASPACE = "\u2581"
EOS = "<|endoftext|>"

TEXTS = [
    "café crème brûlée, naïve fiancé",
    "über Müller grüßt Jürgen; el niño y la niña",
    "中文是一种语言。\n日本語を話します。",
    "hello 🙂 thumbs up 👍🏽\nfamily 👨‍👩‍👧 🙂🙂",
    "  mixed: é 中 🙂\n\n  ñ日👍🏽 end ",
    "unseen: ß ø 한국어 ⚡ 𝔘 \t tabs",
]

# Single characters and grapheme clusters the property test strings are built from.
PIECES = ["a", "e", " ", "\n", "é", "ü", "ñ", "中", "文", "日", "本", "語", "🙂", "👍🏽", "👨‍👩‍👧", "ß"]


@lru_cache(maxsize=1)
def tokenizer() -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(FIXTURE))


def encode(text: str) -> list[int]:
    return tokenizer().encode(text, add_special_tokens=False)


def chunks(ids: Sequence[int], rng: random.Random | None, max_chunk: int = 5) -> Iterator[list[int]]:
    """``ids`` one at a time (``rng`` None) or in random chunks of 1..max_chunk."""
    i = 0
    while i < len(ids):
        n = 1 if rng is None else rng.randint(1, max_chunk)
        yield list(ids[i:i + n])
        i += n


def stream(ids: Sequence[int], rng: random.Random | None, prompt: Sequence[int] = (),
           skip_special_tokens: bool = True) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed ``ids`` to a fresh detokenizer; return all deltas (flush last) and it."""
    detok = IncrementalDetokenizer(tokenizer(), prompt, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add(chunk) for chunk in chunks(ids, rng)]
    deltas.append(detok.flush())
    return deltas, detok


def check_stream(text: str, ids: Sequence[int], deltas: list[str], detok: IncrementalDetokenizer,
                 skip_special_tokens: bool = True) -> None:
    expected = tokenizer().decode(list(ids), skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == expected
    assert detok.text == expected
    assert detok.num_pending_tokens == 0
    assert detok.num_completion_tokens == len(ids)
    if REPLACEMENT_CHAR not in text:
        assert all(REPLACEMENT_CHAR not in d for d in deltas), deltas


def test_fixture_splits_characters() -> None:
    """Guards the other tests: the fixture must split characters across tokens."""
    split = [t for t in TEXTS if any(REPLACEMENT_CHAR in tokenizer().decode([i]) for i in encode(t))]
    assert len(split) >= 4, split
    for text in TEXTS:
        assert tokenizer().decode(encode(text)) == text


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("seed", [None, 0, 1, 2])
def test_deltas_concatenate_to_full_decode(text: str, seed: int | None) -> None:
    ids = encode(text)
    rng = None if seed is None else random.Random(seed)
    deltas, detok = stream(ids, rng)
    check_stream(text, ids, deltas, detok)
    assert "".join(deltas) == text


def test_one_token_at_a_time_holds_back_partial_characters() -> None:
    """Emoji split over tokens: some add() calls release nothing, none releases U+FFFD."""
    text = "👨‍👩‍👧 👍🏽"
    ids = encode(text)
    deltas, detok = stream(ids, None)
    assert deltas.count("") > 0
    assert deltas[-1] == ""  # nothing was left for flush()
    check_stream(text, ids, deltas, detok)


@pytest.mark.parametrize("prompt_text", ["", "a", "Q: say 中文 and 🙂\nA:", "x" * 3 * PROMPT_CONTEXT_TOKENS])
def test_prompt_context_never_leaks(prompt_text: str) -> None:
    text = " 日本語 👍🏽 é"
    prompt, ids = encode(prompt_text), encode(text)
    deltas, detok = stream(ids, random.Random(3), prompt=prompt)
    check_stream(text, ids, deltas, detok)


def test_special_tokens_skipped_or_kept() -> None:
    eos_id = tokenizer().convert_tokens_to_ids(EOS)
    assert eos_id == tokenizer().eos_token_id
    text = "ñ 中文 🙂"
    ids = encode(text) + [eos_id]
    prompt = encode("hi") + [eos_id] + encode("\n")  # a special token inside the context window
    for skip in (True, False):
        deltas, detok = stream(ids, None, prompt=prompt, skip_special_tokens=skip)
        check_stream(text, ids, deltas, detok, skip_special_tokens=skip)
        assert detok.text == (text if skip else text + EOS)


def test_literal_replacement_char_is_released_by_flush() -> None:
    text = "ok \ufffd"
    ids = encode(text)
    detok = IncrementalDetokenizer(tokenizer(), [])
    released = "".join(detok.add([i]) for i in ids)
    assert released == "ok "  # a trailing U+FFFD looks incomplete until the end
    assert detok.flush() == REPLACEMENT_CHAR
    assert detok.text == text


def test_window_stays_small() -> None:
    """Each decode covers O(window) tokens, not the whole completion."""
    inner = tokenizer()
    sizes: list[int] = []

    class Counting:
        def decode(self, token_ids: list[int], **kwargs: Any) -> str:
            sizes.append(len(token_ids))
            return inner.decode(token_ids, **kwargs)

    ids = encode(" ".join(TEXTS) * 4)
    detok = IncrementalDetokenizer(Counting(), encode("prompt " * 50))
    for i in ids:
        detok.add([i])
    assert len(ids) > 300
    assert max(sizes) <= PROMPT_CONTEXT_TOKENS + 8, max(sizes)
    assert detok.text == inner.decode(ids)


@settings(max_examples=150, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(PIECES), max_size=30),
    prompt_pieces=st.lists(st.sampled_from(PIECES), max_size=8),
    seed=st.integers(0, 2**16),
)
def test_property_random_unicode(pieces: list[str], prompt_pieces: list[str], seed: int) -> None:
    text = "".join(pieces)
    ids = encode(text)
    deltas, detok = stream(ids, random.Random(seed), prompt=encode("".join(prompt_pieces)))
    check_stream(text, ids, deltas, detok)
    assert "".join(deltas) == text


def test_module_imports_no_torch() -> None:
    script = textwrap.dedent("""
        import sys
        import minivllm.detokenizer
        assert "torch" not in sys.modules, "torch was imported"
        assert "transformers" not in sys.modules, "transformers was imported"
        print("OK")
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


# ---- SentencePiece-style (Metaspace) tokenizer ------------------------------------

# (prompt, completion): the completion's ids are those of prompt + completion after
# the prompt's, as a model continuing the prompt would produce them.
METASPACE_CASES = [
    ("Hello", " world!"),
    ("Hello", " world! the server streams  the text, then stops."),
    ("Hello", "  two spaces first, a b  c"),
    ("Hello", "d! glued to the last word"),
    ("the model writes text, then the server", " streams the text to the client."),
]


@lru_cache(maxsize=1)
def metaspace_tokenizer() -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(METASPACE_FIXTURE))


def metaspace_split(prompt_text: str, completion_text: str) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) of ``prompt_text + completion_text``."""
    tok = metaspace_tokenizer()
    prompt = tok.encode(prompt_text, add_special_tokens=False)
    full = tok.encode(prompt_text + completion_text, add_special_tokens=False)
    assert full[:len(prompt)] == prompt, (prompt_text, completion_text)
    return prompt, full[len(prompt):]


def metaspace_stream(prompt: Sequence[int], ids: Sequence[int], rng: random.Random | None) -> list[str]:
    detok = IncrementalDetokenizer(metaspace_tokenizer(), prompt)
    deltas = [detok.add(chunk) for chunk in chunks(ids, rng)]
    deltas.append(detok.flush())
    assert detok.num_pending_tokens == 0
    return deltas


def test_metaspace_fixture_drops_first_space() -> None:
    """Guards the tests below: a standalone decode of the completion loses its space."""
    tok = metaspace_tokenizer()
    prompt, ids = metaspace_split("Hello", " world!")
    assert tok.convert_ids_to_tokens(ids[0]).startswith(METASPACE)
    assert len(ids) >= 2
    assert tok.decode(ids) == "world!"
    assert tok.decode(prompt + ids) == "Hello world!"


def test_metaspace_first_token_keeps_space() -> None:
    """The first token after the prompt is released with its leading space."""
    tok = metaspace_tokenizer()
    prompt, ids = metaspace_split("Hello", " world!")
    first = IncrementalDetokenizer(tok, prompt).add(ids[:1])
    assert first == " " + tok.decode(ids[:1])
    assert metaspace_stream(prompt, ids, None)[0] == first
    for rng in (None, random.Random(0)):
        assert "".join(metaspace_stream(prompt, ids, rng)) == " world!"
    assert IncrementalDetokenizer(tok, prompt).add(ids) == " world!"


@pytest.mark.parametrize(("prompt_text", "completion_text"), METASPACE_CASES)
@pytest.mark.parametrize("seed", [None, 0, 1, 2, 3, 4])
def test_metaspace_stream_matches_decode(prompt_text: str, completion_text: str, seed: int | None) -> None:
    """Deltas concatenate to the completion's decode, with the space it drops restored."""
    tok = metaspace_tokenizer()
    prompt, ids = metaspace_split(prompt_text, completion_text)
    standalone = tok.decode(ids)
    dropped = " " if tok.convert_ids_to_tokens(ids[0]).startswith(METASPACE) else ""
    deltas = metaspace_stream(prompt, ids, None if seed is None else random.Random(seed))
    assert "".join(deltas) == dropped + standalone == completion_text


@pytest.mark.parametrize("prompt", [[], ["<s>"]], ids=["no-prompt", "bos-only"])
def test_metaspace_without_prompt_text_decodes_as_tokenizer(prompt: list[str]) -> None:
    """With no prompt text to continue, the stream is exactly the tokenizer's decode."""
    tok = metaspace_tokenizer()
    prompt_ids = tok.convert_tokens_to_ids(prompt)
    _, ids = metaspace_split("", " world! the server streams  the text.")
    for seed in (None, 0, 1):
        deltas = metaspace_stream(prompt_ids, ids, None if seed is None else random.Random(seed))
        assert "".join(deltas) == tok.decode(ids) == "world! the server streams  the text."
