"""Bookkeeping of streamed text input (``SpeechRequest.text_input == "streamed"``), shared by
the engines: what the caller has fed, whether its input is done, the limits ``feed_text``
enforces, and the one rule for where fed text may be cut into pieces spoken before the input
ends (:func:`clause_ends`). Each engine decides how text becomes speech.

The rule (streamed text only; a whole text is split as before):

- A piece ends after a sentence or clause mark, ``. ! ? ; : ,``, an ellipsis ``…`` or a dash
  ``— –``, with any closing quotes or brackets, when whitespace or the end of the text fed
  so far follows it (so ``3.14`` and ``1,000`` are not cut); after a newline; and after the
  full-width marks ``。 ！ ？ ； ： ， 、`` with nothing needed after them.
- A run of more than :data:`MAX_CLAUSE_CHARS` characters without such a break is cut at its last
  whitespace within the first :data:`MAX_CLAUSE_CHARS` characters (at the limit itself if there
  is none), and the rest is measured again from there.

Piper speaks each piece as soon as it is complete (:class:`ClauseFeed`). MiniCPM-o speaks text as
it comes, ten TTS tokens at a time, and needs the rule only when the text stops: when nothing has
been fed for ``text_break_wait_s`` and its speech has caught up, it speaks the text up to the last
break to its end at once and carries on with the rest in a new segment
(``minicpmo/step/text_intake.py``).
"""

from __future__ import annotations

import re

from .base import InvalidRequestError

# Closing quotes and brackets that stay with the mark before them.
_CLOSERS = "\"'\u201d\u2019)\\]\u00bb"
_BREAK = re.compile(
    rf"[.!?;:,\u2026\u2014\u2013][{_CLOSERS}]*(?=\s|\Z)"  # marks followed by a space or the end
    r"|\n"
    rf"|[\u3002\uff01\uff1f\uff1b\uff1a\uff0c\u3001][{_CLOSERS}\u300d\u300f\uff09]*")  # full-width
MAX_CLAUSE_CHARS = 100  # a run without a break is cut after at most this many characters


class StreamedText:
    """Text fed to one streamed request; the engine takes it in order with :meth:`take`.
    ``initial_chars``: the length of the text given at submission (it counts to the limit)."""

    def __init__(self, max_chars: int, initial_chars: int = 0) -> None:
        self.pending = ""  # fed, not yet taken
        self.done = False
        self._chars = initial_chars
        self._max_chars = max_chars

    def append(self, delta: str, done: bool) -> None:
        """Add ``delta`` (and end the input if ``done``); raises :class:`InvalidRequestError`
        with code ``input_done`` after the end, ``text_too_long`` past the limit."""
        if self.done:
            raise InvalidRequestError("this request's text input is already done", "text",
                                      code="input_done")
        if self._chars + len(delta) > self._max_chars:
            raise InvalidRequestError(f"text is longer than {self._max_chars} characters", "text",
                                      code="text_too_long")
        self._chars += len(delta)
        self.pending += delta
        self.done = done

    @property
    def chars(self) -> int:
        """Characters received so far, the text given at submission included."""
        return self._chars

    def take(self) -> tuple[str, bool]:
        """The text fed since the last call, and whether the input is done."""
        text, self.pending = self.pending, ""
        return text, self.done


class ClauseFeed:
    """Streamed text as complete clauses, for engines that speak clause by clause."""

    def __init__(self, initial: str, max_chars: int) -> None:
        self.text = StreamedText(max_chars, len(initial))
        self.clauses: list[str] = []  # complete, not yet spoken
        self._partial = initial  # the clause in progress

    def take(self) -> None:
        """Move the complete clauses of the text fed so far to :attr:`clauses`."""
        text, done = self.text.take()
        complete, self._partial = complete_clauses(self._partial + text, done)
        self.clauses += complete

    def open(self) -> bool:
        """More clauses may still come."""
        return not (self.text.done and not self.text.pending and not self._partial
                    and not self.clauses)


def unknown_stream(request_id: str) -> InvalidRequestError:
    return InvalidRequestError(f"no running streamed request {request_id!r}", "request_id",
                               code="unknown_stream")


def clause_ends(text: str) -> list[int]:
    """Where the complete pieces of ``text`` (the text fed so far) end, by the module's rule:
    after each break, and within each run of more than :data:`MAX_CLAUSE_CHARS` characters
    without one, after its last whitespace in reach (a hard cut if there is none)."""
    ends, start = [], 0
    while start < len(text):
        match = _BREAK.search(text, start)
        if match is not None and match.end() - start <= MAX_CLAUSE_CHARS:
            start = match.end()
        elif len(text) - start > MAX_CLAUSE_CHARS:
            limit = start + MAX_CLAUSE_CHARS
            cut = next((i for i in range(limit, start, -1)
                        if text[i].isspace() and not text[start:i].isspace()), limit)
            start = cut
        else:
            break
        ends.append(start)
    return ends


def complete_clauses(text: str, done: bool) -> tuple[list[str], str]:
    """Split off the pieces of ``text`` that are complete (:func:`clause_ends`); with ``done``
    the rest is one too. Returns those pieces, whitespace-only ones dropped, and the
    incomplete rest."""
    clauses, start = [], 0
    for end in clause_ends(text):
        clauses.append(text[start:end])
        start = end
    rest = text[start:]
    if done:
        clauses.append(rest)
        rest = ""
    return [c for c in clauses if c.strip()], rest
