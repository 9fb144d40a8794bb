"""Text into TTS work: the text fed to streamed requests cut into pieces, and each stream's
waiting pieces read by its :class:`~..speech_schedule.SpeechSchedule`, which turns them into
prefills and audio steps (host work only)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from ..options import EngineOptions
from ..scheduler import Scheduler, Stream
from ..speech_schedule import Phase


class TextIntake:
    """The streams' text, as their schedules read it."""

    def __init__(self, options: EngineOptions, scheduler: Scheduler,
                 complete: Callable[[Stream], None]) -> None:
        self.options = options
        self.scheduler = scheduler
        self._complete = complete

    def take_fed_text(self) -> None:
        """Cut the text fed to streamed requests into pieces for their schedules; a stream
        whose input ended with nothing speakable ends without audio."""
        for stream in self.scheduler.running():
            feed = stream.plan.text_feed
            if feed is None or stream.text_done or stream.schedule is None:
                continue
            text, done = self.scheduler.take_fed_text(stream)
            if text:
                stream.text_at = time.monotonic()
            stream.pieces.extend(feed.push(text))
            if done:
                stream.pieces.extend(feed.finish())
                stream.text_done = True
                if not feed.speakable:
                    self._complete(stream)

    def tts_work(self, streams: Iterable[Stream]) -> list[tuple[Stream, object]]:
        """Each stream's waiting pieces fed to its schedule; the TTS work that results."""
        return [work for stream in streams for work in self._read_text(stream)]

    def _read_text(self, stream: Stream) -> list[tuple[Stream, object]]:
        """Feed the stream's waiting pieces to its schedule; the TTS work that results."""
        schedule = stream.schedule
        work: list[tuple[Stream, object]] = []
        while schedule is not None and schedule.phase is Phase.WAITING_TEXT:
            if stream.pieces:
                items = schedule.accept_piece(stream.pieces.popleft())
            elif stream.text_done:
                items = schedule.end_of_text()
            else:
                items = self._cut_stopped_text(stream)
                if not items:
                    break
            work.extend((stream, item) for item in items)
        return work

    def _cut_stopped_text(self, stream: Stream) -> list[object]:
        """Streamed text that has stopped coming (nothing for ``text_break_wait_s``) while the
        speech waits for more: speak it up to its last break now (``streamed_text``'s rule),
        rather than when ten more TTS tokens or the end of the input arrive. Not for a stream
        of fixed length, whose segments never end on their own."""
        feed, schedule = stream.plan.text_feed, stream.schedule
        if (feed is None or schedule.ignore_eos or stream.break_checked == feed.version
                or time.monotonic() - stream.text_at < self.options.text_break_wait_s):
            return []
        stream.break_checked = feed.version  # looked at: again only once more text came
        point = feed.break_point()
        work = schedule.cut_at_break(*point) if point is not None else None
        if work is None:
            return []
        feed.cut_at_break()
        return work
