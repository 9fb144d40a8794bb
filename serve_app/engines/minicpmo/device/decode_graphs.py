"""DVAE + Vocos decode of every piece length, captured as CUDA graphs per batch bucket.

Almost every generate call decodes 25 new frames with 4 frames of context (29 frames); the
decode is a few hundred small kernels, so on a GPU it is bound by launches, not math. A
stream's last piece has any length up to that; decoded eagerly, steps with 2-8 such pieces
spent 43-133 ms decoding and emitting on an H100 at 256-448 read streams
(docs/benchmarks/README.md), so those lengths have graphs too, for fewer pieces at once.
Longer pieces fall back to the eager :meth:`SpeechDecoder.decode`. :func:`queue_decode` runs
either and sends the audio to the host (:class:`DecodedAudio`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..model.codec import NUM_CODEBOOKS, SpeechDecoder
from .graphs import bucket_sizes, capture_per_bucket
from .transfer import HostCopy, to_device


class DecodeGraphs:
    """Graphs for one piece length (``frames``); see :class:`MultiLengthDecodeGraphs`."""

    def __init__(self, decoder: SpeechDecoder, frames: int, max_batch: int) -> None:
        self.decoder = decoder
        self.frames = frames
        device = decoder.device
        self.codes = torch.zeros(max_batch, frames, NUM_CODEBOOKS, dtype=torch.long, device=device)
        self.buckets = bucket_sizes(max_batch)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _forward(self, bucket: int) -> torch.Tensor:
        return self.decoder.mel_to_audio(self.decoder.codes_to_mel(self.codes[:bucket]))

    def capture_all(self, pool: object = None) -> object:
        """Capture every bucket (into ``pool`` when given); returns the graphs' memory pool."""
        self.graphs = capture_per_bucket(self.buckets, self._forward, pool=pool)
        return self.graphs[self.buckets[0]][0].pool()

    def decode_batch(self, codes: torch.Tensor) -> torch.Tensor:
        """Like :meth:`SpeechDecoder.decode_batch` for pieces of ``frames`` frames, ``codes``
        [B, frames, 4]: a graph replay per group of up to the largest bucket."""
        parts: list[torch.Tensor] = []
        largest = self.buckets[-1]
        for start in range(0, codes.shape[0], largest):
            group = codes[start:start + largest]
            count = group.shape[0]
            bucket = next(b for b in self.buckets if b >= count)
            self.codes[:count] = to_device(group, self.codes.device)
            graph, out = self.graphs[bucket]
            graph.replay()
            parts.append(out[:count].clone())  # the next replay reuses the output buffer
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class MultiLengthDecodeGraphs:
    """Graphs for every piece length from 1 to ``longest`` frames: the ``common`` lengths (25
    frames: a stream's first call; 29: every later call, with 4 frames of context) for up to
    ``max_batch`` pieces at once, the others (a stream's last piece) for up to ``rare_batch``
    (more replay in groups). Longer pieces decode eagerly. The graphs share one memory pool:
    they replay one at a time, and each replay's output is copied out before the next."""

    def __init__(self, decoder: SpeechDecoder, common: Sequence[int], longest: int,
                 max_batch: int, rare_batch: int = 8) -> None:
        self.decoder = decoder
        self.by_length = {n: DecodeGraphs(decoder, n, max_batch if n in common
                                          else min(rare_batch, max_batch))
                          for n in range(1, max(longest, *common) + 1)}

    def capture_all(self) -> None:
        pool = None
        for length in sorted(self.by_length, reverse=True):  # the largest activations first
            pool = self.by_length[length].capture_all(pool)

    def captured(self, frames: int) -> bool:
        """Pieces of ``frames`` frames replay a graph (others decode eagerly)."""
        return frames in self.by_length

    def decode_batch(self, codes: torch.Tensor) -> torch.Tensor:
        """:meth:`SpeechDecoder.decode_batch`, by a graph where one has ``codes``' length."""
        frames = codes.shape[1]
        if self.captured(frames):
            return self.by_length[frames].decode_batch(codes)
        return self.decoder.decode_batch(codes)


def queue_decode(decoder: SpeechDecoder | MultiLengthDecodeGraphs,
                 frames: Sequence[Sequence[Sequence[int]]]) -> DecodedAudio:
    """Queue DVAE + Vocos for each piece's code frames, the pieces of one length as one batch
    (one tensor of codes in, one of audio out: a step's ~200 pieces cost a few host calls, not a
    few per piece), and one device-to-host copy of all the audio; :meth:`DecodedAudio.wait` gives
    each piece as float32 audio."""
    by_length: dict[int, list[int]] = {}
    for index, piece in enumerate(frames):
        by_length.setdefault(len(piece), []).append(index)
    waves: list[torch.Tensor] = []
    spans: list[tuple[int, int]] = [(0, 0)] * len(frames)
    end = 0
    for length, indices in by_length.items():
        codes = torch.from_numpy(np.asarray([frames[i] for i in indices], dtype=np.int64)
                                 .reshape(len(indices), length, NUM_CODEBOOKS))
        wave = decoder.decode_batch(codes)  # [pieces, samples]
        width = wave.shape[1]
        for row, index in enumerate(indices):
            spans[index] = (end + row * width, end + (row + 1) * width)
        end += width * len(indices)
        waves.append(wave.reshape(-1))
    flat = (torch.cat(waves) if len(waves) > 1 else waves[0]).float() if waves else torch.zeros(0)
    return DecodedAudio(HostCopy(flat), spans)


class DecodedAudio:
    """Decoded pieces on their way to the host (:func:`queue_decode`)."""

    def __init__(self, audio: HostCopy, spans: Sequence[tuple[int, int]]) -> None:
        self._audio = audio
        self._spans = spans  # each piece's samples in the audio

    def wait(self) -> list[np.ndarray]:
        flat = self._audio.wait().numpy()
        return [flat[start:end] for start, end in self._spans]
