"""Text preparation for the Piper engine: checking a request's fields, the synthesis scales it
asks for, and phonemizing text (espeak-ng) into the phoneme-id pieces the step speaks."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence

from piper import PiperVoice

from serve_app.engines.base import TEXT_INPUTS, InvalidRequestError, SpeechRequest
from serve_app.engines.piper.piper_voice import phoneme_pieces
from serve_app.engines.piper.piper_words import Piece, WordLabeler
from serve_app.engines.text_rule import MAX_TEXT_CHARS, NOTHING_TO_SPEAK, check_text

VOICE_NAME = "joe"
MIN_SPEED = 0.25
MAX_SPEED = 4.0
PHONEMIZED_TEXTS_KEPT = 32  # validate's phoneme pieces, kept for the step that speaks them

Scales = tuple[float, float, float]  # (noise_scale, length_scale, noise_w_scale)


def check_request(request: SpeechRequest, pieces_of: Callable[[str], Sequence[Piece]]) -> None:
    """Refuse a request this engine cannot speak (:class:`InvalidRequestError`); ``pieces_of``
    phonemizes a whole text (cached, so the step reuses it)."""
    if request.mode != "read":
        raise InvalidRequestError(
            "The piper engine cannot chat: it only reads the given text aloud "
            "(use mode 'read', or deploy the minicpmo engine for chat).",
            param="mode", code="unsupported_mode", status_code=422)
    if request.text_input not in TEXT_INPUTS:
        raise InvalidRequestError(f"unknown text_input {request.text_input!r}", "text_input")
    if request.text_input == "whole":
        check_text(request.text)
        if not pieces_of(request.text):
            raise InvalidRequestError("text holds nothing this voice can speak",
                                      param="text", code=NOTHING_TO_SPEAK)
    elif len(request.text) > MAX_TEXT_CHARS:
        raise InvalidRequestError(f"text is longer than {MAX_TEXT_CHARS} characters",
                                  param="text", code="text_too_long")
    if request.voice not in (VOICE_NAME, "default"):
        raise InvalidRequestError(
            f"unknown voice {request.voice!r}; available: {VOICE_NAME}", param="voice",
            code="unknown_voice")
    if not (MIN_SPEED <= request.speed <= MAX_SPEED):
        raise InvalidRequestError(f"speed must be within [{MIN_SPEED}, {MAX_SPEED}]",
                                  param="speed", code="invalid_speed")


def scales_for(request: SpeechRequest, length_scale: float, noise_scale: float,
               noise_w_scale: float) -> Scales:
    """The request's synthesis scales: speed divides the voice's length scale; a seed turns
    both noises off (ONNX Runtime's noise takes no seed)."""
    length_scale = length_scale / request.speed
    if request.seed is not None:
        return (0.0, length_scale, 0.0)
    return (noise_scale, length_scale, noise_w_scale)


class Phonemizer:
    """espeak-ng keeps global state: ``validate`` (event loop) and the step thread take turns
    under :attr:`lock`. :meth:`pieces` takes it and is cached; :meth:`phonemize` does not.
    Pieces carry their words' spans only where asked (``words=True``): the alignment costs an
    espeak call per new word."""

    def __init__(self, voice: PiperVoice, max_sentence_phonemes: int,
                 first_piece_phonemes: int) -> None:
        self._voice = voice
        self._max_sentence_phonemes = max_sentence_phonemes
        self._first_piece_phonemes = first_piece_phonemes
        self.lock = threading.Lock()
        self._labeler = WordLabeler(voice.phonemize)
        self.pieces: Callable[[str], tuple[Piece, ...]] = (
            functools.lru_cache(PHONEMIZED_TEXTS_KEPT)(self._pieces_locked))

    def _pieces_locked(self, text: str) -> tuple[Piece, ...]:
        with self.lock:
            return tuple(self.phonemize(text))

    def word_pieces(self, text: str) -> list[Piece]:
        """:meth:`pieces` with their words' spans (takes the lock; not cached)."""
        with self.lock:
            return self.phonemize(text, words=True)

    def phonemize(self, text: str, first: bool = True, words: bool = False) -> list[Piece]:
        """Phoneme-id pieces of ``text``; ``first``: the first piece may be held shorter."""
        return phoneme_pieces(self._voice, text, self._max_sentence_phonemes,
                              self._first_piece_phonemes if first else 0,
                              self._labeler if words else None)
