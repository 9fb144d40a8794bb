"""What the ingress checks and counts around every request, with no FastAPI routes in it.

- :class:`KeyRing`: the accepted API keys, from the config, an environment variable or a file,
  compared in constant time. A key is named in logs by its position only ("key#2"), never by
  any part of its value.
- :class:`StreamAdmission`: bounds on concurrent speech streams, per key (429) and per ingress
  replica (503 with ``Retry-After``).
- :class:`RequestRecord`: one log line per request with its id, mode, sizes, time to first
  byte and outcome; the request text only at debug level.
- :class:`TimedPieces`: the encoder's stream with a timeout per piece and a wall-clock limit.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, AsyncIterator

from starlette.requests import ClientDisconnect
from starlette.types import Message, Scope, Send

from serve_app.config import ApiConfig
from serve_app.errors import ApiError

logger = logging.getLogger("serve_app.requests")

REQUEST_ID_HEADER = "x-request-id"
SPEECH_ROUTES = ("/v1/audio/speech", "/v1/speech/stream")
RETRY_AFTER = {"Retry-After": "1"}


def _split_keys(text: str) -> list[str]:
    keys = []
    for line in text.splitlines():
        line = line.split("#", 1)[0]
        keys.extend(part.strip() for part in line.split(","))
    return [key for key in keys if key]


class KeyRing:
    """Accepted bearer keys; empty means the service runs without auth."""

    def __init__(self, keys: list[str]) -> None:
        # Digests of equal length: the comparison time says nothing about a key's length.
        self._digests = [hashlib.sha256(key.encode()).digest() for key in dict.fromkeys(keys)]

    @classmethod
    def from_config(cls, api: ApiConfig) -> "KeyRing":
        """Keys from ``api_key``, ``api_keys``, ``$api_keys_env`` and ``api_keys_file``.

        A configured source that yields no key is an error: the service must not silently
        start open when the operator asked for keys.
        """
        keys = ([api.api_key] if api.api_key else []) + list(api.api_keys)
        if api.api_keys_env:
            keys += _split_keys(os.environ.get(api.api_keys_env, ""))
        if api.api_keys_file:
            keys += _split_keys(Path(api.api_keys_file).read_text(encoding="utf-8"))
        if (api.api_keys_env or api.api_keys_file) and not keys:
            raise ValueError("api_keys_env/api_keys_file are set but hold no key")
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def match(self, token: str) -> int | None:
        """Index of the key equal to ``token``; every key is compared (constant time)."""
        digest = hashlib.sha256(token.encode()).digest()
        found = None
        for index, known in enumerate(self._digests):
            if hmac.compare_digest(digest, known):
                found = index
        return found

    def authenticate(self, authorization: str) -> str | None:
        """The key's log label (``key#N``), None without auth; raises 401 on a bad key."""
        if not self.enabled:
            return None
        scheme, _, token = authorization.partition(" ")
        index = self.match(token.strip()) if scheme.lower() == "bearer" else None
        if index is None:
            raise ApiError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return f"key#{index}"


class StreamAdmission:
    """Concurrent speech streams of this ingress replica, in total and per key."""

    def __init__(self, max_streams: int, max_streams_per_key: int | None) -> None:
        self.max_streams = max_streams
        self.max_streams_per_key = max_streams_per_key
        self.active = 0
        self.per_key: Counter[str] = Counter()

    def acquire(self, key: str | None) -> None:
        if (key is not None and self.max_streams_per_key is not None
                and self.per_key[key] >= self.max_streams_per_key):
            raise ApiError(429, f"this API key already has {self.max_streams_per_key} streams "
                                "open; wait for one to finish", code="too_many_streams",
                           headers=RETRY_AFTER)
        if self.active >= self.max_streams:
            raise ApiError(503, "the service is at capacity; retry shortly", code="overloaded",
                           error_type="service_unavailable", headers=RETRY_AFTER)
        self.active += 1
        if key is not None:
            self.per_key[key] += 1

    def release(self, key: str | None) -> None:
        self.active -= 1
        if key is not None:
            self.per_key[key] -= 1
            if not self.per_key[key]:
                del self.per_key[key]


