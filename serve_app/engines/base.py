"""The engine contract shared by every speech engine.

An engine accepts :class:`SpeechRequest` objects, streams :class:`AudioChunk` objects back for
each one, and frees a stream's resources at once on :meth:`Engine.abort`. Errors a caller caused
raise :class:`InvalidRequestError` before anything is scheduled; the ingress translates them to
HTTP once.
"""

from __future__ import annotations

import asyncio
import logging
import math
import pickle
import weakref
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Literal, Protocol, Sequence, SupportsIndex

import numpy as np

from serve_app.engines.text_rule import clean_text
from serve_app.engines.usage import StreamUsage
from serve_app.engines.words import WordTime

# The errors live in a leaf module, which text_rule imports without this one; re-exported here.
from .errors import (  # noqa: F401
    EngineError,
    EngineOverloadedError,
    InvalidRequestError,
    RequestAbortedError,
)
from .stats import EngineStats  # noqa: F401  (the counters, beside the contract)

logger = logging.getLogger(__name__)

Mode = Literal["read", "chat"]
TextInput = Literal["whole", "streamed"]
TEXT_INPUTS: tuple[str, ...] = ("whole", "streamed")


# A voice's reference clip, checked by the ingress before any engine runs and again by the
# engine that embeds it: one home for the limits both apply.
MIN_CLIP_S = 1.0
MAX_CLIP_S = 30.0  # Whisper's window (1500 encoder positions); OpenAI's limit for a voice sample
MIN_CLIP_RATE_HZ, MAX_CLIP_RATE_HZ = 8_000, 192_000


@dataclass(frozen=True)
class SamplingParams:
    """LLM sampling for ``chat`` mode (MiniCPM-o's defaults; see docs/minicpmo.md, "Chat mode").

    ``temperature == 0`` means greedy decoding, which makes a request's output independent of
    the batch it runs in.
    """

    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 100
    repetition_penalty: float = 1.05
    max_new_tokens: int = 512

    def validate(self) -> None:
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 2.0):
            raise InvalidRequestError("temperature must be within [0, 2]", "temperature")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise InvalidRequestError("top_p must be within (0, 1]", "top_p")
        if not (1 <= self.top_k <= 100_000):
            raise InvalidRequestError("top_k must be at least 1", "top_k")
        if not (math.isfinite(self.repetition_penalty) and 0.5 <= self.repetition_penalty <= 2.0):
            raise InvalidRequestError("repetition_penalty must be within [0.5, 2]",
                                      "repetition_penalty")
        if not (1 <= self.max_new_tokens <= 4096):
            raise InvalidRequestError("max_new_tokens must be within [1, 4096]", "max_new_tokens")


@dataclass(frozen=True)
class LengthControls:
    """Benchmark knobs that fix a stream's length (random weights never stop by themselves).

    ``ignore_eos``: keep generating audio past end-of-audio codes; ``audio_frames``: stop after
    exactly this many code frames; ``llm_tokens``: the chat answer has exactly this many tokens.
    """

    ignore_eos: bool = False
    audio_frames: int | None = None
    llm_tokens: int | None = None


@dataclass(frozen=True)
class SpeechRequest:
    """One text-to-speech stream; ``text`` is cleaned on construction (``serve_app.engines.text_rule``).

    ``text_input``: ``"whole"`` (``text`` is all there is) or ``"streamed"`` (``text`` is what is
    known at submission, possibly empty; the rest comes through :meth:`Engine.feed_text`).
    ``word_times``: the chunks carry their words' times (``AudioChunk.words``); an engine that
    cannot time words refuses it (:func:`refuse_unsupported`).
    """

    request_id: str
    text: str
    mode: Mode = "read"
    voice: str = "default"
    speed: float = 1.0
    seed: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    system_prompt: str | None = None
    max_audio_s: float | None = None
    lengths: LengthControls = field(default_factory=LengthControls)
    text_input: TextInput = "whole"
    word_times: bool = False

    def __post_init__(self) -> None:
        # Whoever builds a request, its engine sees the text under the one text rule.
        object.__setattr__(self, "text", clean_text(self.text))


