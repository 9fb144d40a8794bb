"""A streamed file of every format, as a client saves it, opened by common readers.

Real encoder, real decoders: soundfile (libsndfile) reading the whole file and in blocks, and
PyAV (FFmpeg). ``pcm`` has no header, so both read it as raw signed 16-bit mono. libsndfile has
no AAC at all, so ``aac`` (ADTS) is checked with PyAV only; the soundfile tests leave it out.

FLAC is sent whole (serve_app/audio/encoding.py): a FLAC sent as it was encoded had to leave
STREAMINFO's ``total_samples`` at 0 ("unknown"), which libsndfile takes for ``SF_COUNT_MAX``
frames, so ``sf.read`` and ``sf.blocks`` could not read it (nothing else in the header tripped
it). The encoder now holds the file until ``finish()`` and sends it with the true length in its
header, so every reader here opens it.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from serve_app.audio import FORMATS, StreamEncoder

if os.environ.get("CI"):
    import av  # CI installs the test extra: never skip there
else:
    av = pytest.importorskip("av")

INPUT_RATE_HZ = 22050
OUTPUT_RATE_HZ = 24000
SECONDS = 1.5
EXPECTED_FRAMES = int(SECONDS * OUTPUT_RATE_HZ)
# Uneven chunk sizes, as an engine delivers them.
CHUNK_SIZES = (1000, 7000, 333, 12000, 1717)
# MP3 keeps the encoder delay and the last frame's padding (no gapless tag in a stream); so
# does AAC in ADTS (1024 samples of priming, then the last frame padded to 1024).
MP3_SLACK_FRAMES = 3 * 1152
AAC_SLACK_FRAMES = 2 * 1024
# What libsndfile reads: every format but aac.
SOUNDFILE_FORMATS = [audio_format for audio_format in FORMATS if audio_format != "aac"]

def _signal() -> np.ndarray:
    t = np.arange(int(SECONDS * INPUT_RATE_HZ)) / INPUT_RATE_HZ
    return (0.4 * np.sin(2 * np.pi * 220 * t) * np.minimum(1.0, t * 8)).astype(np.float32)


def _stream(audio_format: str) -> list[bytes]:
    encoder = StreamEncoder(audio_format, INPUT_RATE_HZ, OUTPUT_RATE_HZ)
    signal, pieces, start, index = _signal(), [], 0, 0
    while start < len(signal):
        size = CHUNK_SIZES[index % len(CHUNK_SIZES)]
        pieces.append(encoder.encode(signal[start:start + size]))
        start, index = start + size, index + 1
    pieces.append(encoder.finish())
    return pieces


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each format's stream concatenated into a file, as ``curl -o`` leaves it."""
    folder = tmp_path_factory.mktemp("streams")
    paths = {}
    for audio_format in FORMATS:
        paths[audio_format] = folder / f"out.{audio_format}"
        paths[audio_format].write_bytes(b"".join(_stream(audio_format)))
    return paths


def _raw_args(audio_format: str) -> dict:
    if audio_format != "pcm":
        return {}
    return {"samplerate": OUTPUT_RATE_HZ, "channels": 1, "format": "RAW", "subtype": "PCM_16"}


def _check_length(audio_format: str, frames: int, rate: int) -> None:
    assert rate == OUTPUT_RATE_HZ or (audio_format == "opus" and rate == 48000)
    expected = EXPECTED_FRAMES * rate // OUTPUT_RATE_HZ
    if audio_format == "mp3":
        assert expected <= frames <= expected + MP3_SLACK_FRAMES
    elif audio_format == "aac":
        assert expected <= frames <= expected + AAC_SLACK_FRAMES
    else:
        assert abs(frames - expected) <= 2 * rate // OUTPUT_RATE_HZ


@pytest.mark.parametrize("audio_format", SOUNDFILE_FORMATS)
def test_soundfile_reads_the_whole_stream(saved: dict[str, Path], audio_format: str) -> None:
    samples, rate = sf.read(saved[audio_format], dtype="float32", **_raw_args(audio_format))
    _check_length(audio_format, len(samples), rate)
    assert np.sqrt(np.mean(samples ** 2)) > 0.1


@pytest.mark.parametrize("audio_format", SOUNDFILE_FORMATS)
def test_soundfile_reads_the_stream_in_blocks(saved: dict[str, Path], audio_format: str) -> None:
    with sf.SoundFile(saved[audio_format], **_raw_args(audio_format)) as handle:
        rate = handle.samplerate
    blocks = list(sf.blocks(saved[audio_format], blocksize=1000, dtype="float32",
                            **_raw_args(audio_format)))
    _check_length(audio_format, sum(len(block) for block in blocks), rate)


@pytest.mark.parametrize("audio_format", FORMATS)
def test_pyav_reads_the_stream(saved: dict[str, Path], audio_format: str) -> None:
    options = ({"format": "s16le", "options": {"sample_rate": str(OUTPUT_RATE_HZ),
                                               "ch_layout": "mono"}}
               if audio_format == "pcm" else {})
    with av.open(str(saved[audio_format]), **options) as container:
        frames = list(container.decode(audio=0))
    rate = frames[0].sample_rate  # FFmpeg's Opus decoder always gives 48 kHz
    _check_length(audio_format, sum(frame.samples for frame in frames), rate)


def _total_samples(flac: bytes) -> int:
    """STREAMINFO's 36-bit total_samples (0: unknown)."""
    assert flac[:4] == b"fLaC" and flac[4] & 0x7F == 0  # STREAMINFO is the first block
    return int.from_bytes(flac[8 + 10:8 + 18], "big") & ((1 << 36) - 1)


def test_flac_is_sent_whole_at_finish_with_its_true_length_in_the_header() -> None:
    pieces = _stream("flac")
    *before_finish, whole = pieces
    assert not any(before_finish), "flac bytes left before finish()"
    assert whole[:4] == b"fLaC"
    with av.open(io.BytesIO(whole)) as container:
        decoded = np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(audio=0)])
    assert _total_samples(whole) == len(decoded)
    samples, rate = sf.read(io.BytesIO(whole), dtype="int16")
    assert rate == OUTPUT_RATE_HZ
    np.testing.assert_array_equal(samples, decoded)
    blocks = list(sf.blocks(io.BytesIO(whole), blocksize=1000, dtype="int16"))
    np.testing.assert_array_equal(np.concatenate(blocks), decoded)
