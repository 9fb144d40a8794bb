"""Which word each phoneme of a Piper piece speaks, and each word's span of phoneme ids.

espeak-ng writes a clause's phonemes with a space between words, but its words are not the
text's: it joins some ("of the" -> ``ʌvðə``) and expands others ("1887" -> four words). So each
text word (:func:`serve_app.engines.words.split_words`) is phonemized alone, and the sequence of
those phonemes is aligned with each sentence's in turn (:class:`difflib.SequenceMatcher`, a
longest common subsequence; the standard library's, as no maintained aligner of phoneme strings
is a dependency here). Phonemes it matches take their word; the ones it does not (a word said
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
        """The text's words and, per sentence, each phoneme's word.

        Sentence by sentence, against a window of the words not yet placed (half as many
        phonemes again as the sentence has), so the alignment's cost grows with the text, not
        with its square."""
        words = split_words(text)
        labels: list[list[Label]] = []
        placed = 0  # words before this one are in earlier sentences
        for sentence in sentences:
            heard = [i for i, phoneme in enumerate(sentence) if phoneme not in SILENT]
            sentence_labels: list[Label] = [None] * len(sentence)
            labels.append(sentence_labels)
            spoken: list[str] = []
            spoken_word: list[int] = []
            window_end = placed
            while window_end < len(words) and len(spoken) < len(heard) * 3 // 2 + 8:
                phonemes = self._isolated(words[window_end])
                spoken.extend(phonemes)
                spoken_word.extend([window_end] * len(phonemes))
                window_end += 1
            if not heard or not spoken:
                continue
            found = _align(spoken, spoken_word, [sentence[i] for i in heard])
            _fill_within_espeak_words(found, heard, sentence)
            last = placed
            for index, label in zip(heard, found):
                last = max(last, label if label is not None else last)  # in text order
                sentence_labels[index] = last
            placed = last + 1
        return words, labels


def _align(spoken: list[str], spoken_word: list[int], heard: list[str]) -> list[Label]:
    """Each ``heard`` phoneme's word where the alignment places it (None: inserted)."""
    found: list[Label] = [None] * len(heard)
    matcher = SequenceMatcher(None, spoken, heard, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            found[j1:j2] = spoken_word[i1:i2]
        elif tag == "replace":  # one for one, in order (the rest: the block's last word)
            for offset in range(j2 - j1):
                found[j1 + offset] = spoken_word[min(i1 + offset, i2 - 1)]
        elif tag == "insert":
            found[j1:j2] = [None] * (j2 - j1)
    return found


def _fill_within_espeak_words(found: list[Label], heard: list[int],
                              sentence: Sequence[str]) -> None:
    """An unmatched phoneme takes the word of the nearest matched one in its espeak word
    (phonemes between spaces), the one before first; with none there, the one before it."""
    group = [0] * len(heard)  # espeak word number of each heard phoneme
    for k in range(1, len(heard)):
        group[k] = group[k - 1] + (" " in sentence[heard[k - 1]:heard[k]])
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
                            None)


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
                 ) -> tuple[tuple[str, int, int], ...]:
    """(word, first sample, end sample) in the piece's audio, from samples per id."""
    edges = np.concatenate([[0], np.cumsum(id_samples)])
    return tuple((span.word, int(edges[span.first_id]), int(edges[span.end_id]))
                 for span in spans)
