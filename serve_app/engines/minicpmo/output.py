"""Output side of the engine: decoded audio joined per stream (each stream's
:class:`~serve_app.engines.minicpmo.joiner.StreamingAudioJoiner`) and handed to its caller.

Audio a stream produced leaves as soon as no later piece can change it: chunks go into the step's
:class:`~serve_app.engines.base.Outbox`, delivered to the streams' sinks when the step ends.

The final chunk carries the stream's token usage (:func:`stream_usage`), counted where the engine
tokenizes its text: the whole text and the instructions when the request is planned (in the
caller's thread, :attr:`~.scheduler.StreamPlan.input_tokens`), streamed text as its
:class:`~.text.TextFeed` tokenizes it; its output tokens are the audio code frames the TTS
generated for it.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from ..base import AudioChunk, Outbox
from ..usage import StreamUsage
from .model.codec import SAMPLE_RATE_HZ
from .scheduler import Stream
from .speech_schedule import DecodeJob


def stream_usage(stream: Stream) -> StreamUsage:
    """The stream's usage at its end (a plan made without counts, as the golden tests' are,
    counts only its fed text)."""
    plan = stream.plan
    tokens = plan.input_tokens
    if plan.text_feed is not None:
        tokens += plan.text_feed.tokens
    return StreamUsage(input_tokens=tokens, output_tokens=stream.tts_steps)


def send(outbox: Outbox, stream: Stream, item: object) -> None:
    """Queue a chunk or the error that ends the stream for its sink."""
    outbox.put(stream.sink, stream.request_id, item)


def next_text(stream: Stream) -> str | None:
    """The text the TTS reads next: its next piece, "" when none will come, None if unknown."""
    if stream.pieces:
        return stream.pieces[0]
    return "" if stream.text_done else None


def emit(outbox: Outbox, stream: Stream, samples: np.ndarray, final: bool = False) -> None:
    """Send ``samples`` with the text spoken since the last chunk (empty chunks only if final;
    the final one carries the stream's usage)."""
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
    if len(samples):
        if stream.played_out_at is not None and stream.played_out_at < now:
            outbox.ran_dry += 1
        stream.played_out_at = (max(stream.played_out_at or now, now)
                                + len(samples) / SAMPLE_RATE_HZ)
    words = () if stream.words is None else stream.words.chunk(
        text, len(samples), next_text(stream))
    send(outbox, stream, AudioChunk(stream.request_id, samples.astype(np.float32, copy=False),
                            SAMPLE_RATE_HZ, text=text, final=final, timings_s=timings,
                            usage=stream_usage(stream) if final else None, words=words))


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
