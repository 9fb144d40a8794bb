"""What the ingress checks and counts around every request, with no FastAPI routes in it.

- :class:`RequestGuard`: the ASGI middleware that runs the checks below before any parsing.
- :class:`KeyRing`: the accepted API keys, from the config, an environment variable or a file,
  compared in constant time. A key is named in logs by its position only ("key#2"), never by
  any part of its value; the voices it creates belong to a hash of it (its owner id).
- :class:`StreamAdmission`: bounds on concurrent speech streams, per key (429) and per ingress
  replica (503 with ``Retry-After``).
- :class:`RequestRecord`: one log line per request with its id, mode, sizes, time to first
  byte and outcome; the request text only at debug level.
- :func:`json_error`: an :class:`~serve_app.errors.ApiError` as the JSON reply, counted.
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
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve_app import errors
from serve_app.config import ApiConfig
from serve_app.errors import ApiError
from serve_app.hops import StreamTimeout, as_cancellation, is_cancellation
from serve_app.observability.gc_pauses import log_pauses
from serve_app.voices.clip import SHARED_OWNER, owner_of_key

logger = logging.getLogger("serve_app.requests")

REQUEST_ID_HEADER = "x-request-id"
SPEECH_ROUTES = ("/v1/audio/speech", "/v1/speech/stream")
VOICES_ROUTE = "/v1/audio/voices"
JSON_MEDIA_TYPE = "application/json"
MULTIPART_MEDIA_TYPE = "multipart/form-data"


def _split_keys(text: str) -> list[str]:
    keys = []
    for line in text.splitlines():
        line = line.split("#", 1)[0]
        keys.extend(part.strip() for part in line.split(","))
    return [key for key in keys if key]


class KeyRing:
    """Accepted bearer keys; empty means the service runs without auth."""

    def __init__(self, keys: list[str]) -> None:
        unique = list(dict.fromkeys(keys))
        # Digests of equal length: the comparison time says nothing about a key's length.
        self._digests = [hashlib.sha256(key.encode()).digest() for key in unique]
        self._owners = [owner_of_key(key) for key in unique]

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

    def owner(self, label: str | None) -> str:
        """The owner id of the voices of the key labelled ``label`` (``authenticate``'s
        answer); every caller shares one owner when the service runs without keys."""
        if label is None:
            return SHARED_OWNER
        return self._owners[int(label.removeprefix("key#"))]


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
                                "open; wait for one to finish", code="too_many_streams")
        if self.active >= self.max_streams:
            raise errors.overloaded()
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
        if is_cancellation(exc) or isinstance(exc, (OSError, ClientDisconnect)):
            self.outcome = "disconnected"
        else:
            self.outcome = "timeout" if isinstance(exc, StreamTimeout) else "failed"

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
            # a speech request's way to its first byte: the call to the synthesizer, its first
            # item back (ms since the request reached this replica)
            **{f"{name}_ms": round((speech[f"{name}_s"] - self.started_s) * 1000, 1)
               for name in ("dispatched", "first_item") if f"{name}_s" in speech},
            "duration_ms": round((time.perf_counter() - self.started_s) * 1000, 1),
            # the call's clock reading (time.perf_counter, one clock for a machine's processes):
            # the synthesizer's log line has its arrival on the same clock
            "dispatch_clock": (f"{speech['dispatched_s']:.6f}" if "dispatched_s" in speech
                               else None),
        }
        line = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
        level = logging.ERROR if self.outcome in ("failed", "timeout") else logging.INFO
        logger.log(level, "request %s", line)
        log_pauses()


def route_path(scope: Scope) -> str:
    """The path below the app's route prefix (Serve may or may not strip it)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):] or "/"
    return path


def json_error(error: ApiError, state: Any = None) -> JSONResponse:
    """The error reply, counted in the ingress metrics when ``state`` (the app's) has them."""
    metrics = getattr(state, "metrics", None)
    if metrics is not None:
        metrics.error(error.code, error.status_code)
    return JSONResponse(error.body(), status_code=error.status_code, headers=error.headers)


