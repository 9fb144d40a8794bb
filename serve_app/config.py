"""Typed application arguments: what ``serve run``'s ``args:`` section may hold."""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from serve_app.engines.base import MAX_CLIP_S, MIN_CLIP_S
from serve_app.engines.minicpmo.options import EngineOptions as MiniCPMOOptions
from serve_app.engines.piper.options import PiperOptions
from serve_app.engines.registry import ENGINE_OPTIONS
from serve_app.engines.text_rule import MAX_TEXT_CHARS

# Where voices live unless api.voice_store says otherwise: a local folder, fine for one machine.
# On a multi-node cluster point api.voice_store at a shared filesystem (NFS, EFS) mounted at the
# same path on every node, so every Ingress and Synthesizer replica sees every voice.
DEFAULT_VOICE_STORE = "~/.local/share/serve_app/voices"
# Admitting by work, the Synthesizer takes this many times the streams its engine can hold: the
# rest are requests on their way to a refusal (milliseconds each), which Serve must not hold
# back at the caller behind streams that last seconds (AppArgs.max_ongoing_requests).
REFUSALS_IN_FLIGHT = 2


class BatchingConfig(BaseModel):
    """The synthesizer's ``@serve.batch`` admission knobs; live-changeable via ``user_config``.

    A batch is one engine submission: requests that arrive within ``batch_wait_timeout_s`` of
    each other (up to ``max_batch_size``) are admitted together, so their prefills share a pass.
    The batch ends as soon as its requests are submitted; their streams then run in the engine's
    continuous batch, bounded by its slots and the deployment's ``max_ongoing_requests``, never
    by these knobs. ``max_concurrent_batches`` bounds submissions in progress at once.
    """

    model_config = ConfigDict(extra="forbid")

    max_batch_size: int = Field(8, ge=1, le=4096)
    batch_wait_timeout_s: float = Field(0.01, ge=0.0, le=10.0)
    max_concurrent_batches: int = Field(1, ge=1, le=4096)


class ApiConfig(BaseModel):
    """HTTP-facing limits and defaults of the ingress."""

    model_config = ConfigDict(extra="forbid")

    # Up to the engines' maximum; a larger value refuses to start (see _within_engine_limit).
    max_input_chars: int = Field(MAX_TEXT_CHARS, ge=1)
    # WebSocket sessions: longest input_text.delta, and the longest wait for a client message
    # while its input is open (below chunk_timeout_s, which also runs while the engine waits).
    max_text_delta_chars: int = Field(1000, ge=1)
    ws_idle_timeout_s: float = Field(20.0, gt=0)
    # Longest `instructions` (voice and style direction); the LLM prefill runs on all of it.
    max_instructions_chars: int = Field(1000, ge=1)
    max_body_bytes: int = Field(64 * 1024, ge=1024)
    # Bearer keys the /v1 routes require (any of them); none at all serves without auth. Keys
    # come from here, from the environment variable named by api_keys_env and from the file
    # api_keys_file (comma- or line-separated; '#' starts a comment). Never logged.
    api_key: str | None = None
    api_keys: list[str] = Field(default_factory=list)
    api_keys_env: str | None = None
    api_keys_file: str | None = None
    # Concurrent speech streams one key may hold per ingress replica; beyond: 429.
    max_streams_per_key: int | None = Field(None, ge=1)
    # Concurrent speech streams per ingress replica; beyond: 503 with Retry-After.
    max_streams: int = Field(256, ge=1)
    # Longest audio one request may produce: the stream ends there, complete and valid.
    max_audio_s: float = Field(600.0, gt=0)
    # Wall-clock cap on one request; a stream still running then is cut (an error).
    max_stream_s: float = Field(900.0, gt=0)
    # Waits at each hop: the first audio (queueing included), each later chunk, unary handle
    # calls, a request body that trickles in.
    first_chunk_timeout_s: float = Field(60.0, gt=0)
    chunk_timeout_s: float = Field(30.0, gt=0)
    handle_timeout_s: float = Field(10.0, gt=0)
    body_timeout_s: float = Field(10.0, gt=0)
    # On shutdown or downscale, the synthesizer waits this long for its streams to finish.
    drain_timeout_s: float = Field(60.0, ge=0)
    # Names /v1/models lists and /v1/audio/speech accepts besides the engine's own model id.
    model_aliases: list[str] = Field(default_factory=lambda: ["tts-1", "tts-1-hd",
                                                             "gpt-4o-mini-tts"])
    # OpenAI voice names (every one its speech API takes, marin and cedar included: Pipecat
    # lists them); each is served with the engine's default voice.
    voice_aliases: list[str] = Field(default_factory=lambda: [
        "alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx",
        "sage", "shimmer", "verse"])
    readiness_timeout_s: float = Field(2.0, gt=0)
    # Voices (POST /v1/audio/voices): where they are stored (a local folder, or a shared one on
    # a cluster), how many one API key may keep, the largest multipart upload (413 beyond;
    # speech bodies keep max_body_bytes), the clip's length bounds, uploads one ingress replica
    # handles at once (503 beyond: each holds its body in memory) and the wait for the
    # Synthesizer to embed a clip.
    voice_store: str = DEFAULT_VOICE_STORE
    max_voices_per_key: int = Field(20, ge=1)
    max_voice_upload_bytes: int = Field(10 * 1024 * 1024, ge=1024)
    max_voice_clip_s: float = Field(MAX_CLIP_S, gt=0, le=MAX_CLIP_S)
    min_voice_clip_s: float = Field(MIN_CLIP_S, gt=0)
    max_voice_uploads: int = Field(4, ge=1)
    voice_embed_timeout_s: float = Field(120.0, gt=0)

    @field_validator("max_input_chars")
    @classmethod
    def _within_engine_limit(cls, value: int) -> int:
        if value > MAX_TEXT_CHARS:
            raise ValueError(f"api.max_input_chars is {value}, above the {MAX_TEXT_CHARS} "
                             "characters the engines accept (serve_app.engines.text_rule.MAX_TEXT_CHARS)")
        return value

    @model_validator(mode="after")
    def _clip_bounds(self) -> "ApiConfig":
        if self.min_voice_clip_s >= self.max_voice_clip_s:
            raise ValueError(f"api.min_voice_clip_s ({self.min_voice_clip_s:g} s) must be below "
                             f"api.max_voice_clip_s ({self.max_voice_clip_s:g} s)")
        return self


