"""Plain messages passed between deployments (pickled by Ray; no Ray import here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from serve_app.engines.base import SpeechRequest


@dataclass(frozen=True)
class StreamError:
    """A stream's explicit failure, sent in-band as its only item; the ingress maps it to HTTP.

    In-band rather than raised because the first item decides the HTTP status, and an error
    object survives the hop between replicas unchanged.
    """

    message: str
    status_code: int = 400
    param: str | None = None
    code: str = "invalid_request"
    type: str = "invalid_request_error"


@dataclass(frozen=True)
class EncodeJob:
    """What the encoder needs for one stream: the speech request and the output it must produce."""

    request: SpeechRequest
    audio_format: str
    sample_rate_hz: int


@dataclass(frozen=True)
class EngineInfo:
    """Static facts about the synthesizer's engine, for /v1/models and /v1/voices."""

    engine: str
    model_id: str
    sample_rate_hz: int
    voices: list[str] = field(default_factory=list)
    modes: list[str] = field(default_factory=list)
