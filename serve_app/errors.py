"""The service's one error type, and every error a hop may answer with, written once.

An :class:`ApiError` is raised where an error is detected in the ingress, or sent in-band as a
stream's only (or last) item by the synthesizer and the encoder: the first item of a stream
decides the HTTP status, and an error object survives the hop between replicas unchanged. The
ingress turns it into OpenAI-style JSON (``{"error": {"message", "type", "param", "code"}}``),
once. Nothing here carries a traceback, a file path or a secret; no web framework is imported.
Every refusal an engine, the text rule or a voice check raises (:class:`InvalidRequestError`)
becomes an ApiError in :func:`refused`, and only there.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from serve_app.engines.errors import InvalidRequestError

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
VOICE_NOT_FOUND = "voice_not_found"

_TYPES_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    """An error the service answers with; ``status_code`` is the HTTP status.

    503 and 429 answers say when to retry (``Retry-After``) unless ``headers`` says otherwise.
    """

    def __init__(self, status_code: int, message: str, *, param: str | None = None,
                 code: str | None = None, error_type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _TYPES_BY_STATUS.get(
            status_code, "server_error" if status_code >= 500 else "invalid_request_error")
        if headers is None and status_code in (429, 503):
            headers = {"Retry-After": str(RETRY_AFTER_S)}
        self.headers = headers

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only fields: pickle (Ray's hop between replicas) must rebuild them by name.
        return (_rebuild, (self.status_code, self.message, self.param, self.code,
                           self.error_type, self.headers))

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.code}}


def _rebuild(status_code: int, message: str, param: str | None, code: str | None,
             error_type: str, headers: dict[str, str] | None) -> ApiError:
    return ApiError(status_code, message, param=param, code=code, error_type=error_type,
                    headers=headers)


def refused(exc: InvalidRequestError) -> ApiError:
    """The caller asked for something that cannot be served: the one place an
    :class:`InvalidRequestError` (the text rule's, a voice clip's or name's, an engine's
    ``validate``) becomes the :class:`ApiError` answered with. A route that names a field
    otherwise (the OpenAI route's ``input`` is the engines' ``text``) renames it:
    :func:`renamed`.
    """
    return ApiError(exc.status_code, exc.message, param=exc.param, code=exc.code)


def renamed(error: ApiError, param_names: Mapping[str, str]) -> ApiError:
    """``error`` naming its parameter as the route does: ``param`` and a message that starts
    with the field's name ("text is longer than ...") take the route's name for it. An error
    about another field comes back as it is."""
    name = param_names.get(error.param or "")
    if name is None:
        return error
    message = error.message
    if message.startswith(f"{error.param} "):
        message = name + message[len(error.param):]
    return ApiError(error.status_code, message, param=name, code=error.code,
                    error_type=error.error_type, headers=error.headers)


def invalid_json(problem: str = "malformed JSON body") -> ApiError:
    """A body that is not one JSON value: bad syntax, bad UTF-8, or nesting too deep to parse."""
    return ApiError(400, problem, code="invalid_json")


def unknown_voice(voice: str, engine_voices: Sequence[str], aliases: Sequence[str],
                  stored_voices: bool = False) -> ApiError:
    """A voice that is none of the names a request may use: the answer lists them all, the
    engine's own voices and the accepted OpenAI voice names (and says where stored voices are
    listed when the engine clones voices)."""
    message = f"unknown voice {voice!r}; available: {', '.join(engine_voices)}"
    if aliases:
        message += f"; OpenAI voice names (the default voice): {', '.join(aliases)}"
    if stored_voices:
        message += "; or one of your voices (GET /v1/audio/voices)"
    return ApiError(400, message, param="voice", code="unknown_voice")


# Why a replica's engine refused a stream, as the answer says it (EngineOverloadedError.reason).
OVERLOAD_REASONS = {
    "work": "every replica's real-time budget is in use",
    "wait": "no replica could start the stream in time",
    "queue": "every queue on the way is full",
    "behind": "the engine is catching up on the streams it holds",
    "slots": "every stream slot is taken",
    "voices": "every loaded voice is in use",
}


def overloaded(reason: str = "queue") -> ApiError:
    """The request cannot be served in real time now; the caller should retry (503 with
    ``Retry-After``, before any audio and any engine work for it)."""
    why = OVERLOAD_REASONS.get(reason, OVERLOAD_REASONS["queue"])
    return ApiError(503, f"the service is at capacity ({why}); retry shortly",
                    code="overloaded", error_type="service_unavailable")


def not_ready(message: str = "the speech engine is not available; retry shortly") -> ApiError:
    return ApiError(503, message, code="not_ready")


def timed_out(request_id: str, where: str, waited_s: float) -> ApiError:
    """Nothing arrived in time; logged with the hop that waited."""
    logger.error("request %s: %s sent nothing for %.1f s", request_id, where, waited_s)
    return ApiError(504, "speech synthesis timed out", code="timeout", error_type="server_error")


def synthesis_failed(request_id: str, cause: BaseException) -> ApiError:
    """The engine failed this stream; its own message may name internals, the caller's does not."""
    logger.error("request %s: synthesis failed (%s)", request_id, type(cause).__name__)
    return ApiError(500, "speech synthesis failed", code="synthesis_failed",
                    error_type="server_error")


def synthesis_unavailable(request_id: str, cause: BaseException) -> ApiError:
    """A hop below failed (a replica died, say); Serve restarts it, so a retry may succeed."""
    logger.error("request %s: upstream stream failed (%s)", request_id, type(cause).__name__)
    return ApiError(503, "speech synthesis failed; retry shortly", code="synthesis_unavailable")


def voice_not_found(voice_id: str) -> ApiError:
    """No such stored voice for this API key: the same answer whether it never existed, was
    deleted or belongs to another key."""
    return ApiError(404, f"voice {voice_id!r} does not exist; see GET /v1/audio/voices",
                    param="voice", code=VOICE_NOT_FOUND)


def voice_cloning_unsupported(engine: str) -> ApiError:
    """The deployed engine speaks only its own voices."""
    return ApiError(422, f"the {engine} engine, as deployed, cannot clone voices (the minicpmo "
                         "engine with engine_options.voices on can)",
                    param="audio_sample", code="voice_cloning_unsupported")


def voice_embedding_failed(cause: BaseException) -> ApiError:
    logger.error("voice embedding failed (%s)", type(cause).__name__)
    return ApiError(500, "the voice clip could not be embedded", code="voice_embedding_failed",
                    error_type="server_error")


def voice_store_unavailable() -> ApiError:
    """The voice store (a local or shared folder) cannot be read or written now."""
    return ApiError(503, "the voice store is unavailable; retry shortly",
                    code="voice_store_unavailable")
