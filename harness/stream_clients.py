"""One speech stream per call, over each way the service streams, and how it ended.

- ``http``: ``POST /v1/speech/stream`` (pcm). Complete when the chunked body ends with its
  terminating chunk; a failure after the 200 cuts the body (httpx: ``RemoteProtocolError``).
- ``sse``: ``POST /v1/audio/speech`` with ``stream_format: sse``. Complete on
  ``speech.audio.done``; a failure is an ``error`` event.
- ``ws``: ``WS /v1/audio/speech/stream``: ``session.start``, the text in 500-character deltas,
  ``input_text.done``. Complete on ``response.done``; a failure is an ``error`` event.

Each stream ends as one :data:`OUTCOMES`: ``finished``; ``error_event`` (SSE or WebSocket said
it failed); ``cut`` (a plain HTTP body cut short: its way of saying so); ``refused`` (a status
other than 200, or an error before any audio); ``silent_end`` (an SSE or WebSocket stream that
ended with neither its closing event nor an error: lost silently); ``hung`` (nothing ended it
within ``give_up_s``: lost silently too). Every stream sends its request id as ``x-request-id``
(the WebSocket's on its upgrade), which Serve makes the id of its calls to the Synthesizer, so
a stream can be traced to its replica and node in the replicas' logs.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Any

import httpx
import websockets

KINDS = ("http", "sse", "ws")
OUTCOMES = ("finished", "error_event", "cut", "refused", "silent_end", "hung")
CLEAR_FAILURES = ("error_event", "cut", "refused")  # the client was told the stream failed
SILENT = ("silent_end", "hung")
PCM_BYTES_PER_S = 24000 * 2
WS_DELTA_CHARS = 500  # text in pieces, as an LLM's, each under api.max_text_delta_chars (1000)


@dataclass
class StreamOutcome:
    kind: str
    request_id: str
    start_s: float  # on the caller's clock (``clock()``)
    end_s: float | None = None
    first_audio_s: float | None = None  # on the caller's clock
    audio_s: float = 0.0
    status: int | None = None
    outcome: str = "hung"
    error: str | None = None
    session_id: str | None = None  # a WebSocket's, as the server named it

    def as_dict(self) -> dict[str, Any]:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(self).items()}


async def one_stream(kind: str, base_url: str, text: str, clock: Any,
                     give_up_s: float = 300.0, watch: dict[str, StreamOutcome] | None = None
                     ) -> StreamOutcome:
    """Stream ``text`` once over ``kind``; never raises, never waits past ``give_up_s``. With
    ``watch``, the outcome is put there under its request id at once, to follow as it goes."""
    result = StreamOutcome(kind, uuid.uuid4().hex, clock())
    if watch is not None:
        watch[result.request_id] = result
    speak = {"http": _http, "sse": _sse, "ws": _ws}[kind]
    try:
        async with asyncio.timeout(give_up_s):
            await speak(base_url, text, result, clock)
    except TimeoutError:
        result.outcome, result.error = "hung", f"nothing ended it within {give_up_s:g} s"
    except (httpx.HTTPError, OSError, websockets.WebSocketException) as exc:
        # Before the stream began (no 200 yet): the request was refused or never reached us.
        result.outcome = "refused" if result.first_audio_s is None else "silent_end"
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    result.end_s = clock()
    return result


def _audio(result: StreamOutcome, clock: Any, pcm_bytes: int) -> None:
    if pcm_bytes and result.first_audio_s is None:
        result.first_audio_s = clock()
    result.audio_s += pcm_bytes / PCM_BYTES_PER_S


@contextlib.asynccontextmanager
async def _posted(base_url: str, path: str, body: dict[str, Any], result: StreamOutcome
                  ) -> AsyncIterator[httpx.Response | None]:
    """The streamed reply to a POST, or None (the outcome set to ``refused``) if not a 200."""
    async with httpx.AsyncClient(base_url=base_url, timeout=None) as client:
        async with client.stream("POST", path, json=body,
                                 headers={"x-request-id": result.request_id}) as response:
            result.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                result.outcome, result.error = "refused", response.text[:300]
                yield None
            else:
                yield response


def _ended_by(event: dict[str, Any], done_type: str, result: StreamOutcome) -> bool:
    """Whether ``event`` closes the stream: its done event, or an error event."""
    if event.get("type") == done_type:
        result.outcome = "finished"
        return True
    if event.get("type") == "error":
        result.outcome, result.error = "error_event", json.dumps(event.get("error"))[:300]
        return True
    return False


async def _http(base_url: str, text: str, result: StreamOutcome, clock: Any) -> None:
    async with _posted(base_url, "/v1/speech/stream", {"text": text, "format": "pcm"},
                       result) as response:
        if response is None:
            return
        try:
            async for piece in response.aiter_raw():
                _audio(result, clock, len(piece))
        except httpx.HTTPError as exc:  # the body was cut short: the failure signal
            result.outcome, result.error = "cut", f"{type(exc).__name__}: {exc}"[:300]
            return
    result.outcome = "finished" if result.audio_s > 0 else "silent_end"


async def _sse(base_url: str, text: str, result: StreamOutcome, clock: Any) -> None:
    body = {"model": "tts-1", "voice": "alloy", "input": text, "response_format": "pcm",
            "stream_format": "sse"}
    async with _posted(base_url, "/v1/audio/speech", body, result) as response:
        if response is None:
            return
        try:
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[len("data: "):])
                if event.get("type") == "speech.audio.delta":
                    _audio(result, clock, len(base64.b64decode(event["audio"])))
                elif _ended_by(event, "speech.audio.done", result):
                    return
        except httpx.HTTPError as exc:
            result.error = f"{type(exc).__name__}: {exc}"[:300]
    result.outcome = "silent_end"  # ended with neither its done event nor an error event


async def _ws(base_url: str, text: str, result: StreamOutcome, clock: Any) -> None:
    url = base_url.replace("http://", "ws://", 1) + "/v1/audio/speech/stream"
    async with websockets.connect(url, max_size=None, open_timeout=60,
                                  additional_headers={"x-request-id": result.request_id}
                                  ) as socket:
        await socket.send(json.dumps({"type": "session.start", "response_format": "pcm"}))
        started = json.loads(await socket.recv())
        if started.get("type") != "session.started":
            result.outcome, result.error = "refused", json.dumps(started)[:300]
            return
        result.status = 101
        result.session_id = started["session_id"]
        for start in range(0, len(text), WS_DELTA_CHARS):
            delta = text[start:start + WS_DELTA_CHARS]
            await socket.send(json.dumps({"type": "input_text.delta", "delta": delta}))
        await socket.send(json.dumps({"type": "input_text.done"}))
        try:
            async for message in socket:
                if isinstance(message, bytes):
                    _audio(result, clock, len(message))
                elif _ended_by(json.loads(message), "response.done", result):
                    return
        except websockets.ConnectionClosed as exc:
            result.error = f"{type(exc).__name__}: {exc}"[:300]
    result.outcome = "silent_end"


def count_outcomes(streams: list[StreamOutcome]) -> dict[str, int]:
    counts = dict.fromkeys(OUTCOMES, 0)
    for stream in streams:
        counts[stream.outcome] += 1
    return counts


def monotonic_clock(t0: float | None = None) -> Any:
    """Seconds since ``t0`` (now, if not given), rounded to ms."""
    start = time.monotonic() if t0 is None else t0
    return lambda: round(time.monotonic() - start, 3)