class RequestRecord:
    """Watches one request's replies and logs a single summary line when it ends."""

    def __init__(self, scope: Scope, headers: dict[str, str]) -> None:
        self.started_s = time.perf_counter()
        self.method = scope["method"]
        self.path = route_path(scope)
        self.request_id = headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        self.state: dict[str, Any] = scope.setdefault("state", {})
        self.state["request_id"] = self.request_id
        self.key: str | None = None
        self.body_bytes = 0
        self.status: int | None = None
        self.error_code: str | None = None
        self.ttfb_s: float | None = None
        self.bytes_out = 0
        self.completed = False
        self.outcome: str | None = None

    def watch(self, send: Send) -> Send:
        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.status = message["status"]
            elif message["type"] == "http.response.body":
                body = message.get("body", b"")
                if body and self.ttfb_s is None:
                    self.ttfb_s = time.perf_counter() - self.started_s
                self.bytes_out += len(body)
                if not message.get("more_body", False):
                    self.completed = True
            await send(message)

        return watched

    def rejected(self, error: ApiError) -> None:
        self.error_code = error.code

    def failed(self, exc: BaseException) -> None:
        if isinstance(exc, (asyncio.CancelledError, OSError, ClientDisconnect)):
            self.outcome = "disconnected"
        else:
            self.outcome = "timeout" if isinstance(exc, StreamCut) and exc.timeout else "failed"

    def log(self) -> None:
        if self.outcome is None:
            if self.completed:
                self.outcome = "ok" if (self.status or 500) < 400 else "rejected"
            else:
                self.outcome = "disconnected"
        speech = self.state.get("speech", {})
        fields = {
            "id": self.request_id, "method": self.method, "path": self.path, "key": self.key,
            "status": self.status, "outcome": self.outcome, "code": self.error_code,
            "mode": speech.get("mode"), "format": speech.get("format"),
            "rate": speech.get("sample_rate_hz"), "text_chars": speech.get("text_chars"),
            "body_bytes": self.body_bytes, "bytes_out": self.bytes_out,
            "ttfb_ms": None if self.ttfb_s is None else round(self.ttfb_s * 1000, 1),
            "duration_ms": round((time.perf_counter() - self.started_s) * 1000, 1),
        }
        line = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
        level = logging.ERROR if self.outcome in ("failed", "timeout") else logging.INFO
        logger.log(level, "request %s", line)


def route_path(scope: Scope) -> str:
    """The path below the app's route prefix (Serve may or may not strip it)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):] or "/"
    return path


class StreamCut(RuntimeError):
    """A stream ended with an error after its headers were sent (the body is cut short)."""

    def __init__(self, reason: str, timeout: bool = False) -> None:
        super().__init__(reason)
        self.timeout = timeout


class TimedPieces:
    """The encoder's pieces, each within ``piece_timeout_s``, all before ``deadline_s``.

    Any failure (timeout, wall-clock limit, a dead replica upstream) is logged with the request
    id and raised as :class:`StreamCut`; ``cancel`` stops the upstream stream.
    """

    def __init__(self, pieces: Any, request_id: str, piece_timeout_s: float,
                 max_stream_s: float, started_s: float) -> None:
        self._pieces = pieces
        self._request_id = request_id
        self._piece_timeout_s = piece_timeout_s
        self._max_stream_s = max_stream_s
        self._deadline_s = started_s + max_stream_s

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        remaining_s = self._deadline_s - time.perf_counter()
        if remaining_s <= 0:
            raise self._cut(f"cut at the {self._max_stream_s:g} s limit per request", True)
        try:
            return await asyncio.wait_for(self._pieces.__anext__(),
                                          min(self._piece_timeout_s, remaining_s))
        except StopAsyncIteration:
            raise
        except TimeoutError:
            raise self._cut("no audio in time", True) from None
        except Exception as exc:
            raise self._cut(f"upstream failed ({type(exc).__name__})") from None

    def _cut(self, reason: str, timeout: bool = False) -> StreamCut:
        logger.error("request %s: stream cut: %s", self._request_id, reason)
        return StreamCut(reason, timeout)

    def cancel(self) -> None:
        self._pieces.cancel()
