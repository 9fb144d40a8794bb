"""Words and their times in a stream's audio (``timestamp_granularities: ["word"]``).

What a word is, for every engine: a run of text between whitespace, with the punctuation that
touches it (``"Hello,"``, ``"don't"``, ``"well-known."``), holding at least one letter, digit or
symbol. A run of punctuation alone (``"—"``, ``"..."``) is spoken as a pause or not at all: it
is not a word. Joined with single spaces, a stream's words give back its text as written.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

# Unicode categories that make a run of text a word: letters, numbers, symbols (emoji, $, +).
_SPOKEN_CATEGORIES = ("L", "N", "S")


@dataclass(frozen=True)
class WordTime:
    """One word of a stream: ``start_s``/``end_s`` in seconds from the stream's first sample."""

    word: str
    start_s: float
    end_s: float

    def as_dict(self) -> dict[str, object]:
        """OpenAI's word object (as in its transcription replies)."""
        return {"word": self.word, "start": round(self.start_s, 3), "end": round(self.end_s, 3)}


def is_word(token: str) -> bool:
    return any(unicodedata.category(char).startswith(_SPOKEN_CATEGORIES) for char in token)


def split_words(text: str) -> list[str]:
    """The words of ``text``, in order (see the module docstring)."""
    return [token for token in text.split() if is_word(token)]


def spoken_by(words: list[WordTime], played_s: float) -> list[WordTime]:
    """The words whose audio ended within the first ``played_s`` seconds (a barge-in's
    heard text)."""
    return [word for word in words if word.end_s <= played_s]
