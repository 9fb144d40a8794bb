"""Opening a speech stream on the synthesizer and encoding it, for the HTTP routes and the
WebSocket alike: the front's one hop.

The front calls ``Synthesizer.synthesize`` with ``.options(stream=True)`` and, per engine chunk,
resamples and encodes it here (:class:`~serve_app.audio.StreamEncoder`), so the bytes leave for
the socket in the process that received the request: no encoder hop between the front and the
GPU replica, and the GPU replica never spends time on codecs.

The first item decides the outcome: an :class:`~serve_app.errors.ApiError` (refused or failed
before any audio) is raised, so the caller can still answer with the right status; anything else
is returned with the rest of the stream, each engine chunk within its timeout
(:mod:`serve_app.hops`). The first chunk is encoded and handed on the moment it arrives. A
cancelled stream (the client left) raises ``asyncio.CancelledError``, whatever form Ray gave the
cancellation, so a hang-up never reads as a failed synthesizer.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from serve_app.audio import StreamEncoder
from serve_app.config import ApiConfig
from serve_app.errors import ApiError
from serve_app.hops import HOP_MARGIN_S, as_cancellation, is_cancellation, relay_error, within
from serve_app.engines.words import WordTime
from serve_app.messages import EncodedChunk, EncodeJob, StreamUsage, TextInputOpen
from serve_app.observability.metrics import EncoderMetrics

StreamItem = bytes | EncodedChunk | StreamUsage | TextInputOpen | ApiError


async def open_stream(synthesizer: DeploymentHandle, job: EncodeJob, api: ApiConfig,
                      metrics: EncoderMetrics
                      ) -> tuple[Any, AsyncIterator[StreamItem], DeploymentResponseGenerator]:
    """Start ``job`` on the synthesizer; returns its first encoded item (``b""`` if it sent
    none), the rest (each engine chunk within its timeout, ``api.max_stream_s`` in all) and the
    upstream (to cancel: that aborts the engine stream)."""
    upstream: DeploymentResponseGenerator = (
        synthesizer.synthesize.options(stream=True).remote(job.request))
    chunks = within(upstream, api.first_chunk_timeout_s + HOP_MARGIN_S,
                    api.chunk_timeout_s + HOP_MARGIN_S, api.max_stream_s)
    pieces = encoded(chunks, job, metrics)
    try:
        first = await anext(pieces)
    except StopAsyncIteration:
        first = b""
    except BaseException:
        upstream.cancel()
        raise
    if isinstance(first, ApiError):
        upstream.cancel()
        raise first
    return first, pieces, upstream


class WordsByChunk:
    """Hands each encoded chunk the words whose audio starts in it: the resampler may hold a
    word's first samples back until the next engine chunk, so words wait here until the audio
    the encoder has taken in reaches them (the tail takes the rest)."""

    def __init__(self) -> None:
        self._waiting: list[WordTime] = []

    def add(self, words: tuple[WordTime, ...]) -> None:
        self._waiting.extend(words)

    def until(self, end_s: float | None) -> tuple[WordTime, ...]:
        """The waiting words that start before ``end_s`` (None: all of them)."""
        count = len(self._waiting) if end_s is None else next(
            (i for i, word in enumerate(self._waiting) if word.start_s >= end_s),
            len(self._waiting))
        taken, self._waiting = self._waiting[:count], self._waiting[count:]
        return tuple(taken)


def _chunk(encoder: StreamEncoder, samples_before: int, data: bytes, text: str,
           timings_s: dict[str, float] | None = None,
           words: tuple[WordTime, ...] | None = None) -> EncodedChunk:
    """An event chunk whose offset and duration are those of the audio the encoder took in for
    it, at the output rate: what the bytes carry (pcm and wav exactly; a codec's frames may
    leave a call later). The engine chunk's own duration is not: the resampler holds back a few
    milliseconds of each chunk (a stream's last ones leave with ``finish``, the tail) and changes
    sample counts."""
    rate = encoder.output_rate_hz
    return EncodedChunk(data, text, samples_before / rate,
                        (encoder.samples_out - samples_before) / rate, timings_s or {}, words)


async def _off_loop(encoder: StreamEncoder, work: Any, *args: Any) -> bytes:
    """``work(*args)`` on the loop for a light format (a cast), in a worker thread for a codec."""
    return work(*args) if encoder.light else await asyncio.to_thread(work, *args)


async def encoded(chunks: AsyncIterator[Any], job: EncodeJob, metrics: EncoderMetrics
                  ) -> AsyncIterator[StreamItem]:
    """The synthesizer's items with each ``AudioChunk`` resampled and encoded: bytes (with
    ``job.events``: an :class:`EncodedChunk` per engine chunk, then the :class:`StreamUsage`).
    A refused or failed stream ends with an :class:`ApiError` item."""
    started_s = time.perf_counter()
    encoder: StreamEncoder | None = None
    usage: StreamUsage | None = None
    words = WordsByChunk() if job.events and job.request.word_times else None
    try:
        async for item in chunks:
            if isinstance(item, ApiError):
                yield item
                return
            if isinstance(item, StreamUsage):
                usage = item  # sent after the encoder's tail: it closes the stream
                continue
            if isinstance(item, TextInputOpen):
                yield item  # the caller feeds the stream's text to that replica
                continue
            if encoder is None:
                encoder = StreamEncoder(job.audio_format, item.sample_rate_hz,
                                        job.sample_rate_hz)
            # Codecs take milliseconds per chunk: they run in a worker thread so the event loop
            # stays free for other streams. Raw samples are cast here, sparing the handoff.
            encode_started_s = time.perf_counter()
            before = encoder.samples_out
            data = await _off_loop(encoder, encoder.encode, item.samples)
            metrics.chunk(item.timings_s, time.perf_counter() - encode_started_s)
            if job.events:
                chunk_words = None
                if words is not None:
                    words.add(item.words)
                    chunk_words = words.until(encoder.samples_out / encoder.output_rate_hz)
                yield _chunk(encoder, before, data, item.text, item.timings_s, chunk_words)
            elif data:
                yield data
        audio_s = 0.0
        if encoder is not None:
            before = encoder.samples_out
            tail = await _off_loop(encoder, encoder.finish)
            rest = words.until(None) if words is not None else None
            if tail or rest:
                yield _chunk(encoder, before, tail, "", None, rest) if job.events else tail
            audio_s = encoder.samples_out / encoder.output_rate_hz
        if job.events and usage is not None:
            yield usage
        metrics.stream_finished(job.audio_format, audio_s, time.perf_counter() - started_s)
    except Exception as exc:
        if is_cancellation(exc):  # the client left: Serve cancelled the synthesizer call
            raise as_cancellation(exc) from exc
        yield relay_error(job.request.request_id, "the synthesizer", exc)
