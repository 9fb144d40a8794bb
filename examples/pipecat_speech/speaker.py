"""A speaker for a Pipecat pipeline that plays into a raw PCM file, in real time."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from pipecat.frames.frames import OutputAudioRawFrame, StartFrame
from pipecat.transports.base_output import BaseOutputTransport
from pipecat.transports.base_transport import TransportParams


class PcmFileOutputTransport(BaseOutputTransport):
    """A speaker that plays into a raw PCM file (s16le): each chunk takes its own duration to
    write, as on a sound card, so an interruption cuts the file where a listener stopped
    hearing, and the transport's clock releases each word as its audio is written."""

    def __init__(self, path: str | Path, params: TransportParams | None = None, **kwargs):
        # No silence after the end: a file has no device buffer to push the last words out.
        super().__init__(params or TransportParams(audio_out_enabled=True,
                                                   audio_out_end_silence_secs=0), **kwargs)
        self._path = Path(path)
        self._file = None
        self._played_bytes = 0
        self._playing_until = 0.0  # time.monotonic() when the chunk written last ends
        self._progress = asyncio.Condition()

    @property
    def played_s(self) -> float:
        """Seconds of audio played so far."""
        rate = self.sample_rate * self._params.audio_out_channels
        return self._played_bytes / (2 * rate) if rate else 0.0

    async def wait_played(self, seconds: float):
        """Return once ``seconds`` of audio have played."""
        async with self._progress:
            await self._progress.wait_for(lambda: self.played_s >= seconds)

    async def start(self, frame: StartFrame):
        await super().start(frame)
        self._file = self._path.open("wb")
        await self.set_transport_ready(frame)

    async def write_audio_frame(self, frame: OutputAudioRawFrame) -> bool:
        now = time.monotonic()
        self._playing_until = max(self._playing_until, now) + (
            frame.num_frames / frame.sample_rate)
        self._file.write(frame.audio)
        await asyncio.sleep(self._playing_until - now)
        self._played_bytes += len(frame.audio)
        async with self._progress:
            self._progress.notify_all()
        return True

    async def cleanup(self):
        await super().cleanup()
        if self._file is not None:
            self._file.close()
            self._file = None
