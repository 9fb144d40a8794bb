"""One admitted Piper stream's bookkeeping, and turning a step's audio for it into its next
:class:`AudioChunk` (the ``max_audio_s`` budget, the final flag, timings and usage)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from serve_app.engines.base import AudioChunk, OutputSink, SpeechRequest
from serve_app.engines.faults import FaultInjection
from serve_app.engines.piper.piper_text import Scales
from serve_app.engines.streamed_text import ClauseFeed
from serve_app.engines.usage import usage_in_characters
from serve_app.engines.words import WordTime


class PieceAudio(NamedTuple):
    """A piece's audio, and its words as (word, first sample, end sample) in that audio."""

    samples: np.ndarray
    words: tuple[tuple[str, int, int], ...] = ()


@dataclass
class PiperStream:
    request: SpeechRequest
    scales: Scales
    submitted_at_s: float
    sink: OutputSink  # where its chunks go (Engine.submit_to)
    pieces: deque | None = None  # phoneme-id pieces still to synthesize; None before phonemizing
    fed: ClauseFeed | None = None  # streamed input; its clauses are phonemized by the worker
    samples_emitted: int = 0
    started: bool = False
    chunks_sent: int = 0
    not_before_s: float = 0.0  # fault injection: not scheduled again before this time
    paced_until_s: float = 0.0  # paced_lead_s: not scheduled again before this time
    first_audio_s: float | None = None  # time.monotonic() of its first chunk with audio

    def has_work(self) -> bool:
        """Something to synthesize, or the final chunk to send; False while waiting for text."""
        return bool(self.pieces is None or self.pieces or self.fed is None or self.fed.clauses
                    or not self.fed.open())

    def waits_for_text(self, result: np.ndarray | None | BaseException) -> bool:
        """Streamed text that gave no speech this step and may still get more."""
        return bool(result is None and self.fed and self.fed.open())


def next_chunk(stream: PiperStream, result: PieceAudio | None, step_s: float,
               sample_rate_hz: int, faults: FaultInjection | None) -> AudioChunk:
    """The stream's next chunk from a step's audio (None: nothing left to say), counted on the
    stream; final when the text is all spoken or ``max_audio_s`` is reached."""
    request_id = stream.request.request_id
    samples = np.zeros(0, dtype=np.float32) if result is None else result.samples
    max_audio_s = stream.request.max_audio_s
    truncated = False
    if max_audio_s is not None:
        budget = int(max_audio_s * sample_rate_hz) - stream.samples_emitted
        truncated = len(samples) >= budget
        samples = samples[:max(budget, 0)]
    # Stream seconds; a word cut off by max_audio_s ends with the audio (one not begun is gone).
    offset = stream.samples_emitted
    words = tuple(WordTime(word, (offset + first) / sample_rate_hz,
                           (offset + min(end, len(samples))) / sample_rate_hz)
                  for word, first, end in (result.words if result is not None else ())
                  if first < len(samples))
    stream.samples_emitted += len(samples)
    stream.chunks_sent += 1
    final = truncated or not (stream.pieces or (stream.fed is not None and stream.fed.open()))
    if (not final and faults is not None
            and faults.action(stream.request.text, stream.chunks_sent) == "delay"):
        # The next chunk waits again.
        stream.not_before_s = time.monotonic() + faults.delay_s
    timings = {"step_s": step_s}
    if not stream.started:
        stream.started = True
        timings["first_chunk_s"] = time.perf_counter() - stream.submitted_at_s
    usage = None
    if final:
        chars = stream.fed.text.chars if stream.fed is not None else len(stream.request.text)
        usage = usage_in_characters(chars, stream.request.system_prompt, stream.samples_emitted,
                                    sample_rate_hz)
    return AudioChunk(request_id=request_id, samples=samples, sample_rate_hz=sample_rate_hz,
                      final=final, timings_s=timings, usage=usage, words=words)
