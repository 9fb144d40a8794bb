"""Streaming resample + encode of float32 mono PCM into wav, pcm, flac, mp3, Ogg/Opus or AAC.

One :class:`StreamEncoder` per stream: feed it the engine's chunks in order with
:meth:`StreamEncoder.encode` and send whatever bytes it returns at once; :meth:`StreamEncoder.finish`
flushes the resampler and the codec and returns the tail. Concatenating every returned piece gives
one valid file of the asked format.

- ``pcm``: signed 16-bit little-endian mono, no header.
- ``wav``: a 44-byte PCM header whose RIFF and data sizes are 0xFFFFFFFF (length unknown while
  streaming; players and libsndfile read to the end of the data), then 16-bit samples.
- ``mp3``, ``opus``: libsndfile (through ``soundfile``) writing into a ``BytesIO``; the bytes
  appended since the last call are returned. Codecs buffer whole frames/pages, so a call may
  return nothing; :meth:`StreamEncoder.finish` flushes them. MP3 is constant bitrate with no
  Xing/Info length tag (fixed at close, after those bytes have left), so decoders read to the
  end of the stream.
- ``aac``: AAC in ADTS frames (serve_app/audio/adts.py: FFmpeg's encoder through PyAV), written
  into a ``BytesIO`` the same way; each frame leaves once encoded. Like MP3, decoders give the
  encoder's priming and last-frame padding too (up to 2048 samples). Without PyAV installed,
  aac is refused (see :func:`check_format_rate`).
- ``flac`` is sent whole; for streaming pick pcm, wav, mp3, opus or aac. libsndfile cannot open a
  FLAC whose STREAMINFO says ``total_samples`` = 0 ("unknown", which a FLAC sent as it is
  encoded must say: its header leaves before the length is known): it takes that for
  ``SF_COUNT_MAX`` frames, so ``soundfile.read`` fails ("array is too big") and
  ``soundfile.blocks`` fails to seek, while nothing else in the header trips it
  (tests/audio/test_readers.py). So :meth:`StreamEncoder.encode` returns nothing for flac and
  :meth:`StreamEncoder.finish` returns the whole file, its header rewritten by libsndfile at
  close with the true ``total_samples`` (and MD5): every reader opens it (soundfile whole and
  in blocks, FFmpeg/PyAV, libFLAC, browsers), and an HTTP body in flac starts when synthesis
  ends.
- Opus only runs at 8, 12, 16, 24 or 48 kHz: other rates are rejected (see
  :func:`check_format_rate`) rather than silently changed.
"""

from __future__ import annotations

import io
import struct
from typing import Literal, get_args

import numpy as np
import soundfile as sf
import soxr

from serve_app.audio.adts import AdtsAacWriter, pyav_missing

AudioFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]
FORMATS: tuple[str, ...] = get_args(AudioFormat)
SAMPLE_RATES_HZ: tuple[int, ...] = (8000, 16000, 22050, 24000, 44100, 48000)
OPUS_SAMPLE_RATES_HZ: tuple[int, ...] = (8000, 12000, 16000, 24000, 48000)

CONTENT_TYPES: dict[str, str] = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg; codecs=opus",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}

# libsndfile (container, subtype) per format; wav and pcm are written directly, aac by PyAV.
_SOUNDFILE_FORMATS: dict[str, tuple[str, str]] = {
    "flac": ("FLAC", "PCM_16"),
    "mp3": ("MP3", "MPEG_LAYER_III"),
    "opus": ("OGG", "OPUS"),
}

_PCM16_SCALE = 32767.0
# libsndfile's 0 (best) .. 1 (smallest); the middle is plenty for speech.
MP3_COMPRESSION_LEVEL = 0.5
_UNKNOWN_SIZE = 0xFFFFFFFF


def format_unavailable(audio_format: str) -> str | None:
    """Why this server cannot encode a format it knows (aac without PyAV), or None."""
    return pyav_missing() if audio_format == "aac" else None


def check_format_rate(audio_format: str, sample_rate_hz: int) -> str | None:
    """Return why this format/rate pair cannot be served, or None if it can."""
    if audio_format not in FORMATS:
        return f"response format must be one of {', '.join(FORMATS)}"
    if (unavailable := format_unavailable(audio_format)) is not None:
        return unavailable
    if sample_rate_hz not in SAMPLE_RATES_HZ:
        return f"sample_rate must be one of {', '.join(map(str, SAMPLE_RATES_HZ))}"
    if audio_format == "opus" and sample_rate_hz not in OPUS_SAMPLE_RATES_HZ:
        allowed = ", ".join(str(r) for r in OPUS_SAMPLE_RATES_HZ if r in SAMPLE_RATES_HZ)
        return f"opus supports sample rates {allowed} only"
    return None


def float_to_pcm16(samples: np.ndarray) -> np.ndarray:
    """Float PCM in [-1, 1] to int16 (clipped, rounded to nearest)."""
    clipped = np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0)
    return np.rint(clipped * _PCM16_SCALE).astype("<i2")