@dataclass
class AudioChunk:
    """A piece of a stream's audio: float32 mono PCM at ``sample_rate_hz``.

    ``text`` is the text this chunk covers (may be empty); ``final`` marks the stream's last
    chunk (which may hold no samples); ``timings_s`` carries per-stage seconds for metrics;
    ``usage``, on the final chunk only, the stream's token counts in the engine's units;
    ``words``, for a request with ``word_times``, the words whose audio starts in this chunk
    (times in seconds from the stream's first sample; a word's end may lie in a later chunk).
    """

    request_id: str
    samples: np.ndarray
    sample_rate_hz: int
    text: str = ""
    final: bool = False
    timings_s: dict[str, float] = field(default_factory=dict)
    usage: StreamUsage | None = None
    words: tuple[WordTime, ...] = ()

    @property
    def duration_s(self) -> float:
        return len(self.samples) / float(self.sample_rate_hz)

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple:
        """Pickled as its fields, the samples one float32 buffer (a ``PickleBuffer`` from
        protocol 5: out of band on the engine wire): a third of the dataclass's pickling work,
        paid per chunk on the engine's step thread and at every hop."""
        samples = np.ascontiguousarray(self.samples, dtype=np.float32).reshape(-1)
        return (_chunk_from_fields, (
            self.request_id, pickle.PickleBuffer(samples) if protocol >= 5 else samples,
            self.sample_rate_hz, self.text, self.final, self.timings_s, self.usage, self.words))


def _chunk_from_fields(request_id: str, samples: object, sample_rate_hz: int, text: str,
                       final: bool, timings_s: dict[str, float], usage: StreamUsage | None,
                       words: tuple[WordTime, ...] = ()) -> AudioChunk:
    """An AudioChunk from what :meth:`AudioChunk.__reduce_ex__` pickled (its samples a view of
    the buffer unpickled, so writable where that is)."""
    return AudioChunk(request_id, np.frombuffer(samples, np.float32), sample_rate_hz, text,
                      final, timings_s, usage, words)


class Engine(Protocol):
    """What the synthesizer needs from an engine."""

    sample_rate_hz: int
    modes: tuple[str, ...]
    clones_voices: bool  # embed_voice/add_voice work (else they raise InvalidRequestError)

    def voices(self) -> list[str]:
        """Voice names a request may ask for: ``"default"`` (or the engine's own) and every
        voice added with :meth:`add_voice` that is still loaded."""

    def embed_voice(self, samples: np.ndarray, sample_rate_hz: int) -> np.ndarray:
        """A reference clip (mono samples at ``sample_rate_hz``) -> the voice's embeddings
        (float32 [T, D], what :meth:`add_voice` takes). Refuses a bad clip with
        :class:`InvalidRequestError` (``param="audio_sample"``). Blocking: call it off the
        event loop. Thread-safe."""

    def add_voice(self, voice_id: str, embeddings: np.ndarray) -> None:
        """Make ``voice_id`` a voice requests may ask for (replacing one of that id). The engine
        keeps a bounded number of voices and may drop the least recently used one that no
        stream uses; a dropped voice is no longer in :meth:`voices` (add it again). Blocking,
        thread-safe."""

    def remove_voice(self, voice_id: str) -> None:
        """Forget ``voice_id`` (no-op if it is not loaded); streams already using it finish in
        it."""

    def validate(self, request: SpeechRequest) -> None:
        """Raise :class:`InvalidRequestError` if the request cannot be served; touches nothing."""

    def submit(self, requests: list[SpeechRequest]) -> list[AsyncIterator[AudioChunk]]:
        """Admit requests; each returned iterator yields that stream's chunks, the last final.
        Call it on the event loop that reads the iterators."""

    def submit_to(self, requests: list[SpeechRequest], sink: OutputSink) -> None:
        """Admit requests (all or none, refusing like :meth:`submit`); their items go to
        ``sink``, called from an engine thread with everything that thread produced at once:
        each stream's chunks in order, ending with a final chunk or the exception that ended it
        (after :meth:`abort`, a :class:`RequestAbortedError`)."""

    def feed_text(self, request_id: str, delta: str, done: bool = False) -> None:
        """Append ``delta`` to a running streamed request; ``done`` ends its input (``delta`` may
        be empty then). Raises :class:`InvalidRequestError` with code ``unknown_stream`` (no such
        running streamed request: unknown, finished or aborted), ``input_done`` (text after the
        end) or ``text_too_long`` (past the engine's text limit). Never waits for the model."""

    def abort(self, request_id: str) -> None:
        """Free the stream's slot at once; its iterator ends with :class:`RequestAbortedError`."""

    def stats(self) -> EngineStats: ...

    def warmup(self) -> None:
        """Run a throwaway request so the first real one pays no compile/allocation cost."""

    def close(self) -> None: ...


