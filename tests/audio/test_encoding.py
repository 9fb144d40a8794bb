"""Round trips of the streaming encoder for every format and sample rate."""

from __future__ import annotations

import io
import struct
import subprocess
import sys

import numpy as np
import pytest
import soxr

from serve_app.audio import (
    FORMATS,
    SAMPLE_RATES_HZ,
    StreamEncoder,
    check_format_rate,
    float_to_pcm16,
    playable,
    wav_stream_header,
)
from tests.audio.decoding import decode_audio as decode

NATIVE_RATE_HZ = 22050
MP3_FRAME_SAMPLES = 1152
# AAC in ADTS: 1024 samples of encoder priming and the last frame's padding stay in (no tag
# can say otherwise), so up to two frames more than went in.
AAC_SLACK_SAMPLES = 2 * 1024
# Uneven chunk sizes, as an engine delivers them.
CHUNK_SIZES = (1000, 7000, 333, 12000, 1717)

PAIRS = [(fmt, rate) for fmt in FORMATS for rate in SAMPLE_RATES_HZ
         if check_format_rate(fmt, rate) is None]


def _signal(seconds: float = 1.5) -> np.ndarray:
    t = np.arange(int(seconds * NATIVE_RATE_HZ)) / NATIVE_RATE_HZ
    tone = 0.4 * np.sin(2 * np.pi * 220 * t) + 0.2 * np.sin(2 * np.pi * 1330 * t)
    return (tone * np.minimum(1.0, t * 8)).astype(np.float32)


def _encode(signal: np.ndarray, audio_format: str, rate: int) -> tuple[bytes, list[bytes]]:
    encoder = StreamEncoder(audio_format, NATIVE_RATE_HZ, rate)
    pieces, start = [], 0
    for index in range(1000):
        size = CHUNK_SIZES[index % len(CHUNK_SIZES)]
        if start >= len(signal):
            break
        pieces.append(encoder.encode(signal[start:start + size]))
        start += size
    pieces.append(encoder.finish())
    return b"".join(pieces), pieces


@pytest.mark.parametrize(("audio_format", "rate"), PAIRS)
def test_round_trip_duration_and_rate(audio_format: str, rate: int) -> None:
    signal = _signal()
    data, _ = _encode(signal, audio_format, rate)
    samples, decoded_rate = decode(data, audio_format, rate)
    expected = len(signal) * rate / NATIVE_RATE_HZ
    assert decoded_rate == rate
    if audio_format == "mp3":
        # No gapless tag in a stream: the encoder's delay and last-frame padding remain.
        assert expected <= len(samples) <= expected + 3 * MP3_FRAME_SAMPLES
    elif audio_format == "aac":
        assert expected <= len(samples) <= expected + AAC_SLACK_SAMPLES
    else:
        assert abs(len(samples) - expected) <= 2
    assert np.sqrt(np.mean(samples ** 2)) > 0.1


@pytest.mark.parametrize("rate", SAMPLE_RATES_HZ)
@pytest.mark.parametrize("audio_format", ["pcm", "wav", "flac"])
def test_lossless_formats_equal_the_resampled_signal(audio_format: str, rate: int) -> None:
    signal = _signal()
    data, _ = _encode(signal, audio_format, rate)
    samples, _ = decode(data, audio_format, rate)
    reference = signal if rate == NATIVE_RATE_HZ else soxr.resample(
        signal, NATIVE_RATE_HZ, rate, quality="HQ")
    size = min(len(samples), len(reference))
    # int16 quantisation plus chunked-vs-whole resampling.
    assert np.max(np.abs(samples[:size] - reference[:size])) < 2e-3


def test_native_rate_pcm_is_bit_exact() -> None:
    signal = _signal()
    data, _ = _encode(signal, "pcm", NATIVE_RATE_HZ)
    assert data == float_to_pcm16(signal).tobytes()


@pytest.mark.parametrize("audio_format", ["wav", "pcm", "mp3", "aac"])
def test_first_chunk_yields_bytes_at_once(audio_format: str) -> None:
    encoder = StreamEncoder(audio_format, NATIVE_RATE_HZ, 24000)
    assert len(encoder.encode(_signal(0.5))) > 0


def test_wav_header_is_streamable() -> None:
    header = wav_stream_header(16000)
    assert len(header) == 44
    assert header[:4] == b"RIFF" and header[8:12] == b"WAVE"
    assert struct.unpack("<I", header[4:8])[0] == 0xFFFFFFFF
    assert struct.unpack("<I", header[40:44])[0] == 0xFFFFFFFF
    assert struct.unpack("<I", header[24:28])[0] == 16000


@pytest.mark.parametrize("rate", [22050, 44100])
def test_opus_rejects_rates_it_cannot_encode(rate: int) -> None:
    assert "opus" in (check_format_rate("opus", rate) or "")
    with pytest.raises(ValueError):
        StreamEncoder("opus", NATIVE_RATE_HZ, rate)


