"""Plain messages passed between deployments (pickled by Ray; no Ray import here).

A stream's failure travels in-band as a :class:`serve_app.errors.ApiError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from serve_app.engines.base import SpeechRequest
# A stream's usage is counted by its engine (on the final chunk); the front reads it from here.
from serve_app.engines.usage import StreamUsage  # noqa: F401
from serve_app.engines.words import WordTime


@dataclass(frozen=True)
class EncodeJob:
    """What the encoder needs for one stream: the speech request and the output it must produce."""

    request: SpeechRequest
    audio_format: str
    sample_rate_hz: int
    # True: yield EncodedChunk (bytes plus text and timing) and the StreamUsage; else bytes only.
    events: bool = False


@dataclass(frozen=True)
class EncodedChunk:
    """One engine chunk, encoded, with what it covers: for SSE and WebSocket event streams.

    ``audio_offset_s`` is where the chunk starts in the stream's audio; ``text`` is the text the
    engine spoke in it (may be empty); ``timings_s`` the engine's per-stage seconds; ``words``
    (None unless the request asked for word times) the words whose audio starts in it.
    """

    data: bytes
    text: str
    audio_offset_s: float
    duration_s: float
    timings_s: dict[str, float] = field(default_factory=dict)
    words: tuple[WordTime, ...] | None = None


@dataclass(frozen=True)
class TextInputOpen:
    """A streamed-input request is in the engine of the Synthesizer replica ``replica_id``:
    its text goes to ``text_inbox``, the handle of that replica's
    :class:`~serve_app.gpu.text_inbox.TextInbox` (a Ray actor), through ``put``."""

    replica_id: str
    text_inbox: Any


@dataclass(frozen=True)
class EngineInfo:
    """Static facts about the synthesizer's engine: what its engine process reports when ready
    (:mod:`serve_app.gpu.engine_protocol`), and what /v1/models and /v1/voices show (with the
    voices it holds at the time)."""

    engine: str
    model_id: str
    sample_rate_hz: int
    voices: list[str] = field(default_factory=list)
    modes: list[str] = field(default_factory=list)
    # The benchmark-only engine setting in force (random weights, fixed lengths); None in
    # production. /v1/models shows it.
    benchmark: dict | None = None
    # Whether the engine clones a voice from a reference clip (POST /v1/audio/voices).
    clones_voices: bool = False
    # Whether it takes instructions (a request's system_prompt); how many streams it runs at once.
    follows_instructions: bool = False
    times_words: bool = False  # whether its chunks can carry word times (SpeechRequest.word_times)
    max_slots: int = 0
