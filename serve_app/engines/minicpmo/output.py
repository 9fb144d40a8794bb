"""Output side of the engine: decoded audio joined per stream and handed to its caller.

Audio a stream produced leaves as soon as no later piece can change it: chunks go into the step's
:class:`~serve_app.engines.base.Outbox`, delivered to the streams' sinks when the step ends.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from ..base import AudioChunk, Outbox
from .codec import OVERLAP_SAMPLES, SAMPLE_RATE_HZ
from .speech_schedule import DecodeJob

if TYPE_CHECKING:
    from .scheduler import Stream


def send(outbox: Outbox, stream: Stream, item: object) -> None:
    """Queue a chunk or the error that ends the stream for its sink."""
    outbox.put(stream.sink, stream.request_id, item)


def emit(outbox: Outbox, stream: Stream, samples: np.ndarray, final: bool = False) -> None:
    """Send ``samples`` with the text spoken since the last chunk (empty chunks only if final)."""
    if len(samples) == 0 and not final:
        return
    now = time.perf_counter()
    timings = {}
    if stream.first_audio_at is None and len(samples):
        stream.first_audio_at = now
        timings["ttfb_s"] = now - stream.submitted_at
    if final:
        timings.update(total_s=now - stream.submitted_at, tts_steps=float(stream.tts_steps),
                       llm_tokens=float(stream.llm_tokens))
    text = stream.schedule.text_since_emit if stream.schedule is not None else ""
    if stream.schedule is not None:
        stream.schedule.text_since_emit = ""
    stream.chunks_sent += 1
    send(outbox, stream, AudioChunk(stream.request_id, samples.astype(np.float32, copy=False),
                            SAMPLE_RATE_HZ, text=text, final=final, timings_s=timings))


def join_decoded(outbox: Outbox, decoded: Sequence[tuple[Stream, DecodeJob, np.ndarray]],
                 jobs: Sequence[tuple[Stream, DecodeJob]]) -> None:
    """Join each decoded piece into its stream's audio and send what is final; then close the
    segments that ``jobs`` end (all of this step's jobs, decoded or empty)."""
    for stream, job, audio in decoded:
        if job.segment_start:
            tail = stream.joiner.finish()
            if len(tail):
                emit(outbox, stream, tail)
            stream.joiner.reset()
        emit(outbox, stream, stream.joiner.push(audio))
    for stream, job in jobs:
        if job.last_of_segment and not stream.done:
            tail = stream.joiner.finish()
            stream.joiner.reset()
            if len(tail):
                emit(outbox, stream, tail)


class StreamingAudioJoiner:
    """Joins one stream's decoded pieces into a gap-free waveform (docs/minicpmo.md,
    "Codes to audio").

    Contract, per TTS segment:

    - Piece k > 0 must start with the audio of the stream's last ``min(4, frames so far)``
      code frames re-decoded as context, i.e. exactly :attr:`held_samples` samples
      (2048 once the segment has 4 frames); the first piece has no context.
    - Those leading samples are crossfaded linearly with the held tail: the new piece's weight at
      overlap sample j of n is (j + 1) / (n + 1) (n = 2048: (j + 1) / 2049, as upstream).
    - :meth:`push` returns at once every sample that no later piece can change: all but the last
      ``min(2048, samples so far)`` of the joined stream. :meth:`finish` returns that held tail
      and starts a new segment: the next piece is emitted as is, without crossfade. (Upstream's
      first piece of a continuation segment re-decodes the 4 frames before it; they play twice.)
    - :meth:`reset` drops the held tail (abort) and starts a new segment.

    The concatenation of everything returned equals upstream's streamed waveform (up to float
    rounding of the crossfade), with less delay: upstream holds a whole piece back.
    """

    def __init__(self, overlap_samples: int = OVERLAP_SAMPLES) -> None:
        self.overlap_samples = overlap_samples
        self._tail = np.zeros(0, dtype=np.float32)

    @property
    def held_samples(self) -> int:
        """Samples held back, which the next piece must repeat as its leading context."""
        return len(self._tail)

    def push(self, piece: np.ndarray | torch.Tensor) -> np.ndarray:
        """Add a decoded piece (1-D float); returns the samples that are now final (float32)."""
        if isinstance(piece, torch.Tensor):
            piece = piece.detach().to("cpu", torch.float32).numpy()
        piece = np.asarray(piece, dtype=np.float32)
        if piece.ndim != 1:
            raise ValueError(f"piece must be 1-D, got shape {piece.shape}")
        overlap = len(self._tail)
        if len(piece) < overlap:
            raise ValueError(f"piece of {len(piece)} samples is shorter than its "
                             f"{overlap}-sample context")
        if overlap:
            fade_in = np.arange(1, overlap + 1, dtype=np.float32) / np.float32(overlap + 1)
            blended = self._tail * (np.float32(1) - fade_in) + piece[:overlap] * fade_in
            joined = np.concatenate([blended, piece[overlap:]])
        else:
            joined = piece
        cut = max(len(joined) - self.overlap_samples, 0)
        self._tail = joined[cut:].copy()
        return joined[:cut].copy()

    def finish(self) -> np.ndarray:
        """Return the held tail and start a new segment (next piece not crossfaded)."""
        tail, self._tail = self._tail, np.zeros(0, dtype=np.float32)
        return tail

    def reset(self) -> None:
        """Drop the held tail and start a new segment."""
        self._tail = np.zeros(0, dtype=np.float32)
