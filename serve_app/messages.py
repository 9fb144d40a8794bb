"""Plain messages passed between deployments (pickled by Ray; no Ray import here).

A stream's failure travels in-band as a :class:`serve_app.errors.ApiError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serve_app.engines.base import SpeechRequest


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
    # The benchmark-only engine setting in force (random weights, fixed lengths); None in
    # production. /v1/models shows it.
    benchmark: dict | None = None
