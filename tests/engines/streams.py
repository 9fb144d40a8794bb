"""Helpers for tests that read engine streams."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.engines.base import InvalidRequestError, SpeechRequest

# feed_text's errors over a streamed request's life, as :func:`feed_error_codes` meets them
FEED_ERROR_CODES = ["unknown_stream", "unknown_stream", "text_too_long", "input_done",
                    "unknown_stream"]


async def drain(stream) -> tuple[int, BaseException | None]:
    """Read a stream to its end: how many chunks came, and the error that ended it (if any)."""
    chunks = 0
    try:
        async for _ in stream:
            chunks += 1
    except Exception as exc:
        return chunks, exc
    return chunks, None


def error_code(call) -> str:
    with pytest.raises(InvalidRequestError) as caught:
        call()
    return caught.value.code


async def feed_error_codes(engine, whole: SpeechRequest, streamed: SpeechRequest) -> list[str]:
    """Feed text where it is refused: an unknown id, a whole-text request, past the 4096
    character limit, after ``done``, after the stream finished."""
    rid = streamed.request_id
    codes = [error_code(lambda: engine.feed_text("nobody", "text"))]
    (whole_stream,) = engine.submit([whole])
    codes.append(error_code(lambda: engine.feed_text(whole.request_id, "more")))
    (stream,) = engine.submit([streamed])
    codes.append(error_code(lambda: engine.feed_text(rid, "x" * 4096)))
    engine.feed_text(rid, " The end.", done=True)
    codes.append(error_code(lambda: engine.feed_text(rid, "after")))
    await asyncio.gather(drain(whole_stream), drain(stream))
    codes.append(error_code(lambda: engine.feed_text(rid, "late")))
    return codes


async def finish_while_one_waits(engine, waiting: SpeechRequest, other: SpeechRequest, text: str):
    """Drain ``other`` while the streamed ``waiting`` has no text, then give ``waiting`` its
    text; both drains' results."""
    (waiting_stream,) = engine.submit([waiting])
    (other_stream,) = engine.submit([other])
    other_result = await drain(other_stream)
    engine.feed_text(waiting.request_id, text, done=True)
    return other_result, await drain(waiting_stream)
