"""The speech socket's wire (``WS /v1/audio/speech/stream``, :mod:`serve_app.front.speech_socket`):
JSON events out, each with its binary frame, one at a time; JSON messages in, a bad one answered
with an ``error`` event; the session's last event or close; and how a session ends."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from fastapi import WebSocket, WebSocketDisconnect

from serve_app.errors import ApiError
from serve_app.front.events import error_event
from serve_app.hops import in_time

logger = logging.getLogger("serve_app.front.speech_socket")  # the session's log, as before

# Close codes (RFC 6455): normal, policy violation (auth), internal error.
CLOSE_NORMAL, CLOSE_POLICY, CLOSE_ERROR = 1000, 1008, 1011


class SessionEnd(Exception):
    """Ends the session: ``event`` (if any) is sent, then the socket closes with ``close_code``."""

    def __init__(self, event: dict[str, Any] | None, close_code: int = CLOSE_NORMAL) -> None:
        super().__init__(event)
        self.event = event
        self.close_code = close_code


def api_error_event(error: ApiError) -> dict[str, Any]:
    """The ``error`` event of an ApiError; a refusal for load (503, 429) also says when to try
    again (``retry_after_s``: what an HTTP answer's ``Retry-After`` says)."""
    event = error_event(error.message, error.code or "invalid_request", error.error_type,
                        error.param)
    retry_after = (error.headers or {}).get("Retry-After")
    if retry_after is not None:
        event["error"]["retry_after_s"] = float(retry_after)
    return event


def bad_message(message: str, code: str, param: str | None = None) -> dict[str, Any]:
    return error_event(message, code, "invalid_request_error", param)


class SocketChannel:
    """One session's socket: sends events (with their frames) one at a time, reads messages."""

    def __init__(self, socket: WebSocket, request_id: str) -> None:
        self.socket = socket
        self.request_id = request_id
        self.send_lock = asyncio.Lock()

    async def send(self, event: dict[str, Any], data: bytes | None = None) -> None:
        """One event (and its binary frame) at a time: reader and writer both send."""
        async with self.send_lock:
            await self.socket.send_text(json.dumps(event, separators=(",", ":")))
            if data:
                await self.socket.send_bytes(data)

    async def receive(self, timeout_s: float | None) -> dict[str, Any] | None:
        """The next JSON message; None (after an error event) for one that is not. A cancel
        (the session ends) is raised even when a message came with it."""
        try:
            message = await in_time(self.socket.receive(), timeout_s)
        except TimeoutError:
            raise SessionEnd(bad_message(f"no message for {timeout_s:g} s", "idle_timeout"),
                             CLOSE_POLICY) from None
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", CLOSE_NORMAL))
        if message.get("text") is None:
            await self.send(bad_message("messages must be JSON text, not binary", "binary_message"))
            return None
        try:
            body = json.loads(message["text"])
        except (ValueError, RecursionError):  # RecursionError: nested too deep to parse
            await self.send(bad_message("message is not valid JSON", "invalid_json"))
            return None
        if not isinstance(body, dict) or not isinstance(body.get("type"), str):
            await self.send(bad_message("message must be a JSON object with a type", "invalid_json",
                                        "type"))
            return None
        return body

    async def send_last(self, event: dict[str, Any] | None,
                        close_code: int | None = None) -> bool:
        """The session's last event, or its close; False when the client has already left (a
        ``cancel`` followed at once by a close, say): its choice, logged at INFO."""
        try:
            if close_code is None:
                await self.send(event)
            else:
                await self.socket.close(close_code)
        except Exception as exc:  # the socket is gone: whatever the server layer raises
            logger.info("session %s: the client left before the %s (%s)", self.request_id,
                        "close" if event is None else repr(event.get("type")),
                        type(exc).__name__)
            return False
        return True
