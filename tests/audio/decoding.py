"""Decoding served audio back to samples with soundfile (shared by audio and serving tests)."""

from __future__ import annotations

import io

import numpy as np
import soundfile as sf


def decode_audio(data: bytes, audio_format: str, sample_rate_hz: int) -> tuple[np.ndarray, int]:
    """Decode a served stream to float32 mono samples and its sample rate.

    ``pcm`` is raw s16le at ``sample_rate_hz``. FLAC streams say "length unknown" in their
    header, and soundfile's read() then fails on the seek it makes after the last block, so
    FLAC is read through libsndfile's frame reader directly.
    """
    if audio_format == "pcm":
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767.0, sample_rate_hz
    if audio_format == "flac":
        with sf.SoundFile(io.BytesIO(data)) as handle:
            blocks = []
            block = np.zeros(4096, dtype=np.float32)
            while True:
                frames = sf._snd.sf_readf_float(handle._file,
                                                sf._ffi.cast("float *", block.ctypes.data),
                                                len(block))
                if frames <= 0:
                    break
                blocks.append(block[:frames].copy())
            samples = np.concatenate(blocks) if blocks else np.zeros(0, np.float32)
            return samples, handle.samplerate
    samples, rate = sf.read(io.BytesIO(data), dtype="float32")
    return samples.reshape(-1), rate
