"""A schedule's growing text, tokenized from its last word boundary on, gives exactly the ids of
the whole text (text.GrowingTextTokenizer), with the ChatTTS tokenizer the engine loads."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer, BertTokenizerFast

from serve_app.engines.minicpmo.text import GrowingTextTokenizer, splits_at_spaces

GOLDEN = Path(__file__).resolve().parents[2] / "golden"

# Words that exercise BERT's normalizer and pre-tokenizer: punctuation inside and around words,
# accents (stripped with lowercasing), CJK characters (each its own word), digits, words longer
# than WordPiece's 100 characters, unknown characters, control characters (removed), special
# tokens written in the text, and every kind of space.
WORDS = ["Hello", "world,", "it's", "3.14", "naïve", "CAFÉ", "über-cool", "你好", "世界。", "😀",
         "e-mail:", "a" * 120, "(parenthesis)", "[Stts]", "x\x00y", "tab\there", "new\nline",
         "U.S.A.", "$100", "50%", "co-op", "Ünïcödé", "مرحبا", "Привет", "...", "-", "'quoted'"]
SPACES = [" ", " ", " ", "  ", "\t", "\n", " \u3000 ", "\u00a0"]


def chattts() -> BertTokenizerFast:
    return BertTokenizerFast.from_pretrained(str(GOLDEN / "chattts_tokenizer"))


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(WORDS) + rng.choice(SPACES) for _ in range(rng.randint(1, 30)))


def test_the_chattts_tokenizer_qualifies_and_a_bpe_one_does_not() -> None:
    assert splits_at_spaces(chattts().backend_tokenizer)
    # MiniCPM-o's LLM tokenizer (byte-level BPE) merges across spaces: it does not qualify
    assert not splits_at_spaces(AutoTokenizer.from_pretrained(str(GOLDEN / "tokenizer")).backend_tokenizer)


@pytest.mark.parametrize("seed", range(40))
def test_growing_text_gets_the_ids_of_the_whole_text(seed: int) -> None:
    tokenizer = chattts()
    backend = tokenizer.backend_tokenizer
    rng = random.Random(seed)
    text = random_text(rng)
    growing = GrowingTextTokenizer(lambda t: backend.encode(t, add_special_tokens=False).ids)
    ends = sorted(rng.sample(range(1, len(text) + 1), min(len(text), rng.randint(1, 25))))
    if ends[-1] != len(text):
        ends.append(len(text))
    for end in ends:  # pieces of any size, cut anywhere (mid-word too)
        prefix = text[:end]
        assert growing(prefix) == tokenizer.encode(prefix, add_special_tokens=False), repr(prefix)


def test_a_text_that_does_not_extend_the_last_is_encoded_whole() -> None:
    tokenizer = chattts()
    backend = tokenizer.backend_tokenizer
    calls: list[str] = []

    def encode(text: str) -> list[int]:
        calls.append(text)
        return backend.encode(text, add_special_tokens=False).ids

    growing = GrowingTextTokenizer(encode)
    first = "The weather today is sunny and warm, and I"
    growing(first)
    calls.clear()
    assert growing(first + " hope") == tokenizer.encode(first + " hope", add_special_tokens=False)
    assert all(len(c) < 10 for c in calls), calls  # only what followed the last boundary
    # a segment cut keeps the text before a sentence end; then a new segment's text starts over
    for text in ("The weather today.", "Another segment starts here"):
        calls.clear()
        assert growing(text) == tokenizer.encode(text, add_special_tokens=False)
    assert "".join(calls).replace(" ", "") == "Anothersegmentstartshere"
