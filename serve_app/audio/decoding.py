"""Reading a served stream back into samples (the CLI client and the tests), no Ray import."""

from __future__ import annotations

import io

import numpy as np
import soundfile as sf

_BLOCK_FRAMES = 8192


def read_stream(data: bytes) -> tuple[np.ndarray, int]:
    """Float32 samples (first channel) and sample rate of a complete wav/mp3/opus/flac/aac stream.

    Frames are pulled through libsndfile's frame reader: the served FLAC says "length unknown"
    in its header, and soundfile's read() fails on the seek it makes after the last block.
    libsndfile has no AAC: what it cannot open is read by FFmpeg through PyAV (``av``), if
    installed.
    """
    try:
        handle = sf.SoundFile(io.BytesIO(data))
    except sf.LibsndfileError:
        return _read_with_pyav(data)
    with handle:
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


def _read_with_pyav(data: bytes) -> tuple[np.ndarray, int]:
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        # Planar float whatever the decoder gives: row 0 is the first channel.
        to_float = av.AudioResampler(format="fltp")
        pieces = [converted.to_ndarray()[0] for frame in container.decode(stream)
                  for converted in to_float.resample(frame)]
        pieces += [converted.to_ndarray()[0] for converted in to_float.resample(None)]
        rate = stream.rate
    samples = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
    return samples.astype(np.float32, copy=False), rate
