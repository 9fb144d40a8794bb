"""How streams end: completed (the joiner's tail with the final chunk), failed or aborted. Each
frees the stream's slots and its voice; what it sends waits in the step's outbox, delivered
when the step ends (or when the step delivers its audio)."""

from __future__ import annotations

import numpy as np

from ...base import Outbox, RequestAbortedError
from ..options import EngineOptions
from ..output import emit, send
from ..scheduler import Scheduler, Stream
from ..speech_schedule import SpeechSchedule
from ..voices import VoiceTable


class StreamEndings:
    """Ends streams for the step thread; ``outbox`` holds the step's chunks and errors."""

    def __init__(self, options: EngineOptions, scheduler: Scheduler, voices: VoiceTable) -> None:
        self.options = options
        self.scheduler = scheduler
        self.voices = voices
        self.outbox = Outbox()  # this step's chunks and errors, delivered when it ends
        self.traces: dict[str, SpeechSchedule] = {}  # with ``keep_traces``: finished schedules

    def complete(self, stream: Stream) -> None:
        """The stream spoke all it will: its last audio and the final chunk."""
        if self.options.keep_traces and stream.schedule is not None:
            self.traces[stream.request_id] = stream.schedule
        tail = stream.joiner.finish() if stream.joiner is not None else np.zeros(0, np.float32)
        self.scheduler.release(stream)
        self._release_voice(stream)
        emit(self.outbox, stream, tail, final=True)
        stream.done = True
        self.scheduler.count(completed=1)

    def fail(self, stream: Stream, error: BaseException) -> None:
        """The stream ends with ``error`` (nothing if it has ended already)."""
        if stream.done:
            return
        self.scheduler.release(stream)
        self._release_voice(stream)
        stream.done = True
        self.scheduler.count(failed=1)
        send(self.outbox, stream, error)

    def end_aborted(self) -> None:
        """End the streams aborted since the last step (queued or running)."""
        for stream in self.scheduler.take_aborted():
            self._release_voice(stream)
            stream.done = True
            send(self.outbox, stream, RequestAbortedError("aborted"))

    def refuse_late(self, now: float, next_step: bool = False) -> None:
        """Refuse the queued streams whose first audio can no longer come in time (admission
        by work; with ``next_step``, those an admission just passed over that could not start
        in time at the next step's either): nothing was spent on them; each gets the engine's
        overload error."""
        for stream in self.scheduler.expire_waiting(now, next_step):
            self._release_voice(stream)
            stream.done = True
            send(self.outbox, stream, self.scheduler.work.refuse_waiting(stream.work))

    def time_first_audio(self, streams: list[Stream]) -> None:
        """Of ``streams``, silent before the audio just handed out, those that have their first
        audio now: how long it took after admission, for admission's queue deadline."""
        for stream in streams:
            if stream.first_audio_at is not None and stream.admitted_at is not None:
                self.scheduler.work.observe_first_audio(
                    stream.first_audio_at - stream.admitted_at, stream.plan.is_chat)

    def _release_voice(self, stream: Stream) -> None:
        """The stream no longer holds its voice (the table may drop it again)."""
        self.voices.release([stream.voice])
        stream.voice = None
