"""Audio seconds counted from streamed bytes, however the body is cut into pieces."""

from __future__ import annotations

import numpy as np
import pytest

from loadtest.audio_bytes import AudioCounter
from serve_app.audio import StreamEncoder


def _pieces(data: bytes, rng: np.random.Generator) -> list[bytes]:
    cuts = sorted(rng.integers(0, len(data), size=12).tolist())
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]


@pytest.mark.parametrize("audio_format, rate_hz", [("wav", 16000), ("wav", 24000),
                                                   ("pcm", 24000)])
def test_counts_the_encoders_output_exactly(audio_format: str, rate_hz: int) -> None:
    rng = np.random.default_rng(0)
    encoder = StreamEncoder(audio_format, 22050, rate_hz)
    body = b"".join(encoder.encode(rng.standard_normal(4410).astype(np.float32) * 0.1)
                    for _ in range(10)) + encoder.finish()
    counter = AudioCounter(audio_format, rate_hz)
    for piece in _pieces(body, rng):
        counter.feed(piece)
    assert counter.body_bytes == len(body)
    assert counter.audio_s == pytest.approx(encoder.samples_out / rate_hz)
    assert counter.audio_s == pytest.approx(2.0, abs=0.01)


def test_wav_rate_comes_from_the_header() -> None:
    encoder = StreamEncoder("wav", 22050, 8000)
    body = encoder.encode(np.zeros(22050, dtype=np.float32)) + encoder.finish()
    counter = AudioCounter("wav", 48000)  # the header's 8000 Hz wins over the guess
    counter.feed(body)
    assert counter.audio_s == pytest.approx(1.0, abs=0.01)


def test_header_alone_is_no_audio_and_garbage_is_refused() -> None:
    counter = AudioCounter("wav", 16000)
    counter.feed(b"RIFF\xff\xff\xff\xffWAVEfmt ")
    assert counter.audio_s == 0.0
    with pytest.raises(ValueError):
        AudioCounter("wav", 16000).feed(b"<html>not audio</html>")
    with pytest.raises(ValueError):
        AudioCounter("mp3", 16000)