def wav_stream_header(sample_rate_hz: int, channels: int = 1) -> bytes:
    """A 16-bit PCM WAV header for a stream of unknown length (sizes 0xFFFFFFFF)."""
    block_align = channels * 2
    fmt_chunk = struct.pack("<HHIIHH", 1, channels, sample_rate_hz,
                            sample_rate_hz * block_align, block_align, 16)
    return (b"RIFF" + struct.pack("<I", _UNKNOWN_SIZE) + b"WAVE"
            + b"fmt " + struct.pack("<I", len(fmt_chunk)) + fmt_chunk
            + b"data" + struct.pack("<I", _UNKNOWN_SIZE))


def playable(samples: np.ndarray) -> np.ndarray:
    """Mono float32 within [-1, 1], non-finite samples silenced.

    Codecs must never see anything else: LAME (mp3) aborts the whole process on NaN, infinity
    or samples far out of range, which would end every stream of the encoder replica.
    """
    pcm = np.asarray(samples, dtype=np.float32).reshape(-1)
    if not np.isfinite(pcm).all():
        pcm = np.nan_to_num(pcm, nan=0.0, posinf=1.0, neginf=-1.0)
    return np.clip(pcm, -1.0, 1.0)


class StreamEncoder:
    """Per-stream resampler + encoder; not thread-safe, one stream at a time."""

    def __init__(self, audio_format: str, input_rate_hz: int, output_rate_hz: int) -> None:
        problem = check_format_rate(audio_format, output_rate_hz)
        if problem is not None:
            raise ValueError(problem)
        self.audio_format = audio_format
        self.input_rate_hz = input_rate_hz
        self.output_rate_hz = output_rate_hz
        self.samples_out = 0
        self._resampler = (None if input_rate_hz == output_rate_hz else
                           soxr.ResampleStream(input_rate_hz, output_rate_hz, 1,
                                               dtype="float32", quality="HQ"))
        self._buffer: io.BytesIO | None = None
        # The codec's writer (into _buffer): write(samples) and close(); None for pcm and wav.
        self._file: sf.SoundFile | AdtsAacWriter | None = None
        self._sent = 0
        self._header_sent = False
        self._finished = False
        if audio_format in _SOUNDFILE_FORMATS:
            container, subtype = _SOUNDFILE_FORMATS[audio_format]
            self._buffer = io.BytesIO()
            # Constant bitrate so decoders can size an MP3 that has no length tag (soundfile
            # applies bitrate_mode only together with compression_level).
            extra = ({"compression_level": MP3_COMPRESSION_LEVEL, "bitrate_mode": "CONSTANT"}
                     if audio_format == "mp3" else {})
            self._file = sf.SoundFile(self._buffer, mode="w", samplerate=output_rate_hz,
                                      channels=1, format=container, subtype=subtype, **extra)
        elif audio_format == "aac":
            self._buffer = io.BytesIO()
            self._file = AdtsAacWriter(self._buffer, output_rate_hz)

    @property
    def light(self) -> bool:
        """Raw samples out (pcm, wav): a chunk costs a cast and at most a resample, well under
        a millisecond, so it needs no worker thread; codecs (mp3, opus, flac, aac) do."""
        return self._file is None

    def encode(self, samples: np.ndarray) -> bytes:
        """Resample and encode one chunk; returns the bytes ready to send (maybe empty)."""
        if self._finished:
            raise RuntimeError("encoder already finished")
        pcm = playable(samples)
        if self._resampler is not None:
            pcm = self._resampler.resample_chunk(pcm, last=False)
        return self._write(pcm)

    @property
    def held(self) -> bool:
        """The format is sent whole (flac): nothing before :meth:`finish`, then the file."""
        return self.audio_format == "flac"

    def finish(self) -> bytes:
        """Flush resampler and codec; returns the stream's last bytes (flac: the whole file)."""
        if self._finished:
            return b""
        tail = np.zeros(0, dtype=np.float32)
        if self._resampler is not None:
            tail = self._resampler.resample_chunk(tail, last=True)
        if self._file is not None and self.samples_out + len(tail) == 0:
            # libsndfile writes no header for an empty file (and ADTS nothing at all for no
            # samples); one silent sample keeps it a valid file.
            tail = np.zeros(1, dtype=np.float32)
        data = self._write(tail)
        self._finished = True
        if self._file is not None:
            self._file.close()  # flac: STREAMINFO rewritten with the true length
            data += self._take_new_bytes()
        return data

    def _write(self, pcm: np.ndarray) -> bytes:
        self.samples_out += len(pcm)
        if self._file is None:
            prefix = b""
            if self.audio_format == "wav" and not self._header_sent:
                prefix = wav_stream_header(self.output_rate_hz)
                self._header_sent = True
            return prefix + float_to_pcm16(pcm).tobytes()
        if len(pcm):
            self._file.write(pcm)
        return b"" if self.held else self._take_new_bytes()

    def _take_new_bytes(self) -> bytes:
        assert self._buffer is not None
        view = self._buffer.getbuffer()
        end = view.nbytes
        data = bytes(view[self._sent:end])
        view.release()
        self._sent = end
        return data
