"""Ingress deployment: the HTTP API (FastAPI through ``@serve.ingress``).

Routes, auth, validation and the streaming reply. Every check happens here or in the engine's
``validate`` (reached through the encoder/synthesizer stream's first item) before the engine
schedules anything, and every error leaves as OpenAI-style JSON.
"""

# No `from __future__ import annotations`: FastAPI must see real types on the routes.
import asyncio
import functools
import logging
import time
import uuid
from importlib import resources
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve_app import __version__
from serve_app.audio import CONTENT_TYPES, check_format_rate
from serve_app.config import ApiConfig
from serve_app.engines.base import SpeechRequest
from serve_app.errors import ApiError, error_body, error_response
from serve_app.events import SSE_MEDIA_TYPE, sse_body
from serve_app.guard import (
    RETRY_AFTER,
    SPEECH_ROUTES,
    KeyRing,
    RequestRecord,
    StreamAdmission,
)
from serve_app.logs import use_replica_log
from serve_app.messages import EncodeJob, EngineInfo, StreamError
from serve_app.metrics import IngressMetrics
from serve_app.schemas import NativeSpeechBody, OpenAISpeechBody
from serve_app.speech_socket import router as speech_socket_router
from serve_app.stream_open import open_stream

logger = logging.getLogger(__name__)

OPENAI_PCM_RATE_HZ = 24000
_JSON_MEDIA_TYPE = "application/json"
REQUEST_ID_HEADER = "x-request-id"


class RequestGuard:
    """ASGI middleware: auth, content type, body size and stream admission, checked before any
    parsing; one log line per request (:class:`RequestRecord`).

    Reads the whole (bounded, timed) POST body itself, so a chunked body without Content-Length
    is held to the same limits, then replays it to the app. A speech request holds its stream
    permit (per key and per replica) until its reply has ended.
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
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        record = RequestRecord(scope, headers)
        send = record.watch(send)
        try:
            await self._guarded(api, keys, admission, record, headers, scope, receive, send)
        except BaseException as exc:
            record.failed(exc)
            raise
        finally:
            record.log()

    async def _guarded(self, api: ApiConfig, keys: KeyRing, admission: "StreamAdmission | None",
                       record: RequestRecord, headers: dict[str, str], scope: Scope,
                       receive: Receive, send: Send) -> None:
        admitted = False
        try:
            if record.path.startswith("/v1/"):
                record.key = keys.authenticate(headers.get("authorization", ""))
            if scope["method"] == "POST":
                try:
                    body = await asyncio.wait_for(self._read_body(api, headers, receive),
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
            record.rejected(error)
            await _counted(scope["app"].state, error)(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            if admitted:
                admission.release(record.key)

    @staticmethod
    async def _read_body(api: ApiConfig, headers: dict[str, str], receive: Receive) -> bytes:
        media_type = headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type != _JSON_MEDIA_TYPE:
            raise ApiError(415, "request body must be JSON (Content-Type: application/json)",
                           code="unsupported_media_type")
        too_large = ApiError(413, f"request body is larger than {api.max_body_bytes} bytes",
                             code="request_too_large")
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > api.max_body_bytes:
            raise too_large
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            body.extend(message.get("body", b""))
            if len(body) > api.max_body_bytes:
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


def _counted(state: Any, error: ApiError) -> JSONResponse:
    """The error reply, counted in the metrics (when the deployment has set them up)."""
    metrics: IngressMetrics | None = getattr(state, "metrics", None)
    if metrics is not None:
        metrics.error(error.code, error.status_code)
    return error_response(error)


def _validation_error(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return ApiError(400, "malformed JSON body", code="invalid_json")
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    message = first.get("msg", "invalid request")
    if first.get("type") == "missing":
        return ApiError(400, f"missing required parameter: {param}", param=param,
                        code="missing_required_parameter")
    if first.get("type") == "model_attributes_type":
        return ApiError(400, "request body must be a JSON object", code="invalid_json")
    return ApiError(400, f"invalid value for {param}: {message}" if param else message,
                    param=param, code="invalid_value")


api_app = FastAPI(
    title="Speech serving API",
    version=__version__,
    description="Streaming text to speech on Ray Serve (OpenAI-compatible /v1/audio/speech).",
)
api_app.add_middleware(RequestGuard)
api_app.include_router(speech_socket_router)


@api_app.exception_handler(ApiError)
async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return _counted(request.app.state, exc)


@api_app.exception_handler(RequestValidationError)
async def _request_validation_error(request: Request,
                                    exc: RequestValidationError) -> JSONResponse:
    return _counted(request.app.state, _validation_error(exc))


@api_app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        error = ApiError(404, f"no route for {request.method} {request.url.path}",
                         code="not_found")
    elif exc.status_code == 405:
        error = ApiError(405, f"method {request.method} not allowed on {request.url.path}",
                         code="method_not_allowed")
    else:
        error = ApiError(exc.status_code, str(exc.detail), code="http_error")
    return _counted(request.app.state, error)


@api_app.exception_handler(Exception)
async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error in the ingress")
    _counted(request.app.state, ApiError(500, "internal server error", code="internal_error"))
    return JSONResponse(error_body(ApiError(500, "internal server error", code="internal_error",
                                            error_type="server_error")), status_code=500)


# Helpers sit above the deployment: serve.deployment pickles the class when it is decorated.
async def _body(first: bytes, pieces: DeploymentResponseGenerator, request_id: str,
                metrics: IngressMetrics) -> AsyncIterator[bytes]:
    finished = False
    metrics.stream_started()
    try:
        if first:
            yield first
        async for piece in pieces:
            if isinstance(piece, StreamError):
                # Headers are gone: cutting the chunked body short is how HTTP says "failed".
                logger.error("stream %s failed mid-way: %s", request_id, piece.code)
                metrics.error(piece.code, "mid_stream")
                raise RuntimeError("stream failed")
            yield piece
        finished = True
    finally:
        metrics.stream_ended()
        if not finished:
            pieces.cancel()


@functools.cache
def _web_page() -> str:
    """The static page (HTML, CSS and JS in one file, no external resources), read once."""
    return (resources.files("serve_app") / "web" / "index.html").read_text("utf-8")


def _request_id(http: Request) -> str:
    """Serve's proxy puts its request id (the client's, if sent) in the headers and the reply;
    RequestGuard keeps it (or one it made up) in the request state for its log line."""
    return (getattr(http.state, "request_id", None) or http.headers.get(REQUEST_ID_HEADER)
            or uuid.uuid4().hex)


def _describe(http: Request, request: SpeechRequest, audio_format: str, rate_hz: int) -> None:
    """What RequestGuard's log line says about a speech request; the text only at debug."""
    http.state.speech = {"mode": request.mode, "format": audio_format, "sample_rate_hz": rate_hz,
                         "text_chars": len(request.text)}
    logger.debug("request %s text=%r", request.request_id, request.text)


