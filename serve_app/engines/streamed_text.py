"""Bookkeeping of streamed text input (``SpeechRequest.text_input == "streamed"``), shared by
the engines: what the caller has fed, whether its input is done, and the limits ``feed_text``
enforces. Each engine decides how text becomes speech."""

from __future__ import annotations

import re

from .base import InvalidRequestError

_CLAUSE_END = re.compile(r"[.!?;:\n](?=\s|$)")


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


def complete_clauses(text: str, done: bool) -> tuple[list[str], str]:
    """Split off the clauses of ``text`` that are complete: each ends at ``. ! ? ; :`` or a
    newline followed by whitespace or the end of the text so far; with ``done`` the rest is one
    too. Returns those clauses and the incomplete rest."""
    clauses, start = [], 0
    for match in _CLAUSE_END.finditer(text):
        clauses.append(text[start:match.end()])
        start = match.end()
    rest = text[start:]
    if done:
        clauses.append(rest)
        rest = ""
    return [c for c in clauses if c.strip()], rest
