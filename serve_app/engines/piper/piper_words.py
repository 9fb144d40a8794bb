"""Which word each phoneme of a Piper piece speaks, and each word's span of phoneme ids.

espeak-ng writes a clause's phonemes with a space between words, but its words are not the
text's: it joins some ("of the" -> ``ʌvðə``) and expands others ("1887" -> four words). So each
text word (:func:`serve_app.engines.words.split_words`) is phonemized alone, and the sequence of
those phonemes is aligned with the sentence's (:class:`difflib.SequenceMatcher`, a longest
common subsequence). Phonemes it matches take their word; the ones it does not (a word said
differently in context) take the word of their neighbour within the same espeak word. Spaces and
clause marks (``,`` ``.`` ``?``: the pauses) belong to no word.

Each word then spans the phoneme ids of its first to its last phoneme (the pad piper puts after
each phoneme included, except after the last: before a pause that pad is already quiet), which
the voice's duration output turns into samples (:func:`word_samples`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from difflib import SequenceMatcher
from typing import NamedTuple

import numpy as np

from serve_app.engines.words import split_words

SILENT = frozenset(" ,.;:!?")  # a word break, or a clause mark piper speaks as a pause
ISOLATED_WORDS_KEPT = 4096  # words phonemized alone, cached (common words repeat)

Label = int | None  # the index of the word a phoneme speaks; None: no word's


class WordSpan(NamedTuple):
    """A word's ids in its piece: ``ids[first_id:end_id]``."""

    word: str
    first_id: int
    end_id: int


class Piece(NamedTuple):
    """Phoneme ids the model speaks in one run; with word times asked for, the words' spans."""

    ids: tuple[int, ...]
    words: tuple[WordSpan, ...] = ()


class WordLabeler:
    """Labels a text's phonemes with its words; ``phonemize`` is the voice's (sentences of
    phonemes), called under the caller's espeak lock."""

    def __init__(self, phonemize: Callable[[str], list[list[str]]]) -> None:
        self._isolated = functools.lru_cache(ISOLATED_WORDS_KEPT)(
            lambda word: tuple(p for sentence in phonemize(word) for p in sentence
                               if p not in SILENT))

    def label(self, text: str, sentences: Sequence[Sequence[str]]
              ) -> tuple[list[str], list[list[Label]]]:
        """The text's words and, per sentence, each phoneme's word."""
        words = split_words(text)
        spoken: list[str] = []
        spoken_word: list[int] = []
        for index, word in enumerate(words):
            phonemes = self._isolated(word)
            spoken.extend(phonemes)
            spoken_word.extend([index] * len(phonemes))
        flat = [(s, i) for s, sentence in enumerate(sentences) for i, p in enumerate(sentence)
                if p not in SILENT]
        labels: list[list[Label]] = [[None] * len(sentence) for sentence in sentences]
        if not spoken or not flat:
            return words, labels
        found = _align(spoken, spoken_word, [sentences[s][i] for s, i in flat])
        _fill_within_espeak_words(found, flat, sentences)
        last = 0
        for (s, i), label in zip(flat, found):
            last = max(last, label if label is not None else last)  # in text order
            labels[s][i] = last
        return words, labels


def _align(spoken: list[str], spoken_word: list[int], heard: list[str]) -> list[Label]:
    """Each ``heard`` phoneme's word where the alignment places it (None: inserted)."""
    found: list[Label] = [None] * len(heard)
    matcher = SequenceMatcher(None, spoken, heard, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            found[j1:j2] = spoken_word[i1:i2]
        elif tag == "replace":  # spread the replaced phonemes' words evenly over these
            for offset in range(j2 - j1):
                found[j1 + offset] = spoken_word[i1 + offset * (i2 - i1) // (j2 - j1)]
        elif tag == "insert":
            found[j1:j2] = [None] * (j2 - j1)
    return found


def _fill_within_espeak_words(found: list[Label], flat: list[tuple[int, int]],
                              sentences: Sequence[Sequence[str]]) -> None:
    """An unmatched phoneme takes the word of the nearest matched one in its espeak word
    (phonemes between spaces), the one before first; with none there, the one before it."""
    group = [0] * len(flat)  # espeak word number of each phoneme
    number = 0
    for k, (s, i) in enumerate(flat):
        if k and (s != flat[k - 1][0] or any(p == " " for p in sentences[s][flat[k - 1][1]:i])):
            number += 1
        group[k] = number
    for k in range(len(found)):
        if found[k] is not None:
            continue
        before = next((found[j] for j in range(k - 1, -1, -1)
                       if group[j] == group[k] and found[j] is not None), None)
        after = next((found[j] for j in range(k + 1, len(found))
                      if group[j] == group[k] and found[j] is not None), None)
        if before is not None or after is not None:
            found[k] = before if before is not None else after
        else:
            found[k] = next((found[j] for j in range(k - 1, -1, -1) if found[j] is not None),
                            0)


def word_spans(words: list[str], phonemes: Sequence[str], labels: Sequence[Label],
               id_map: dict[str, Sequence[int]], bos: str, pad: str) -> tuple[WordSpan, ...]:
    """Each labelled word's span of ids in the piece ``phonemes`` becomes (the ids piper's
    ``phonemes_to_ids`` writes: BOS, pad, then each known phoneme's ids and a pad), from its
    first phoneme's ids to its last's, without the pad after the last."""
    pad_len = len(id_map[pad])
    position = len(id_map[bos]) + pad_len
    spans: dict[int, list[int]] = {}
    for phoneme, label in zip(phonemes, labels):
        width = len(id_map[phoneme]) + pad_len if phoneme in id_map else 0
        if label is not None and width:
            span = spans.setdefault(label, [position, position + width])
            span[1] = position + width - pad_len
        position += width
    return tuple(WordSpan(words[label], first, end) for label, (first, end) in spans.items())


def word_samples(spans: Sequence[WordSpan], id_samples: np.ndarray
                 ) -> list[tuple[str, int, int]]:
    """(word, first sample, end sample) in the piece's audio, from samples per id."""
    edges = np.concatenate([[0], np.cumsum(id_samples)])
    return [(span.word, int(edges[span.first_id]), int(edges[span.end_id])) for span in spans]
