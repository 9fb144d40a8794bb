"""Event bodies of the event-stream replies: OpenAI's SSE speech events and the WebSocket's.

A stream's items (from the encoder) become JSON events: an :class:`EncodedChunk` becomes a
chunk event with the text it covers and where it sits in the audio, the :class:`StreamUsage`
the closing event, an :class:`~serve_app.errors.ApiError` (or a stream cut mid-way) an ``error`` event that
ends the stream.
"""

from __future__ import annotations

import base64
import json
import logging
from typing import Any, AsyncIterator

from serve_app.errors import ApiError
from serve_app.hops import as_cancellation, is_cancellation
from serve_app.messages import EncodedChunk, StreamUsage
from serve_app.observability.metrics import IngressMetrics

logger = logging.getLogger(__name__)

SSE_MEDIA_TYPE = "text/event-stream"
SSE_DELTA = "speech.audio.delta"
SSE_DONE = "speech.audio.done"


def chunk_fields(chunk: EncodedChunk) -> dict[str, Any]:
    """What a chunk covers: its text, its start in the audio and its length (seconds), and its
    words where the request asked for them."""
    fields = {"text": chunk.text, "audio_offset_s": round(chunk.audio_offset_s, 6),
              "duration_s": round(chunk.duration_s, 6)}
    if chunk.words is not None:
        fields["words"] = [word.as_dict() for word in chunk.words]
    return fields


def error_event(message: str, code: str, error_type: str = "server_error",
                param: str | None = None) -> dict[str, Any]:
    """An ``error`` event; its ``error`` object has the keys of the JSON error replies."""
    return {"type": "error", "error": {"message": message, "type": error_type, "param": param,
                                       "code": code}}


def stream_error_event(error: ApiError) -> dict[str, Any]:
    return error_event(error.message, error.code, error.error_type, error.param)


def sse_message(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def sse_event(item: EncodedChunk | StreamUsage) -> dict[str, Any] | None:
    """The SSE event of one encoder item; None for a chunk with neither audio nor text."""
    if isinstance(item, StreamUsage):
        return {"type": SSE_DONE, "usage": item.as_dict()}
    if not item.data and not item.text and not item.words:
        return None
    return {"type": SSE_DELTA, "audio": base64.b64encode(item.data).decode("ascii"),
            **chunk_fields(item)}


async def sse_body(first: Any, pieces: AsyncIterator[Any], upstream: Any, request_id: str,
                   metrics: IngressMetrics) -> AsyncIterator[bytes]:
    """The SSE reply: a delta per chunk, then ``speech.audio.done``; a failure after the first
    event is an ``error`` event, and the stream ends there."""
    finished = False
    metrics.stream_started()
    try:
        items = _chain(first, pieces)
        while True:
            try:
                item = await anext(items)
            except StopAsyncIteration:
                break
            except Exception as exc:  # a cut stream (timeout, dead replica): say so, then end
                if is_cancellation(exc):  # the client left
                    raise as_cancellation(exc) from exc
                logger.error("stream %s failed mid-way (%s)", request_id, type(exc).__name__)
                metrics.error("stream_cut", "mid_stream")
                yield sse_message(error_event("speech synthesis failed mid-way", "stream_cut"))
                return
            if isinstance(item, ApiError):
                logger.error("stream %s failed mid-way: %s", request_id, item.code)
                metrics.error(item.code, "mid_stream")
                yield sse_message(stream_error_event(item))
                return
            event = sse_event(item)
            if event is not None:
                yield sse_message(event)
        finished = True
    finally:
        metrics.stream_ended()
        if not finished:
            upstream.cancel()


async def _chain(first: Any, pieces: Any) -> AsyncIterator[Any]:
    if first:
        yield first
    async for piece in pieces:
        yield piece