# Where Engine.submit_to delivers: (request_id, item) pairs, in order, from an engine thread.
OutputSink = Callable[[list[tuple[str, "AudioChunk | BaseException"]]], None]


class Outbox:
    """Items an engine step produced, delivered together at its end: one call per sink, so a
    step that feeds 64 streams costs the engine process one message, not 64.

    A sink with ``per_item = True`` is called at once for each item instead: an event loop in
    the engine's own process (:class:`StreamQueues`) shares the GIL with the step thread, and
    one wake-up per item keeps its turns short, where a whole step's items in one wake-up
    would hold the GIL for milliseconds while the step thread waits for it."""

    def __init__(self) -> None:
        self._items: list[tuple[OutputSink, str, object]] = []
        # audio chunks that came after their listener had played all it had (the engine's own
        # count of streams running late; admission by work holds on it)
        self.ran_dry = 0

    def take_ran_dry(self) -> int:
        count, self.ran_dry = self.ran_dry, 0
        return count

    def put(self, sink: OutputSink, request_id: str, item: object) -> None:
        if getattr(sink, "per_item", False):
            deliver_to(sink, [(request_id, item)])
        else:
            self._items.append((sink, request_id, item))

    def deliver(self) -> None:
        items, self._items = self._items, []
        by_sink: dict[int, tuple[OutputSink, list[tuple[str, object]]]] = {}
        for sink, request_id, item in items:
            by_sink.setdefault(id(sink), (sink, []))[1].append((request_id, item))
        for sink, batch in by_sink.values():
            deliver_to(sink, batch)


def deliver_to(sink: OutputSink, items: list[tuple[str, object]]) -> None:
    """A sink that fails loses its own items only; the engine's thread and other sinks go on."""
    try:
        sink(items)  # type: ignore[arg-type]
    except Exception:
        logger.exception("an output sink failed; %d items for %s are lost", len(items),
                         sorted({request_id for request_id, _ in items}))


