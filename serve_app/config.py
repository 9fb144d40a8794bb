"""Typed application arguments: what ``serve run``'s ``args:`` section may hold."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class BatchingConfig(BaseModel):
    """The synthesizer's ``@serve.batch`` admission knobs; live-changeable via ``user_config``.

    ``max_concurrent_batches`` bounds how many admitted batches stream at once (each batch holds
    its permit until its longest stream ends), so it also bounds the engine's continuous batch.
    """

    model_config = ConfigDict(extra="forbid")

    max_batch_size: int = Field(8, ge=1, le=4096)
    batch_wait_timeout_s: float = Field(0.01, ge=0.0, le=10.0)
    max_concurrent_batches: int = Field(4, ge=1, le=4096)


class ApiConfig(BaseModel):
    """HTTP-facing limits and defaults of the ingress."""

    model_config = ConfigDict(extra="forbid")

    max_input_chars: int = Field(4096, ge=1)
    max_body_bytes: int = Field(64 * 1024, ge=1024)
    # Bearer key the /v1 routes require; None serves without auth. Never logged.
    api_key: str | None = None
    default_sample_rate_hz: int = 24000
    # Names /v1/models lists and /v1/audio/speech accepts besides the engine's own model id.
    model_aliases: list[str] = Field(default_factory=lambda: ["tts-1", "tts-1-hd",
                                                             "gpt-4o-mini-tts"])
    # OpenAI voice names; each is served with the engine's default voice.
    voice_aliases: list[str] = Field(default_factory=lambda: [
        "alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage",
        "shimmer", "verse"])
    readiness_timeout_s: float = Field(2.0, gt=0)


class AppArgs(BaseModel):
    """Arguments of :func:`serve_app.app.build_app`."""

    model_config = ConfigDict(extra="forbid")

    engine: str = "piper"
    # Passed to the engine factory as keyword arguments (MiniCPMOEngine.from_options(**options)).
    engine_options: dict[str, Any] = Field(default_factory=dict)
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    api: ApiConfig = Field(default_factory=ApiConfig)

    @model_validator(mode="after")
    def _known_engine(self) -> "AppArgs":
        from serve_app.engines.registry import ENGINES

        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}; known: {', '.join(ENGINES)}")
        return self
