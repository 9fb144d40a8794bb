"""Request bodies of the HTTP API (their JSON schemas appear in the served OpenAPI document)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from serve_app.audio import SAMPLE_RATES_HZ

# The text's length and content are checked by the ingress under serve_app.text_rule, against
# api.max_input_chars (a schema cap here would override the configured limit).
_TEXT = ("Text to speak: at most api.max_input_chars characters (default 4096) once control, "
         "format and unassigned characters are removed; something to speak must be left")


class OpenAISpeechBody(BaseModel):
    """``POST /v1/audio/speech``, as in OpenAI's API. ``pcm`` is 24 kHz s16le mono."""

    # Fields OpenAI added later (instructions, stream_format) are accepted and ignored.
    model_config = ConfigDict(extra="ignore")

    model: str = Field(..., description="tts-1, tts-1-hd, gpt-4o-mini-tts or the engine's id")
    input: str = Field(..., description=_TEXT)
    voice: str = Field(..., description="An OpenAI voice name or one of /v1/voices")
    response_format: Literal["mp3", "opus", "flac", "wav", "pcm"] = "mp3"
    speed: float = Field(1.0, ge=0.25, le=4.0)


class NativeSpeechBody(BaseModel):
    """``POST /v1/speech/stream``: the native streaming endpoint."""

    model_config = ConfigDict(extra="forbid")

    text: str = Field(..., description=_TEXT)
    mode: Literal["read", "chat"] = Field(
        "read", description="read: speak the text; chat: answer it in speech")
    format: Literal["mp3", "opus", "flac", "wav", "pcm"] = "wav"
    sample_rate: int = Field(24000, description=f"One of {list(SAMPLE_RATES_HZ)} "
                                                "(opus: not 22050 or 44100)")
    voice: str = "default"
    seed: int | None = Field(None, ge=0, le=2**63 - 1,
                             description="Reproducible output (piper: noise-free synthesis)")
    speed: float = Field(1.0, ge=0.25, le=4.0)
