"""Reading a served stream back into samples (the CLI client and the tests), no Ray import."""

from __future__ import annotations

import io

import numpy as np
import soundfile as sf

_BLOCK_FRAMES = 8192


def read_stream(data: bytes) -> tuple[np.ndarray, int]:
    """Float32 samples (first channel) and sample rate of a complete wav/mp3/opus/flac stream.

    Frames are pulled through libsndfile's frame reader: the served FLAC says "length unknown"
    in its header, and soundfile's read() fails on the seek it makes after the last block.
    """
    with sf.SoundFile(io.BytesIO(data)) as handle:
        channels = handle.channels
        block = np.zeros(_BLOCK_FRAMES * channels, dtype=np.float32)
        pieces = []
        while True:
            got = sf._snd.sf_readf_float(handle._file, sf._ffi.cast("float *", block.ctypes.data),
                                         _BLOCK_FRAMES)
            if got <= 0:
                break
            pieces.append(block[:got * channels].reshape(got, channels)[:, 0].copy())
        samples = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
        return samples, handle.samplerate
