"""AAC in ADTS frames, written by FFmpeg's AAC encoder through PyAV (the ``av`` package).

ADTS is AAC's streamable container: a 7-byte header before every AAC frame (1024 samples) and
no file header, index or trailer, so each frame can leave as soon as it is encoded and a stream
cut between two frames still plays. FFmpeg's ``adts`` muxer writes into the sink given (a
``BytesIO`` the caller drains); ``flush_packets`` makes it hand over every frame at once rather
than when its 32 KiB I/O buffer fills.

The encoder starts with 1024 samples of priming and pads the last frame, and ADTS cannot say
so: decoders give up to 2048 samples more than went in (as MP3 without a gapless tag does).

PyAV is a dependency of the service, but it is imported when a writer is made, not with this
module: a server installed without it (the GPU benchmark machine's wheels leave it out) serves
every other format and refuses ``aac`` (:func:`pyav_missing` says whether it can be encoded).
"""

from __future__ import annotations

import functools
import importlib.util
from fractions import Fraction
from typing import BinaryIO

import numpy as np

# Mono speech: FFmpeg's encoder is transparent for it well below this. It lowers the rate itself
# where the sample rate caps it (48 kb/s at 8 kHz).
AAC_BIT_RATE = 64000
AAC_FRAME_SAMPLES = 1024


@functools.cache
def pyav_missing() -> str | None:
    """Why aac cannot be encoded here (PyAV is not installed), or None if it can. Looked up
    once per process (a path search): every request's format check asks."""
    if importlib.util.find_spec("av") is None:
        return "aac needs PyAV (the av package), which this server does not have installed"
    return None


class AdtsAacWriter:
    """Mono float32 samples in, ADTS/AAC bytes written to ``sink`` as frames complete."""

    def __init__(self, sink: BinaryIO, sample_rate_hz: int,
                 bit_rate: int = AAC_BIT_RATE) -> None:
        import av

        self._av = av
        self._container = av.open(sink, mode="w", format="adts",
                                  options={"flush_packets": "1"})
        self._stream = self._container.add_stream("aac", rate=sample_rate_hz, layout="mono")
        self._stream.bit_rate = bit_rate
        self._rate = sample_rate_hz
        self._samples_in = 0

    def write(self, pcm: np.ndarray) -> None:
        """Encode samples in [-1, 1]; whole frames reach the sink, the rest waits in PyAV."""
        if not len(pcm):
            return
        frame = self._av.AudioFrame.from_ndarray(
            np.ascontiguousarray(pcm, dtype=np.float32).reshape(1, -1), format="flt",
            layout="mono")
        frame.sample_rate = self._rate
        frame.pts = self._samples_in
        frame.time_base = Fraction(1, self._rate)
        self._samples_in += len(pcm)
        self._mux(frame)

    def close(self) -> None:
        """Flush the encoder (the last, padded frame) and close the container, not the sink."""
        self._mux(None)
        self._container.close()

    def _mux(self, frame: object) -> None:
        for packet in self._stream.encode(frame):
            self._container.mux(packet)
