"""Decoding served audio back to samples (shared by audio and serving tests)."""

from __future__ import annotations

import numpy as np

from serve_app.audio.decoding import read_stream


def decode_audio(data: bytes, audio_format: str, sample_rate_hz: int) -> tuple[np.ndarray, int]:
    """Decode a served stream to float32 mono samples and its sample rate (``pcm``: raw s16le at
    ``sample_rate_hz``)."""
    if audio_format == "pcm":
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767.0, sample_rate_hz
    return read_stream(data)
