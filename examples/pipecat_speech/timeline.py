"""When the listener hears a session's audio, as Pipecat reckons its word times: the audio plays
from when it arrives, one chunk after another (no Pipecat)."""

from __future__ import annotations


class ListenerTimeline:
    """The listener's timeline (the pipeline clock, ns): chunks play back to back in real time
    from when they arrive. It keeps where the audio arrived so far ends; the audio context whose
    words are being timed and where its first chunk starts (Pipecat times a context's words from
    there); the open session's chunks (start, duration) and the seconds of its stream received.
    """

    def __init__(self) -> None:
        self.playout_end_ns = 0
        self.timed_context_id: str | None = None
        self.context_origin_ns = 0
        self.new_session()

    def new_session(self) -> None:
        self.session_playout: list[tuple[int, int]] = []
        self.session_stream_s = 0.0

    def interrupted(self) -> None:
        self.playout_end_ns = 0  # the transport drops what it had not played

    def place_chunk(self, now_ns: int, context_id: str, duration_s: float,
                    context_available: bool) -> tuple[float, float]:
        """Put a chunk of the session's audio on the timeline; returns where it starts, in
        seconds from the audio context's first chunk, and where it starts in the session's
        stream (seconds)."""
        start = max(now_ns, self.playout_end_ns)  # after a gap (the text came slower than
        self.playout_end_ns = start + int(duration_s * 1e9)  # speech) the listener waited
        if context_id != self.timed_context_id or not context_available:
            self.timed_context_id = context_id  # the context's first chunk (or it reopened:
            self.context_origin_ns = start  # Pipecat closes one that stays quiet a while)
        self.session_playout.append((start, int(duration_s * 1e9)))
        stream_offset_s = self.session_stream_s
        self.session_stream_s += duration_s
        return (start - self.context_origin_ns) / 1e9, stream_offset_s

    def played_s(self, now_ns: int) -> float:
        """Seconds of the open session's audio the listener has heard by ``now_ns``."""
        return sum(min(max(now_ns - start, 0), duration)
                   for start, duration in self.session_playout) / 1e9
