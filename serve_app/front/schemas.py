"""Request bodies of the HTTP API (their JSON schemas appear in the served OpenAPI document)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from serve_app.audio import SAMPLE_RATES_HZ, AudioFormat

# The text's length and content are checked by the ingress under serve_app.engines.text_rule, against
# api.max_input_chars (a schema cap here would override the configured limit).
_TEXT = ("Text to speak: at most api.max_input_chars characters (default 4096) once control, "
         "format and unassigned characters are removed; something to speak must be left")
# Schema ceiling; the served limit is the (lower) api.max_instructions_chars.
MAX_INSTRUCTIONS_CHARS = 4096
INSTRUCTIONS_DESCRIPTION = ("Voice and style direction (OpenAI's instructions); engines that "
                            "cannot follow it (piper) answer 400")


def only_words(value: Any) -> Any:
    """``timestamp_granularities`` is a list whose one accepted value is ``"word"``."""
    if value is not None and (not isinstance(value, list)
                              or any(item != "word" for item in value)):
        raise ValueError('must be a list of "word" (the only granularity this service times)')
    return value


TimestampGranularities = Annotated[
    list[Literal["word"]] | None, BeforeValidator(only_words),
    Field(description='["word"]: each audio event lists the words whose audio starts in it '
                      '(word, start, end in seconds from the first sample); see docs/api.md')]


def no_nul(text: str | None) -> str | None:
    # Engines hand text to C libraries (espeak) that would stop at a NUL.
    if text is not None and "\x00" in text:
        raise ValueError("must not contain NUL characters")
    return text


class OpenAISpeechBody(BaseModel):
    """``POST /v1/audio/speech``, as in OpenAI's API. ``pcm`` is 24 kHz s16le mono."""

    # Fields this API does not know are ignored, as OpenAI's own clients send new ones first.
    model_config = ConfigDict(extra="ignore")

    model: str = Field(..., description="tts-1, tts-1-hd, gpt-4o-mini-tts or the engine's id")
    input: str = Field(..., description=_TEXT)
    voice: str = Field(..., description="An OpenAI voice name or one of /v1/voices")
    response_format: AudioFormat = "mp3"
    speed: float = Field(1.0, ge=0.25, le=4.0)
    instructions: str | None = Field(None, max_length=MAX_INSTRUCTIONS_CHARS,
                                     description=INSTRUCTIONS_DESCRIPTION)
    seed: int | None = Field(None, ge=0, le=2**63 - 1,
                             description="Not in OpenAI's API: reproducible output")
    stream_format: Literal["audio", "sse"] = Field(
        "audio", description="audio: the raw audio bytes; sse: server-sent events "
                             "(speech.audio.delta with base64 audio, then speech.audio.done)")
    timestamp_granularities: TimestampGranularities = None

    _instructions_no_nul = field_validator("instructions")(no_nul)

class NativeSpeechBody(BaseModel):
    """``POST /v1/speech/stream``: the native streaming endpoint."""

    model_config = ConfigDict(extra="forbid")

    text: str = Field(..., description=_TEXT)
    mode: Literal["read", "chat"] = Field(
        "read", description="read: speak the text; chat: answer it in speech")
    format: AudioFormat = "wav"
    sample_rate: int = Field(24000, description=f"One of {list(SAMPLE_RATES_HZ)} "
                                                "(opus: not 22050 or 44100)")
    voice: str = "default"
    seed: int | None = Field(None, ge=0, le=2**63 - 1,
                             description="Reproducible output (piper: noise-free synthesis)")
    speed: float = Field(1.0, ge=0.25, le=4.0)
    instructions: str | None = Field(None, max_length=MAX_INSTRUCTIONS_CHARS,
                                     description=INSTRUCTIONS_DESCRIPTION)

    _instructions_no_nul = field_validator("instructions")(no_nul)