def test_unknown_format_and_rate_are_rejected() -> None:
    assert check_format_rate("m4a", 24000) is not None
    assert check_format_rate("wav", 12345) is not None


def test_empty_stream_is_still_a_valid_file() -> None:
    for audio_format in FORMATS:
        encoder = StreamEncoder(audio_format, NATIVE_RATE_HZ, 24000)
        data = encoder.encode(np.zeros(0, np.float32)) + encoder.finish()
        if audio_format != "pcm":
            samples, _ = decode(data, audio_format, 24000)
            assert len(samples) <= 3 * MP3_FRAME_SAMPLES


@pytest.mark.parametrize("audio_format", FORMATS)
def test_non_finite_and_out_of_range_samples_never_abort_the_encoder(audio_format: str) -> None:
    # LAME aborts its whole process on such input; each format runs in a process of its own so
    # a regression fails this test instead of killing the test run.
    script = (
        "import numpy as np\n"
        "from serve_app.audio import StreamEncoder\n"
        f"encoder = StreamEncoder({audio_format!r}, 24000, 24000)\n"
        "rng = np.random.default_rng(0)\n"
        "chunks = [np.full(4800, np.nan), np.full(4800, np.inf), -np.full(4800, np.inf),\n"
        "          rng.standard_normal(4800) * 1e6, rng.standard_normal(4800) * 0.1]\n"
        "data = b''.join(encoder.encode(c.astype(np.float32)) for c in chunks)\n"
        "data += encoder.finish()\n"
        "print(len(data))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert int(result.stdout) > 0


def test_encoder_input_is_silenced_where_not_finite_and_clipped_to_full_scale() -> None:
    pcm = playable(np.array([np.nan, np.inf, -np.inf, 3.0, -2.0, 0.25], dtype=np.float32))
    assert pcm.tolist() == [0.0, 1.0, -1.0, 1.0, -1.0, 0.25]


def test_only_raw_sample_formats_skip_the_codec_thread() -> None:
    """The front (Ingress) casts pcm and wav on its event loop; a libsndfile codec must go to a
    worker thread (it takes milliseconds per chunk), so it must never count as light."""
    light = {fmt for fmt in FORMATS if StreamEncoder(fmt, 24000, 24000).light}
    assert light == {"pcm", "wav"}


def _adts_frame_lengths(data: bytes) -> list[int]:
    """The length of each ADTS frame in ``data`` (asserting it is nothing but whole frames)."""
    lengths, start = [], 0
    while start < len(data):
        header = data[start:start + 7]
        assert header[0] == 0xFF and header[1] & 0xF6 == 0xF0, f"no ADTS sync at {start}"
        length = ((header[3] & 0x03) << 11) | (header[4] << 3) | (header[5] >> 5)
        assert length > 7
        lengths.append(length)
        start += length
    assert start == len(data), "a frame runs past the piece"
    return lengths


@pytest.mark.parametrize("rate", SAMPLE_RATES_HZ)
def test_aac_streams_as_whole_adts_frames_each_playable_on_arrival(rate: int) -> None:
    """Each piece the encoder hands out is whole ADTS frames (so a player can start on the
    first and a stream cut after any piece is still a valid file), and the audio leaves as it
    comes: finish() holds no more than the encoder keeps back (its priming frame, one frame of
    lookahead, the last partial frame) and the resampler's last samples."""
    signal = _signal()
    _, pieces = _encode(signal, "aac", rate)
    frames = [_adts_frame_lengths(piece) for piece in pieces]
    assert len(frames[-1]) <= 4
    assert sum(len(lengths) for lengths in frames[:-1]) > 0
    # A player told the stream is audio/aac (FFmpeg's "aac" demuxer reads ADTS) plays the
    # first piece that arrives on its own.
    import av

    first = next(piece for piece in pieces if piece)
    with av.open(io.BytesIO(first), format="aac") as container:
        played = sum(frame.samples for frame in container.decode(audio=0))
    assert played == len(_adts_frame_lengths(first)) * 1024


def test_aac_is_refused_with_a_reason_where_pyav_is_not_installed() -> None:
    """The service without PyAV (the ``av`` package) says so for aac and serves the rest."""
    script = (
        "import sys\n"
        "sys.modules['av'] = None  # Python's own way to make a package absent\n"
        "from serve_app.audio import check_format_rate, format_unavailable\n"
        "print(check_format_rate('aac', 24000))\n"
        "print(format_unavailable('mp3'), check_format_rate('mp3', 24000))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    aac_line, mp3_line = result.stdout.splitlines()
    assert "PyAV" in aac_line and "av" in aac_line
    assert mp3_line == "None None"
