"""How many seconds of audio a streamed body holds, counted from its bytes as they arrive.

``pcm`` is headerless 16-bit mono at a known rate; ``wav`` carries its rate and sample width in
the RIFF header, whose sizes are 0xFFFFFFFF while streaming, so the data is counted to the end
of the body instead of trusting the declared size.
"""

from __future__ import annotations

import struct


class AudioCounter:
    """Feed the body's pieces in order; ``audio_s`` is the audio received so far."""

    def __init__(self, audio_format: str, sample_rate_hz: int) -> None:
        if audio_format not in ("pcm", "wav"):
            raise ValueError(f"audio seconds are countable for pcm and wav, not {audio_format!r}")
        self.audio_format = audio_format
        self.body_bytes = 0
        self._header = bytearray()
        self._data_offset: int | None = 0 if audio_format == "pcm" else None
        self._bytes_per_s = 2 * sample_rate_hz

    def feed(self, piece: bytes) -> None:
        self.body_bytes += len(piece)
        if self._data_offset is None:
            self._header.extend(piece)
            self._parse_wav_header()

    @property
    def audio_s(self) -> float:
        if self._data_offset is None:
            return 0.0
        return max(0, self.body_bytes - self._data_offset) / self._bytes_per_s

    def _parse_wav_header(self) -> None:
        header = bytes(self._header)
        if len(header) < 12:
            return
        if header[:4] != b"RIFF" or header[8:12] != b"WAVE":
            raise ValueError("body is not a RIFF/WAVE stream")
        position = 12
        while position + 8 <= len(header):
            chunk_id = header[position:position + 4]
            (size,) = struct.unpack_from("<I", header, position + 4)
            if chunk_id == b"data":
                self._data_offset = position + 8
                self._header.clear()
                return
            if chunk_id == b"fmt ":
                if position + 8 + 16 > len(header):
                    return
                channels, rate, _, block_align = struct.unpack_from("<HIIH", header,
                                                                    position + 10)
                self._bytes_per_s = rate * block_align
                if channels < 1 or block_align < 1:
                    raise ValueError("wav header has no channels or sample width")
            position += 8 + size + (size & 1)
