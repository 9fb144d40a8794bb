"""Ingress deployment: the service's front, and its one CPU deployment (FastAPI through
``@serve.ingress``).

Routes, auth, validation, and the streamed reply: it opens the synthesizer stream, resamples and
encodes each chunk, and ships the bytes (HTTP body, SSE, WebSocket; :mod:`serve_app.front.stream_open`).
Every check happens here or in the engine's ``validate`` (reached through the synthesizer
stream's first item) before the engine schedules anything, and every error leaves as
OpenAI-style JSON. In front of its replicas Ray's HAProxy balances connections (leastconn), so no
Python proxy sits on the data path (README "Serving").
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
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from serve_app import __version__, errors
from serve_app.front.api_docs import mount_offline_docs
from serve_app.audio import CONTENT_TYPES, check_format_rate, format_unavailable
from serve_app.config import ApiConfig
from serve_app.engines.base import InvalidRequestError, SpeechRequest
from serve_app.errors import ApiError
from serve_app.front.error_replies import add_error_handlers
from serve_app.front.guard import (REQUEST_ID_HEADER, KeyRing, RequestGuard, StreamAdmission,
                                   json_error)
from serve_app.front.events import SSE_MEDIA_TYPE, sse_body
from serve_app.hops import as_cancellation, is_cancellation
from serve_app.observability import memory_trace
from serve_app.observability.gc_pauses import settle_replica_process
from serve_app.observability.logs import use_replica_log
from serve_app.messages import EncodeJob, EngineInfo
from serve_app.observability.metrics import EncoderMetrics, IngressMetrics
from serve_app.front.schemas import NativeSpeechBody, OpenAISpeechBody
from serve_app.front.speech_socket import router as speech_socket_router
from serve_app.front.stream_open import open_stream
from serve_app.front.voice_routes import owner_of
from serve_app.front.voice_routes import router as voice_router
from serve_app.engines.text_rule import check_text
from serve_app.voices.store import VoiceStore, resolve_voice

logger = logging.getLogger(__name__)

OPENAI_PCM_RATE_HZ = 24000
# The OpenAI route's names for the request fields the engines and the text rule name.
OPENAI_PARAM_NAMES = {"text": "input"}


# /docs and /redoc with their assets served by the app itself, not a CDN (serve_app/front/api_docs.py):
# they render on a cluster without internet. Like every path outside /v1/, they need no key.
api_app = FastAPI(
    title="Speech serving API",
    version=__version__,
    description="Streaming text to speech on Ray Serve (OpenAI-compatible /v1/audio/speech).",
    docs_url=None,
    redoc_url=None,
)
mount_offline_docs(api_app)
api_app.add_middleware(RequestGuard)
add_error_handlers(api_app)  # every error as OpenAI-style JSON (serve_app/front/error_replies.py)
api_app.include_router(speech_socket_router)
api_app.include_router(voice_router)  # /v1/audio/voices (serve_app/front/voice_routes.py)


# Helpers sit above the deployment: serve.deployment pickles the class when it is decorated.
async def _body(first: bytes, pieces: AsyncIterator[bytes | ApiError],
                upstream: DeploymentResponseGenerator, request_id: str,
                metrics: IngressMetrics) -> AsyncIterator[bytes]:
    """The reply body after its first piece. Headers are gone by now: a failure cuts the chunked
    body short, which is how HTTP says "failed"."""
    finished = False
    metrics.stream_started()
    try:
        if first:
            yield first
        async for piece in pieces:
            if isinstance(piece, ApiError):
                logger.error("request %s: stream failed mid-way: %s", request_id, piece.code)
                metrics.error(piece.code, "mid_stream")
                raise RuntimeError("stream failed")
            yield piece
        finished = True
    except Exception as exc:
        if is_cancellation(exc):  # the client left
            raise as_cancellation(exc) from exc
        logger.error("request %s: stream cut: %s", request_id, exc)
        raise
    finally:
        metrics.stream_ended()
        if not finished:
            upstream.cancel()


@functools.cache
def _web_page() -> str:
    """The static page (HTML, CSS and JS in one file, no external resources), read once."""
    return (resources.files("serve_app.front") / "web" / "index.html").read_text("utf-8")


def _request_id(http: Request) -> str:
    """Serve's proxy puts its request id (the client's, if sent) in the headers and the reply;
    RequestGuard keeps it (or one it made up) in the request state for its log line."""
    return (getattr(http.state, "request_id", None) or http.headers.get(REQUEST_ID_HEADER)
            or uuid.uuid4().hex)


def _describe(http: Request, request: SpeechRequest, audio_format: str, rate_hz: int
              ) -> dict[str, Any]:
    """What RequestGuard's log line says about a speech request (the dict, which ``_stream``
    adds its clock readings to); the text only at debug."""
    http.state.speech = {"mode": request.mode, "format": audio_format, "sample_rate_hz": rate_hz,
                         "text_chars": len(request.text)}
    logger.debug("request %s text=%r", request.request_id, request.text)
    return http.state.speech


def _check_available(audio_format: str, param: str) -> None:
    """A 400 for a format this server cannot encode (aac without PyAV installed)."""
    problem = format_unavailable(audio_format)
    if problem is not None:
        raise ApiError(400, problem, param=param, code="unsupported_format")


# Ongoing requests reach past the stream cap (api.max_streams) so that RequestGuard, not Serve's
# proxy (plain text), answers overload with a JSON 503; the queue behind them is bounded too.
@serve.deployment(name="Ingress", max_ongoing_requests=512, max_queued_requests=256,
                  graceful_shutdown_timeout_s=90, ray_actor_options={"num_cpus": 0.25})
@serve.ingress(api_app)
class Ingress:
    def __init__(self, synthesizer: DeploymentHandle, api: dict[str, Any]) -> None:
        self._synthesizer = synthesizer
        api_app.state.synthesizer = synthesizer  # the socket's
        use_replica_log()
        self._api = ApiConfig.model_validate(api)
        api_app.state.api_config = self._api
        api_app.state.keys = KeyRing.from_config(self._api)
        api_app.state.admission = StreamAdmission(self._api.max_streams,
                                                  self._api.max_streams_per_key)
        api_app.state.upload_admission = StreamAdmission(self._api.max_voice_uploads, None)
        self._voices = VoiceStore(self._api.voice_store)
        api_app.state.voice_store = self._voices
        logger.info("ingress: %d API keys, at most %d streams (%s per key)",
                    len(api_app.state.keys), self._api.max_streams,
                    self._api.max_streams_per_key or "no limit")
        self._metrics = IngressMetrics()
        self._encoder_metrics = EncoderMetrics()
        api_app.state.metrics = self._metrics
        api_app.state.encoder_metrics = self._encoder_metrics
        self._info: EngineInfo | None = None
        api_app.state.engine_info = self._engine_info  # the socket's
        # The first call through a handle sets up its router and connections: made now, so no
        # request pays for it; its answer is the engine info the routes need.
        self._info_call = synthesizer.info.remote()
        memory_trace.start_if_asked("Ingress")
        settle_replica_process()

    async def _engine_info(self) -> EngineInfo:
        if self._info is None:
            call, self._info_call = self._info_call, None
            try:
                self._info = await asyncio.wait_for(call or self._synthesizer.info.remote(),
                                                    self._api.handle_timeout_s)
            except Exception as exc:
                logger.error("engine info unavailable (%s)", type(exc).__name__)
                raise errors.not_ready() from None
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
            return json_error(errors.not_ready("engine is not ready yet"))
        return JSONResponse({"status": "ready"})

    @api_app.get("/v1/models", summary="Models (OpenAI format)")
    async def models(self) -> dict[str, Any]:
        info = await self._engine_info()
        ids = [info.model_id, *self._api.model_aliases]
        # A benchmark server (random weights, fixed lengths) says so on every model it lists.
        extra = {"benchmark_mode": info.benchmark} if info.benchmark else {}
        return {"object": "list", "data": [
            {"id": model_id, "object": "model", "created": 0, "owned_by": "serve_app", **extra}
            for model_id in ids]}

    @api_app.get("/v1/voices", summary="Voices the engine speaks, and accepted aliases")
    async def voices(self) -> dict[str, Any]:
        info = await self._engine_info()
        data = [{"id": voice, "engine_voice": voice} for voice in info.voices]
        data += [{"id": alias, "engine_voice": "default"} for alias in self._api.voice_aliases]
        return {"object": "list", "data": data, "modes": info.modes,
                "native_sample_rate_hz": info.sample_rate_hz,
                "clones_voices": info.clones_voices}

    @api_app.post("/v1/audio/speech", summary="OpenAI-compatible speech (streams)",
                  response_class=StreamingResponse)
    async def openai_speech(self, body: OpenAISpeechBody, http: Request) -> StreamingResponse:
        received_s = time.perf_counter()
        info = await self._engine_info()
        if body.model not in (info.model_id, *self._api.model_aliases):
            raise ApiError(404, f"model {body.model!r} does not exist; see /v1/models",
                           param="model", code="model_not_found")
        _check_available(body.response_format, "response_format")
        word_times = bool(body.timestamp_granularities)
        if word_times and body.stream_format != "sse":
            raise ApiError(400, "timestamp_granularities needs stream_format 'sse' (the words "
                           "travel in its events)", param="timestamp_granularities",
                           code="invalid_value")
        # The text rule's and the engine's refusals name the engines' fields ("text").
        try:
            text = self._checked_text(body.input)
            self._check_instructions(body.instructions)
            voice = await self._voice(body.voice, http)
            request = SpeechRequest(request_id=_request_id(http), text=text, voice=voice,
                                    speed=body.speed, seed=body.seed,
                                    max_audio_s=self._api.max_audio_s,
                                    system_prompt=body.instructions or None,
                                    word_times=word_times)
            speech = _describe(http, request, body.response_format, OPENAI_PCM_RATE_HZ)
            return await self._stream(request, body.response_format, OPENAI_PCM_RATE_HZ,
                                      received_s, speech, events=body.stream_format == "sse")
        except ApiError as error:
            raise errors.renamed(error, OPENAI_PARAM_NAMES) from None

    @api_app.post("/v1/speech/stream", summary="Native streaming speech",
                  response_class=StreamingResponse)
    async def native_speech(self, body: NativeSpeechBody, http: Request) -> StreamingResponse:
        received_s = time.perf_counter()
        text = self._checked_text(body.text)
        self._check_instructions(body.instructions)
        _check_available(body.format, "format")
        problem = check_format_rate(body.format, body.sample_rate)
        if problem is not None:
            raise ApiError(400, problem, param="sample_rate", code="unsupported_sample_rate")
        voice = await self._voice(body.voice, http)
        request = SpeechRequest(request_id=_request_id(http), text=text, mode=body.mode,
                                voice=voice, speed=body.speed, seed=body.seed,
                                max_audio_s=self._api.max_audio_s,
                                system_prompt=body.instructions or None)
        speech = _describe(http, request, body.format, body.sample_rate)
        return await self._stream(request, body.format, body.sample_rate, received_s, speech)

    async def _voice(self, voice: str, http: Request) -> str:
        """The engine voice a speech request asks for: an alias becomes the default voice; a
        stored voice must belong to the caller (else 404), any other name must be the engine's
        (else 400 listing the names), so a bad one never reaches the GPU."""
        return await resolve_voice(self._voices, owner_of(http), voice,
                                   self._api.voice_aliases, await self._engine_info())

    def _checked_text(self, text: str) -> str:
        """The text under the shared rule (serve_app.engines.text_rule), or a 400."""
        try:
            return check_text(text, self._api.max_input_chars)
        except InvalidRequestError as exc:
            raise errors.refused(exc) from None

    def _check_instructions(self, instructions: str | None) -> None:
        limit = self._api.max_instructions_chars
        if instructions is not None and len(instructions) > limit:
            raise ApiError(400, f"instructions is longer than {limit} characters",
                           param="instructions", code="string_too_long")

    async def _stream(self, request: SpeechRequest, audio_format: str, sample_rate_hz: int,
                      received_s: float, speech: dict[str, Any], events: bool = False
                      ) -> StreamingResponse:
        job = EncodeJob(request=request, audio_format=audio_format, sample_rate_hz=sample_rate_hz,
                        events=events)
        # clock readings for the request's log line (RequestRecord): the call to the
        # synthesizer, and its first item back (encoded)
        speech["dispatched_s"] = time.perf_counter()
        try:
            first, pieces, upstream = await open_stream(self._synthesizer, job, self._api,
                                                         self._encoder_metrics)
        finally:  # the first item, or the refusal or error that came instead
            speech["first_item_s"] = time.perf_counter()
        if first:
            self._metrics.observe_ttfb(speech["first_item_s"] - received_s, request.mode,
                                       audio_format)
        # x-request-id (= request.request_id) is added to the reply by Serve's proxy.
        headers = {"x-sample-rate": str(sample_rate_hz), "x-audio-format": audio_format}
        if events:
            return StreamingResponse(sse_body(first, pieces, upstream, request.request_id,
                                              self._metrics),
                                     media_type=SSE_MEDIA_TYPE,
                                     headers={**headers, "cache-control": "no-cache"})
        return StreamingResponse(_body(first, pieces, upstream, request.request_id,
                                       self._metrics),
                                 media_type=CONTENT_TYPES[audio_format], headers=headers)
