"""The audio in a reply of OpenAI's speech events (``stream_format: sse``), read as it arrives.

The body is ``data: {json}`` events, each ended by a blank line: ``speech.audio.delta`` with the
audio in base64 (and ``words`` when the request asked for word timestamps), then
``speech.audio.done``, or an ``error`` event that ends the stream. :class:`SseAudio` takes the
body's pieces as they come and hands back the audio bytes of the events each piece completes, so
a load test times the first audio byte and counts audio as it would on the plain stream; it
keeps count of the words, and of how the stream ended.
"""

from __future__ import annotations

import base64
import json
from typing import Any

DELTA = "speech.audio.delta"
DONE = "speech.audio.done"


class SseAudio:
    """Feed the body's pieces in order to :meth:`audio_of`."""

    def __init__(self) -> None:
        self._pending = bytearray()
        self.events = 0  # delta events read
        self.words = 0  # word entries over all delta events
        self.done = False  # speech.audio.done came
        self.error: str | None = None  # an error event's error, as JSON

    def audio_of(self, piece: bytes) -> bytes:
        """The audio of the events ``piece`` completes, joined (empty if it completes none, or
        none of them carries audio); the start of an event it leaves open waits for the next."""
        self._pending += piece
        audio = bytearray()
        while (end := self._pending.find(b"\n\n")) >= 0:
            block = bytes(self._pending[:end])
            del self._pending[:end + 2]
            for line in block.splitlines():
                if line.startswith(b"data:"):
                    self._take(json.loads(line[len(b"data:"):]), audio)
        return bytes(audio)

    def _take(self, event: dict[str, Any], audio: bytearray) -> None:
        kind = event.get("type")
        if kind == DELTA:
            self.events += 1
            audio += base64.b64decode(event.get("audio") or "")
            self.words += len(event.get("words") or ())
        elif kind == DONE:
            self.done = True
        elif kind == "error":
            self.error = json.dumps(event.get("error"))[:300]

    def failure(self) -> str | None:
        """Why the stream failed, once its body ended: an error event, or no done event."""
        if self.error is not None:
            return f"error event: {self.error}"
        if not self.done:
            return f"events ended without {DONE}"
        return None
