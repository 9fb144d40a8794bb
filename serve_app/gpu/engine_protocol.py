"""What crosses between a synthesizer replica and its engine process: one dataclass per kind of
message (:mod:`serve_app.gpu.engine_wire` frames them, their audio out of band).

- replica -> engine: :class:`Start` first; then :class:`Submit`, :class:`Call` (``feed_text``,
  ``stats``, ``voices``, the voice calls), :class:`Abort`, :class:`Close`.
- engine -> replica: :class:`Ready` (the engine's :class:`EngineInfo`) or :class:`Failed` first;
  then :class:`Outputs` (a step's chunks and errors), :class:`Reply` (to a Submit or a Call, by
  ``call_id``), :class:`Stats` (the engine's counters, pushed when they change).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from serve_app.engines.base import AudioChunk, EngineStats, SpeechRequest
from serve_app.messages import EngineInfo

# Calls that may take long (they run a model) and whose arguments can be megabytes (a clip, a
# voice's embeddings): the engine answers them off its event loop, the replica sends them off
# its own.
SLOW_CALLS = frozenset({"embed_voice", "add_voice"})


# -- replica -> engine ------------------------------------------------------------------------

@dataclass(frozen=True)
class Start:
    """Build the engine registered as ``engine`` with ``options`` (and warm it up)."""

    engine: str
    options: dict[str, Any]


@dataclass(frozen=True)
class Submit:
    """Admit ``requests`` together; the Reply holds, per request, None (admitted) or the
    exception that refused it."""

    call_id: int
    requests: list[SpeechRequest]


@dataclass(frozen=True)
class Call:
    """Run the engine's method ``method`` with ``args``; the Reply holds its result."""

    call_id: int
    method: str
    args: tuple = ()

    @property
    def slow(self) -> bool:
        return self.method in SLOW_CALLS


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Close:
    """Finish, close the engine and exit."""


# -- engine -> replica ------------------------------------------------------------------------

@dataclass(frozen=True)
class Ready:
    info: EngineInfo


@dataclass(frozen=True)
class Failed:
    """The engine could not start: why, with its traceback."""

    message: str


@dataclass(frozen=True)
class Outputs:
    """Everything one engine step produced: per stream, an AudioChunk (the last one final, with
    the stream's usage) or the exception that ended the stream."""

    items: list[tuple[str, AudioChunk | BaseException]]
    # time.perf_counter() in the engine process when its sink took them (CLOCK_MONOTONIC: the
    # replica's clock too), so a first chunk's way back can be timed hop by hop
    made_at_s: float = 0.0


@dataclass(frozen=True)
class Reply:
    """The answer to the Submit or Call ``call_id``: its result, or the exception it raised."""

    call_id: int
    value: Any = None
    error: BaseException | None = None


@dataclass(frozen=True)
class Stats:
    stats: EngineStats