# Ongoing requests reach past the stream cap (api.max_streams) so that RequestGuard, not Serve's
# proxy (plain text), answers overload with a JSON 503; the queue behind them is bounded too.
@serve.deployment(name="Ingress", max_ongoing_requests=512, max_queued_requests=256,
                  graceful_shutdown_timeout_s=90, ray_actor_options={"num_cpus": 0.25})
@serve.ingress(api_app)
class Ingress:
    def __init__(self, encoder: DeploymentHandle, synthesizer: DeploymentHandle,
                 api: dict[str, Any]) -> None:
        self._encoder = encoder
        self._synthesizer = synthesizer
        api_app.state.encoder, api_app.state.synthesizer = encoder, synthesizer  # the socket's
        use_replica_log()
        self._api = ApiConfig.model_validate(api)
        api_app.state.api_config = self._api
        api_app.state.keys = KeyRing.from_config(self._api)
        api_app.state.admission = StreamAdmission(self._api.max_streams,
                                                  self._api.max_streams_per_key)
        logger.info("ingress: %d API keys, at most %d streams (%s per key)",
                    len(api_app.state.keys), self._api.max_streams,
                    self._api.max_streams_per_key or "no limit")
        self._metrics = IngressMetrics()
        api_app.state.metrics = self._metrics
        self._info: EngineInfo | None = None

    async def _engine_info(self) -> EngineInfo:
        if self._info is None:
            try:
                self._info = await asyncio.wait_for(self._synthesizer.info.remote(),
                                                    self._api.handle_timeout_s)
            except Exception as exc:
                logger.error("engine info unavailable (%s)", type(exc).__name__)
                raise ApiError(503, "the speech engine is not available; retry shortly",
                               code="not_ready", headers=RETRY_AFTER) from None
        return self._info

    @api_app.get("/", summary="Web page: type text, press Speak, hear it stream",
                 response_class=HTMLResponse)
    async def web_page(self) -> HTMLResponse:
        return HTMLResponse(_web_page(), headers={"Cache-Control": "no-cache"})

    @api_app.get("/healthz", summary="Liveness")
    async def healthz(self) -> dict[str, str]:
        return {"status": "ok"}

    @api_app.get("/readyz", summary="Readiness: 200 once the engine is loaded and warmed",
                 responses={503: {"description": "engine not ready"}})
    async def readyz(self) -> JSONResponse:
        try:
            ready = await asyncio.wait_for(self._synthesizer.ready.remote(),
                                           timeout=self._api.readiness_timeout_s)
        except Exception:
            ready = False
        if not ready:
            return error_response(ApiError(503, "engine is not ready yet", code="not_ready",
                                           headers={"Retry-After": "1"}))
        return JSONResponse({"status": "ready"})

    @api_app.get("/v1/models", summary="Models (OpenAI format)")
    async def models(self) -> dict[str, Any]:
        info = await self._engine_info()
        ids = [info.model_id, *self._api.model_aliases]
        return {"object": "list", "data": [
            {"id": model_id, "object": "model", "created": 0, "owned_by": "serve_app"}
            for model_id in ids]}

    @api_app.get("/v1/voices", summary="Voices the engine speaks, and accepted aliases")
    async def voices(self) -> dict[str, Any]:
        info = await self._engine_info()
        data = [{"id": voice, "engine_voice": voice} for voice in info.voices]
        data += [{"id": alias, "engine_voice": "default"} for alias in self._api.voice_aliases]
        return {"object": "list", "data": data, "modes": info.modes,
                "native_sample_rate_hz": info.sample_rate_hz}

    @api_app.post("/v1/audio/speech", summary="OpenAI-compatible speech (streams)",
                  response_class=StreamingResponse)
    async def openai_speech(self, body: OpenAISpeechBody, http: Request) -> StreamingResponse:
        received_s = time.perf_counter()
        info = await self._engine_info()
        if body.model not in (info.model_id, *self._api.model_aliases):
            raise ApiError(404, f"model {body.model!r} does not exist; see /v1/models",
                           param="model", code="model_not_found")
        self._check_length(body.input, "input")
        self._check_length(body.instructions, "instructions", self._api.max_instructions_chars)
        voice = "default" if body.voice in self._api.voice_aliases else body.voice
        request = SpeechRequest(request_id=_request_id(http), text=body.input, voice=voice,
                                speed=body.speed, seed=body.seed,
                                max_audio_s=self._api.max_audio_s,
                                system_prompt=body.instructions or None)
        _describe(http, request, body.response_format, OPENAI_PCM_RATE_HZ)
        return await self._stream(request, body.response_format, OPENAI_PCM_RATE_HZ, received_s,
                                  events=body.stream_format == "sse")

    @api_app.post("/v1/speech/stream", summary="Native streaming speech",
                  response_class=StreamingResponse)
    async def native_speech(self, body: NativeSpeechBody, http: Request) -> StreamingResponse:
        received_s = time.perf_counter()
        self._check_length(body.text, "text")
        self._check_length(body.instructions, "instructions", self._api.max_instructions_chars)
        problem = check_format_rate(body.format, body.sample_rate)
        if problem is not None:
            raise ApiError(400, problem, param="sample_rate", code="unsupported_sample_rate")
        request = SpeechRequest(request_id=_request_id(http), text=body.text, mode=body.mode,
                                voice=body.voice, speed=body.speed, seed=body.seed,
                                max_audio_s=self._api.max_audio_s,
                                system_prompt=body.instructions or None)
        _describe(http, request, body.format, body.sample_rate)
        return await self._stream(request, body.format, body.sample_rate, received_s)

    def _check_length(self, text: str | None, param: str, limit: int | None = None) -> None:
        limit = limit or self._api.max_input_chars
        if text is not None and len(text) > limit:
            raise ApiError(400, f"{param} is longer than {limit} characters", param=param,
                           code="string_too_long")

    async def _stream(self, request: SpeechRequest, audio_format: str, sample_rate_hz: int,
                      received_s: float, events: bool = False) -> StreamingResponse:
        started_s = time.perf_counter()
        job = EncodeJob(request=request, audio_format=audio_format, sample_rate_hz=sample_rate_hz,
                        events=events)
        first, pieces = await open_stream(self._encoder, job, self._api, started_s)
        if first:
            self._metrics.observe_ttfb(time.perf_counter() - received_s, request.mode,
                                       audio_format)
        # x-request-id (= request.request_id) is added to the reply by Serve's proxy.
        headers = {"x-sample-rate": str(sample_rate_hz), "x-audio-format": audio_format}
        if events:
            return StreamingResponse(sse_body(first, pieces, request.request_id, self._metrics),
                                     media_type=SSE_MEDIA_TYPE,
                                     headers={**headers, "cache-control": "no-cache"})
        return StreamingResponse(_body(first, pieces, request.request_id, self._metrics),
                                 media_type=CONTENT_TYPES[audio_format], headers=headers)
