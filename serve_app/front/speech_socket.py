"""``WS /v1/audio/speech/stream``: text in as a voice agent's LLM produces it, audio out as ready.

Protocol (JSON text messages, binary audio frames):

- client ``{"type": "session.start", "voice", "response_format", "sample_rate", "instructions",
  "timestamp_granularities", "api_key"}`` (every field optional; ``api_key`` where no
  ``Authorization`` header could be sent) -> server ``session.started``;
- client ``input_text.delta`` (``delta``: text to append), ``input_text.done`` (no more text),
  ``cancel`` (stop now; a closed socket does the same; ``played_s``, optional: the seconds of
  audio the client played) -> server ``response.cancelled`` (with ``played_s`` and
  ``spoken_text``, the words whose audio ended by then, where the cancel gave ``played_s``);
- server, per engine chunk: an ``audio.chunk`` event (the text it covers, its audio offset and
  duration, its byte count, timings; with ``timestamp_granularities: ["word"]`` its ``words``)
  followed by that many bytes in one binary frame; at the end ``response.done`` with ``usage``;
  ``error`` events (``error``: message, type, param, code).

A bad message gets an ``error`` event and the session goes on; a failed stream, a cancel, the
idle limit (``api.ws_idle_timeout_s`` without a message while input is open) or the total limit
(``api.max_stream_s``) ends it and the socket closes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from serve_app.audio import AudioFormat, check_format_rate, format_unavailable
from serve_app.config import ApiConfig
from serve_app.engines.base import SpeechRequest
from serve_app.engines.words import WordTime, spoken_by
from serve_app.errors import ApiError
from serve_app.front.events import chunk_fields, error_event, stream_error_event
from serve_app.front.guard import KeyRing, StreamAdmission
from serve_app.hops import as_cancellation, in_time, is_cancellation
from serve_app.messages import EncodedChunk, EncodeJob, StreamUsage, TextInputOpen
from serve_app.front.schemas import MAX_INSTRUCTIONS_CHARS, TimestampGranularities, no_nul
from serve_app.front.socket_channel import (
    CLOSE_ERROR,
    CLOSE_NORMAL,
    CLOSE_POLICY,
    SessionEnd,
    SocketChannel,
    api_error_event,
    bad_message,
)
from serve_app.front.stream_open import open_stream
from serve_app.voices.store import resolve_voice

logger = logging.getLogger(__name__)

router = APIRouter()
ROUTE = "/v1/audio/speech/stream"


class SessionStart(BaseModel):
    """The first message of a session."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["session.start"]
    model: str | None = None
    voice: str = "alloy"
    response_format: AudioFormat = "pcm"
    sample_rate: int = 24000
    instructions: str | None = Field(None, max_length=MAX_INSTRUCTIONS_CHARS)
    timestamp_granularities: TimestampGranularities = None
    api_key: str | None = None

    _instructions_no_nul = field_validator("instructions")(no_nul)


