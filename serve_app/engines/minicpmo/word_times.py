"""Word times on MiniCPM-o (``SpeechRequest.word_times``): when each word's text is released to
the TTS model, placed on the audio that follows.

The schedule hands the TTS its text a piece at a time (a few tokens; :mod:`.speech_schedule`)
and each generate call's audio leaves with the text accepted since the previous chunk
(``AudioChunk.text``, :func:`.output.emit`). So a chunk's audio is the first the model made with
that text in its context. :class:`ReleasedWords` gives each word to the chunk with which its last
character was released (a word cut between two pieces waits for its rest) and spreads a chunk's
words over its audio in proportion to their characters.

What that measures is the release, not the speech: no word can be heard before its text
reaches the model, but the model reads ahead of its audio, so the word may be spoken in that
chunk or one or two calls later (a call is ``chunk_frames`` code frames: 25, one second, by
default; the first chunk is cut shorter by ``first_chunk_frames``). Within a chunk the spread by
characters is a guess. Expect words early by up to a call or two, in the right order; how far
off it is with trained weights is not measured here (docs/word-timing.md).
"""

from __future__ import annotations

from serve_app.engines.words import WordTime, split_words


class ReleasedWords:
    """One stream's words as their text is released, placed on the chunks' audio."""

    def __init__(self, sample_rate_hz: int) -> None:
        self._rate = sample_rate_hz
        self._waiting = ""  # released text whose last word may not be complete yet
        self._samples = 0  # audio already sent

    def chunk(self, text: str, samples: int, following: str | None) -> tuple[WordTime, ...]:
        """The words of a chunk of ``samples`` samples sent with ``text`` (the text released
        since the last chunk). ``following``: the text that comes next ("" when there is none,
        None when it is not known yet): a last word it does not continue is complete; a stream
        cut short keeps a word it got only part of to itself."""
        released = self._waiting + text
        if following is not None and (following == "" or following[0].isspace()):
            cut = len(released)
        else:
            cut = next((i for i in range(len(released) - 1, -1, -1)
                        if released[i].isspace()), 0)
        complete, self._waiting = released[:cut], released[cut:]
        words = split_words(complete)
        start = self._samples
        self._samples += samples
        if not words:
            return ()
        weights = [len(word) + 1 for word in words]
        total, before, times = sum(weights), 0, []
        for word, weight in zip(words, weights):
            first = start + samples * before / total
            before += weight
            times.append(WordTime(word, first / self._rate,
                                  (start + samples * before / total) / self._rate))
        return tuple(times)