class StreamQueues:
    """An output sink that turns :meth:`Engine.submit_to` into :meth:`Engine.submit`: items
    cross to one event loop (one wake-up per item, from any thread) into per-request queues,
    read as async iterators. A reader that stops early aborts its stream."""

    per_item = True  # see Outbox

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queues: dict[str, asyncio.Queue] = {}

    def __call__(self, items: list[tuple[str, object]]) -> None:
        try:
            self._loop.call_soon_threadsafe(self._put, items)
        except RuntimeError:  # the loop is closed: nobody is listening
            pass

    def _put(self, items: list[tuple[str, object]]) -> None:
        for request_id, item in items:
            queue = self._queues.get(request_id)
            if queue is not None:  # else its reader is gone
                queue.put_nowait(item)

    def submit(self, request_ids: Sequence[str], submit_to: Callable[["StreamQueues"], None],
               abort: Callable[[str], None]) -> list[AsyncIterator[AudioChunk]]:
        """Open a queue per request, call ``submit_to(self)``, and return the iterators (no
        queue stays open if it raises)."""
        if len(set(request_ids)) != len(request_ids) or any(r in self._queues for r in request_ids):
            raise InvalidRequestError("request id already in use", "request_id",
                                      code="duplicate_request_id")
        for request_id in request_ids:
            self._queues[request_id] = asyncio.Queue()
        try:
            submit_to(self)
        except BaseException:
            for request_id in request_ids:
                self._queues.pop(request_id, None)
            raise
        return [self._iterate(request_id, abort) for request_id in request_ids]

    async def _iterate(self, request_id: str, abort: Callable[[str], None]
                       ) -> AsyncIterator[AudioChunk]:
        queue = self._queues[request_id]
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.final
                yield item
                if finished:
                    return
        finally:
            if self._queues.get(request_id) is queue:
                del self._queues[request_id]
            if not finished:  # the reader stopped early: free the stream's slot
                abort(request_id)


class SubmitsIterators:
    """:meth:`Engine.submit` for an engine that has :meth:`Engine.submit_to`: its iterators
    read one :class:`StreamQueues` per event loop."""

    def submit(self, requests: list[SpeechRequest]) -> list[AsyncIterator[AudioChunk]]:
        return self.iterators([r.request_id for r in requests],
                              lambda sink: self.submit_to(requests, sink))  # type: ignore[attr-defined]

    def iterators(self, request_ids: Sequence[str], submit_to: Callable[[StreamQueues], None]
                  ) -> list[AsyncIterator[AudioChunk]]:
        """Call ``submit_to`` with the running loop's StreamQueues; the requests' iterators."""
        per_loop = self.__dict__.setdefault("_stream_queues", weakref.WeakKeyDictionary())
        loop = asyncio.get_running_loop()
        queues = per_loop.get(loop)
        if queues is None:
            queues = per_loop[loop] = StreamQueues(loop)
        return queues.submit(request_ids, submit_to, self.abort)  # type: ignore[attr-defined]


class WithoutVoiceCloning:
    """The voice-cloning half of :class:`Engine` for an engine that cannot clone voices: every
    call is refused with :class:`InvalidRequestError` naming the engine (its ``model_id``)."""

    clones_voices = False

    def _cannot_clone(self) -> InvalidRequestError:
        name = getattr(self, "model_id", type(self).__name__)
        return InvalidRequestError(
            f"the {name} engine cannot clone voices: it speaks with its own voice "
            "only (deploy the minicpmo engine for cloned voices)", "voice",
            code="voice_cloning_unsupported")

    def embed_voice(self, samples: np.ndarray, sample_rate_hz: int) -> np.ndarray:
        raise self._cannot_clone()

    def add_voice(self, voice_id: str, embeddings: np.ndarray) -> None:
        raise self._cannot_clone()

    def remove_voice(self, voice_id: str) -> None:
        raise self._cannot_clone()


def refuse_unsupported(engine: object, request: SpeechRequest) -> None:
    """Refuse a request for what ``engine`` has not declared it can do, before its validate:
    ``system_prompt`` (the API's ``instructions``) needs ``follows_instructions = True``,
    ``word_times`` (``timestamp_granularities``) ``times_words = True``.

    Raises :class:`InvalidRequestError` naming the API parameter.
    """
    name = getattr(engine, "model_id", type(engine).__name__)
    for asked, able, param, why in (
            (request.word_times, "times_words", "timestamp_granularities",
             "cannot time words (leave timestamp_granularities out)"),
            (request.system_prompt, "follows_instructions", "instructions",
             "cannot follow instructions: it has one fixed speaking style (leave instructions "
             "out, or deploy the minicpmo engine)")):
        if asked and not getattr(engine, able, False):
            raise InvalidRequestError(f"the {name} engine {why}", param,
                                      code="unsupported_parameter")