class RequestGuard:
    """ASGI middleware: auth, content type, body size and stream admission, checked before any
    parsing; one log line per request (:class:`RequestRecord`).

    Reads the whole (bounded, timed) POST body itself, so a chunked body without Content-Length
    is held to the same limits, then replays it to the app. A speech request holds its stream
    permit (per key and per replica) until its reply has ended. A voice upload
    (``POST /v1/audio/voices``) is multipart, up to ``max_voice_upload_bytes``, and holds one of
    the replica's ``max_voice_uploads`` permits from before its body is read (each holds its
    body in memory) until its reply. The app's ``state`` holds the ingress's ``api_config``,
    ``keys``, ``admission``, ``upload_admission`` and ``metrics``; the request's ``state``
    gets the key's label (``api_key_label``) for the routes.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope["app"].state
        api: ApiConfig = getattr(state, "api_config", None) or ApiConfig()
        keys: KeyRing | None = getattr(state, "keys", None)
        if keys is None:
            keys = KeyRing.from_config(api)
        admission: StreamAdmission | None = getattr(state, "admission", None)
        uploads: StreamAdmission | None = getattr(state, "upload_admission", None)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        record = RequestRecord(scope, headers)
        send = record.watch(send)
        try:
            await self._guarded(api, keys, admission, uploads, record, headers, scope, receive,
                                send)
        except BaseException as exc:
            record.failed(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            if is_cancellation(exc) or isinstance(exc, ClientDisconnect):
                # A hang-up, in whatever form it surfaced (Ray's TaskCancelledError through the
                # body or the replayed receive, Starlette's ClientDisconnect): raised on as the
                # cancellation it is, so that neither FastAPI's catch-all handler (a 500,
                # counted) nor Serve (an ERROR "unexpected error") takes it for a server fault.
                raise as_cancellation(exc) from exc
            raise
        finally:
            record.log()

    async def _guarded(self, api: ApiConfig, keys: KeyRing, admission: StreamAdmission | None,
                       uploads: StreamAdmission | None, record: RequestRecord,
                       headers: dict[str, str], scope: Scope, receive: Receive,
                       send: Send) -> None:
        admitted = uploading = False
        try:
            if record.path.startswith("/v1/"):
                record.key = keys.authenticate(headers.get("authorization", ""))
                record.state["api_key_label"] = record.key
            if scope["method"] == "POST":
                upload = record.path == VOICES_ROUTE
                if upload and uploads is not None:
                    uploads.acquire(None)
                    uploading = True
                try:
                    body = await asyncio.wait_for(_read_body(api, headers, receive, upload),
                                                  api.body_timeout_s)
                except TimeoutError:
                    raise ApiError(408, f"request body not received within "
                                        f"{api.body_timeout_s:g} s", code="request_timeout")
                record.body_bytes = len(body)
                receive = _replay(body, receive)
                if admission is not None and record.path in SPEECH_ROUTES:
                    admission.acquire(record.key)
                    admitted = True
        except ApiError as error:
            if uploading:
                uploads.release(None)
            record.rejected(error)
            await json_error(error, scope["app"].state)(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            if admitted:
                admission.release(record.key)
            if uploading:
                uploads.release(None)


async def _read_body(api: ApiConfig, headers: dict[str, str], receive: Receive,
                     upload: bool = False) -> bytes:
    """The whole body, within its route's media type and size limit (413, 415)."""
    media_type = headers.get("content-type", "").split(";")[0].strip().lower()
    if upload and media_type != MULTIPART_MEDIA_TYPE:
        raise ApiError(415, "a voice upload must be multipart/form-data (fields name, consent "
                            "and the file audio_sample)", code="unsupported_media_type")
    if not upload and media_type != JSON_MEDIA_TYPE:
        raise ApiError(415, "request body must be JSON (Content-Type: application/json)",
                       code="unsupported_media_type")
    limit = api.max_voice_upload_bytes if upload else api.max_body_bytes
    too_large = ApiError(413, f"request body is larger than {limit} bytes",
                         code="request_too_large")
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        body.extend(message.get("body", b""))
        if len(body) > limit:
            raise too_large
        if not message.get("more_body", False):
            break
    return bytes(body)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The buffered body once, then the real channel (so disconnects still arrive)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