class AppArgs(BaseModel):
    """Arguments of :func:`serve_app.app.build_app`."""

    model_config = ConfigDict(extra="forbid")

    engine: str = "piper"
    # The engine's options, typed per engine (serve_app.engines.registry.ENGINE_OPTIONS):
    # MiniCPM-o's EngineOptions for engine: minicpmo, PiperOptions for engine: piper. A typo'd
    # name or a wrong type is refused here, when `serve run` builds the app; the engine gets
    # them as keyword arguments (engine_kwargs: MiniCPMOEngine.from_options(**options)).
    engine_options: MiniCPMOOptions | PiperOptions = Field(default_factory=PiperOptions)
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    api: ApiConfig = Field(default_factory=ApiConfig)

    @model_validator(mode="before")
    @classmethod
    def _options_of_the_engine(cls, data: Any) -> Any:
        """``engine_options`` as the options of ``engine`` (not whichever class fits them)."""
        if not isinstance(data, dict):
            return data
        engine = data.get("engine", "piper")
        if engine not in ENGINE_OPTIONS:
            raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINE_OPTIONS)}")
        options_class = ENGINE_OPTIONS[engine]
        raw = data.get("engine_options")
        if isinstance(raw, options_class):
            return data
        if raw is not None and not isinstance(raw, dict):
            raise ValueError(f"engine_options of the {engine} engine must be a mapping of its "
                             f"options ({options_class.__name__}), not {type(raw).__name__}")
        try:
            options = options_class.from_raw(raw or {})
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, error['loc']))}: {error['msg']}" if error["loc"]
                else error["msg"].removeprefix("Value error, ") for error in exc.errors())
            raise ValueError(f"engine_options of the {engine} engine: {problems}") from None
        except ValueError as exc:
            raise ValueError(f"engine_options of the {engine} engine: {exc}") from None
        return {**data, "engine_options": options}

    @property
    def max_slots(self) -> int:
        """Streams the engine runs at once (its slots): MiniCPM-o's ``max_slots`` (read and
        chat streams together; a chat stream holds one of them and an LLM slot), Piper's
        ``max_batch_size``."""
        return self.engine_options.max_slots

    @property
    def max_ongoing_requests(self) -> int:
        """The Synthesizer's ``max_ongoing_requests``: admitting by work, every stream the
        engine can hold (slots and queue) and as many again on their way to a refusal, so that
        what it cannot serve in real time reaches it and is refused at once, not queued by
        Serve at the caller (where it would wait for a stream to end before its refusal: with
        room for the held streams only, a replica holding them made a burst at 3x wait 1.4 s,
        p99, for its refusals, read on an H200); admitting by slots, its slots (more would only
        wait in its queue)."""
        options = self.engine_options
        if options.admission == "work":
            return REFUSALS_IN_FLIGHT * options.max_held
        return options.max_slots

    def engine_kwargs(self) -> dict[str, Any]:
        """The engine's options as the plain mapping its factory takes (the Synthesizer's)."""
        return dataclasses.asdict(self.engine_options)