class SpeechSession(SocketChannel):
    """One socket's session: opens the stream, feeds it text, relays its audio and events."""

    def __init__(self, socket: WebSocket) -> None:
        super().__init__(socket, uuid.uuid4().hex)
        state = socket.app.state
        self.api: ApiConfig = state.api_config
        self.keys: KeyRing = state.keys
        self.admission: StreamAdmission = state.admission
        self.encoder_metrics = state.encoder_metrics
        self.synthesizer = state.synthesizer
        self.metrics = state.metrics
        self.voice_store = state.voice_store
        self.engine_info = state.engine_info  # the Ingress's (cached after its first answer)
        self.key: str | None = None  # the API key's log label, once authenticated
        self.replica_id: str | None = None
        self.text_inbox: Any = None  # the stream's replica's TextInbox (a Ray actor handle)
        self.upstream: Any = None  # the synthesizer stream: cancelled when the session ends
        self.text_chars, self.input_done = 0, False
        self.first_delta_s: float | None = None
        self.words_sent: list[WordTime] | None = None  # word times on: sent so far (spoken_text)

    # ---- session start ---------------------------------------------------------------------

    async def start(self) -> SessionStart:
        """Wait for a valid ``session.start`` (bad ones get error events); check auth."""
        while True:
            body = await self.receive(self.api.ws_idle_timeout_s)
            if body is None:
                continue
            if body["type"] != "session.start":
                await self.send(bad_message("the first message must be session.start",
                                             "session_not_started", "type"))
                continue
            try:
                start = SessionStart.model_validate(body)
            except ValidationError as exc:
                first = exc.errors()[0]
                param = ".".join(str(part) for part in first.get("loc", ())) or None
                await self.send(bad_message(f"invalid value for {param}: {first['msg']}",
                                             "invalid_value", param))
                continue
            problem = self.check(start)
            if problem is not None:
                await self.send(problem)
                continue
            return start

    def check(self, start: SessionStart) -> dict[str, Any] | None:
        """Auth and limits of a ``session.start``: an error event, or None."""
        header = self.socket.headers.get("authorization", "")
        try:
            self.key = self.keys.authenticate(header or f"Bearer {start.api_key or ''}")
        except ApiError as error:
            raise SessionEnd(api_error_event(error), CLOSE_POLICY) from None
        problem = format_unavailable(start.response_format)
        if problem is not None:
            return bad_message(problem, "unsupported_format", "response_format")
        problem = check_format_rate(start.response_format, start.sample_rate)
        if problem is not None:
            return bad_message(problem, "unsupported_sample_rate", "sample_rate")
        if start.instructions and len(start.instructions) > self.api.max_instructions_chars:
            return bad_message(f"instructions is longer than {self.api.max_instructions_chars} "
                                "characters", "string_too_long", "instructions")
        return None

    async def open(self, start: SessionStart) -> Any:
        try:
            # As on the HTTP routes: a stored voice must be the caller's key's (else 404), any other
            # name the engine's or an alias (else 400).
            voice = await resolve_voice(self.voice_store, self.keys.owner(self.key), start.voice,
                                        self.api.voice_aliases, await self.engine_info())
            request = SpeechRequest(request_id=self.request_id, text="", voice=voice,
                                    text_input="streamed", max_audio_s=self.api.max_audio_s,
                                    system_prompt=start.instructions or None,
                                    word_times=bool(start.timestamp_granularities))
            job = EncodeJob(request=request, audio_format=start.response_format,
                            sample_rate_hz=start.sample_rate, events=True)
            first, pieces, self.upstream = await open_stream(self.synthesizer, job, self.api,
                                                             self.encoder_metrics)
        except ApiError as error:
            raise SessionEnd(api_error_event(error), CLOSE_NORMAL) from None
        if not isinstance(first, TextInputOpen):
            self.upstream.cancel()
            logger.error("session %s: stream opened without its replica", self.request_id)
            raise SessionEnd(error_event("speech synthesis failed", "synthesis_failed"),
                             CLOSE_ERROR)
        self.replica_id, self.text_inbox = first.replica_id, first.text_inbox
        if start.timestamp_granularities:
            self.words_sent = []
        return pieces

    # ---- text in ---------------------------------------------------------------------------

    async def read_text(self) -> None:
        """Client messages until cancel (or disconnect); feeds the text to the stream."""
        while True:
            body = await self.receive(None if self.input_done else self.api.ws_idle_timeout_s)
            if body is None:
                continue
            kind = body["type"]
            if kind == "cancel":
                played_s = body.get("played_s")
                if played_s is not None and not _seconds(played_s):
                    await self.send(bad_message("played_s must be a number of seconds, 0 or "
                                                "more", "invalid_value", "played_s"))
                    continue
                raise SessionEnd(self.cancelled(played_s))
            if kind == "input_text.delta":
                await self.delta(body.get("delta"))
            elif kind == "input_text.done":
                if self.input_done:
                    await self.send(bad_message("input is already done", "input_done"))
                    continue
                self.input_done = True
                await self.feed("", done=True)
            else:
                await self.send(bad_message(f"unknown message type {kind!r}", "unknown_type",
                                             "type"))

    def cancelled(self, played_s: float | None) -> dict[str, Any]:
        """``response.cancelled``; given ``played_s``, the text of the words heard by then
        (None without word times: the session did not ask for them)."""
        event: dict[str, Any] = {"type": "response.cancelled"}
        if played_s is not None:
            event["played_s"] = played_s
            event["spoken_text"] = (None if self.words_sent is None else " ".join(
                word.word for word in spoken_by(self.words_sent, played_s)))
        return event

    async def delta(self, text: Any) -> None:
        if not isinstance(text, str):
            await self.send(bad_message("delta must be a string", "invalid_value", "delta"))
        elif "\x00" in text:
            await self.send(bad_message("delta must not contain NUL characters", "invalid_value",
                                         "delta"))
        elif self.input_done:
            await self.send(bad_message("input is already done: no more text", "input_done",
                                         "delta"))
        elif len(text) > self.api.max_text_delta_chars:
            await self.send(bad_message(f"delta is longer than {self.api.max_text_delta_chars} "
                                         "characters", "delta_too_long", "delta"))
        elif self.text_chars + len(text) > self.api.max_input_chars:
            await self.send(bad_message(f"the text would pass {self.api.max_input_chars} "
                                         "characters", "text_too_long", "delta"))
        elif text:
            if self.first_delta_s is None:
                self.first_delta_s = time.perf_counter()
            self.text_chars += len(text)
            await self.feed(text)

    async def feed(self, delta: str, done: bool = False) -> None:
        """Send text to the stream's replica, through its text inbox: a plain Ray actor call,
        which Serve neither queues nor refuses when the replica is full or drains
        (:mod:`serve_app.gpu.text_inbox`). The engine's refusal is an error event; a lost
        replica ends the session. A cancel (the session ends) is raised even when the answer
        came with it (:func:`~serve_app.hops.in_time`)."""
        call = self.text_inbox.put.remote(self.request_id, delta, done)
        try:
            refused = await in_time(call, self.api.handle_timeout_s)
        except Exception as exc:
            if is_cancellation(exc):  # the session is ending
                raise as_cancellation(exc) from exc
            logger.error("session %s: text not delivered to replica %s (%s)", self.request_id,
                         self.replica_id, type(exc).__name__)
            raise SessionEnd(error_event("the speech stream is gone", "stream_lost",
                                         "service_unavailable"), CLOSE_ERROR) from None
        if isinstance(refused, ApiError):
            await self.send(stream_error_event(refused))

    # ---- audio out -------------------------------------------------------------------------

    async def write_audio(self, pieces: Any) -> None:
        """Relay the stream's chunks; ends the session when the stream ends."""
        try:
            async for item in pieces:
                if isinstance(item, EncodedChunk):
                    await self.send(self.chunk_event(item), item.data)
                    if item.words is not None and self.words_sent is not None:
                        self.words_sent.extend(item.words)
                elif isinstance(item, StreamUsage):
                    raise SessionEnd({"type": "response.done", "usage": item.as_dict()})
                elif isinstance(item, ApiError):
                    raise SessionEnd(stream_error_event(item), CLOSE_ERROR)
        except (SessionEnd, WebSocketDisconnect):  # ended, or the client left while we sent
            raise
        except Exception as exc:  # a cut stream: timeout, total limit, dead replica
            if is_cancellation(exc):  # the session is ending
                raise as_cancellation(exc) from exc
            logger.error("session %s: stream cut (%s)", self.request_id, type(exc).__name__)
            raise SessionEnd(error_event(str(exc) or "speech synthesis failed", "stream_cut"),
                             CLOSE_ERROR) from None
        raise SessionEnd({"type": "response.done", "usage": None})

    def chunk_event(self, chunk: EncodedChunk) -> dict[str, Any]:
        timings = {"engine_s": chunk.timings_s}
        if self.first_delta_s is not None:
            timings["since_first_delta_s"] = round(time.perf_counter() - self.first_delta_s, 6)
        return {"type": "audio.chunk", **chunk_fields(chunk), "bytes": len(chunk.data),
                "timings": timings}

    # ---- the whole session -----------------------------------------------------------------

    async def run(self) -> None:
        admitted = False
        close_code = CLOSE_NORMAL
        try:
            start = await self.start()
            try:
                self.admission.acquire(self.key)
            except ApiError as error:
                raise SessionEnd(api_error_event(error), CLOSE_POLICY) from None
            admitted = True
            self.metrics.stream_started()
            pieces = await self.open(start)
            await self.send({"type": "session.started", "session_id": self.request_id,
                             "response_format": start.response_format,
                             "sample_rate": start.sample_rate})
            await self.relay(pieces)
        except SessionEnd as end:
            close_code = end.close_code
            if end.event is not None and not await self.send_last(end.event):
                close_code = None
        except WebSocketDisconnect:
            close_code = None
        finally:
            if self.upstream is not None:
                self.upstream.cancel()  # no-op once finished; else it frees the engine slot now
            if admitted:
                self.metrics.stream_ended()
                self.admission.release(self.key)
        if close_code is not None:
            await self.send_last(None, close_code)

    async def relay(self, pieces: Any) -> None:
        """Text in and audio out at once; whichever ends the session first stops the other.

        The other is cancelled and awaited before this returns, so whatever it raised on its way
        out (a cancelled Serve call raises its own exception) is read here, never left to
        asyncio's "Task exception was never retrieved"."""
        tasks = [asyncio.create_task(self.read_text()), asyncio.create_task(self.write_audio(pieces))]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            ended = await asyncio.gather(*tasks, return_exceptions=True)
        for task, outcome in zip(tasks, ended):
            if task in done and isinstance(outcome, BaseException):
                raise outcome  # the SessionEnd (or disconnect) that ended the session


def _seconds(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value >= 0)


@router.websocket(ROUTE)
async def speech_socket(socket: WebSocket) -> None:
    """Text in as it is produced, audio out as it is ready (module docstring: the protocol)."""
    await socket.accept()
    session = SpeechSession(socket)
    try:
        await session.run()
    except WebSocketDisconnect:
        pass
    except Exception as exc:
        if is_cancellation(exc):  # the client left
            raise as_cancellation(exc) from exc
        logger.exception("session %s failed", session.request_id)
        await session.send_last(None, CLOSE_ERROR)
