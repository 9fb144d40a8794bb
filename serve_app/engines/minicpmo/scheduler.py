"""Who runs: the admission queue, the running streams, their TTS and LLM slots, aborts, and the
token budget of each step's admission (:class:`PrefillBudget`).

Streams are plain records (no tensors: per-slot tensors live in the runner, indexed by slot).
Callers' threads (submit, abort, stats) and the step thread meet here under one lock.
"""

from __future__ import annotations

import collections
import heapq
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..base import (
    EngineOverloadedError,
    EngineStats,
    InvalidRequestError,
    OutputSink,
    SpeechRequest,
)
from ..streamed_text import StreamedText, unknown_stream
from ..work_admission import STREAM_KINDS, StreamWork, WorkAdmission
from .device.runner import pass_fits
from .joiner import StreamingAudioJoiner
from .speech_schedule import SpeechSchedule
from .text import PieceDecoder, TextFeed
from .voices import VoicePrefix
from .word_times import ReleasedWords


@dataclass
class StreamPlan:
    """What a stream speaks: a prompt for the speaker embedding and either text pieces (read
    mode: all of them, or with ``text_feed`` the first ones of streamed text) or LLM decoding
    (chat mode)."""

    request: SpeechRequest
    prompt: str
    pieces: list[str] | None
    text_feed: TextFeed | None = None
    # The prompt's token ids; a plan submitted without them gets them at submission (in the
    # caller's thread: the step thread never tokenizes).
    prompt_ids: list[int] | None = None
    # Usage's input tokens known when the plan was made: the instructions', and the text's
    # unless it is streamed (its feed counts those). Plans made by hand (the golden tests') leave 0.
    input_tokens: int = 0

    @property
    def is_chat(self) -> bool:
        return self.pieces is None


@dataclass
class Stream:
    """One admitted request's progress; ``slot``/``llm_slot`` are -1 while it holds none."""

    plan: StreamPlan
    sink: OutputSink  # where its chunks go (Engine.submit_to)
    submitted_at: float
    admitted_at: float | None = None  # when it got its slot (time.perf_counter())
    fed_text: StreamedText | None = None  # streamed input: written by callers under the lock
    voice: VoicePrefix | None = None  # a cloned voice, held from submission to the end
    schedule: SpeechSchedule | None = None
    slot: int = -1
    llm_slot: int = -1
    pieces: collections.deque = field(default_factory=collections.deque)  # text the TTS has not read
    text_done: bool = False  # no piece will follow those in ``pieces``
    text_at: float = 0.0  # streamed input: when text last came (time.monotonic())
    break_checked: int = -1  # streamed input: the feed's version last looked at for a break
    # chat mode: the LLM's side
    llm_len: int = 0
    next_token: int | None = None
    group: list[int] = field(default_factory=list)
    penalty_window: list[int] = field(default_factory=list)
    piece_decoder: PieceDecoder | None = None
    llm_tokens: int = 0
    # output
    tts_steps: int = 0
    joiner: StreamingAudioJoiner | None = None
    first_audio_at: float | None = None
    # when a listener playing its audio as it came would play it out: each chunk plays after the
    # last, or when it comes if that ran dry (time.perf_counter(); None before any audio)
    played_out_at: float | None = None
    chunks_sent: int = 0
    done: bool = False
    words: ReleasedWords | None = None  # with word_times: its words as their text is released
    committed: bool = False  # its work counts in the engine's admission (submission to end)
    work: StreamWork = field(init=False)  # what it costs the engine (STREAM_KINDS)

    def __post_init__(self) -> None:
        self.work = StreamWork(chat=self.plan.is_chat, cloned=self.voice is not None,
                               streamed=self.plan.text_feed is not None)

    @property
    def request_id(self) -> str:
        return self.plan.request.request_id


@dataclass
class PrefillBudget:
    """How much one step admits: prompts while they fit one LLM prefill pass of ``max_tokens``
    padded tokens (rows x the longest prompt) and ``max_prompts`` rows; the first always fits.
    A larger admission spreads over the next steps instead of stalling this one, as vLLM's token
    budget per step does."""

    max_prompts: int
    max_tokens: int
    prompts: list[list[int]] = field(default_factory=list)  # those taken, in admission order
    longest: int = 0  # of ``prompts``: the pass is len(prompts) x longest tokens

    def take(self, ids: list[int]) -> bool:
        """Take the prompt ``ids`` into the pass if it still fits."""
        if len(self.prompts) >= self.max_prompts or not pass_fits(
                len(self.prompts) + 1, max(self.longest, len(ids)), self.max_tokens):
            return False
        self.prompts.append(ids)
        self.longest = max(self.longest, len(ids))
        return True


class Scheduler:
    """The queue and the slots. Slots are handed out lowest first (heaps), so busy slots stay
    packed at the low end, where the CUDA graphs' batch buckets start."""

    def __init__(self, max_slots: int, max_chat_slots: int, max_queued: int,
                 admission_interval_steps: int, work: WorkAdmission,
                 admissions_per_step: int) -> None:
        self.lock = threading.Lock()
        self.pending: collections.deque[Stream] = collections.deque()
        self.active: dict[str, Stream] = {}
        self._streamed: dict[str, Stream] = {}  # queued or running streams that take fed text
        self._aborts: set[str] = set()
        self._free_slots = list(range(max_slots))
        self._free_llm_slots = list(range(max_chat_slots))
        self._max_queued = max_queued
        self._admission_interval = max(admission_interval_steps, 1)
        self.work = work  # admission by work (or slots): the gate at enqueue
        # the running streams by kind (STREAM_KINDS counts), kept as they start and leave
        self._running = np.zeros(len(STREAM_KINDS))
        self._admissions_per_step = admissions_per_step
        self._stats = EngineStats(max_slots=max_slots)

    # ---- callers' threads ------------------------------------------------------------------

    def check_room(self, *works: StreamWork) -> None:
        """Raise the refusal :meth:`enqueue` would give new streams of ``works`` now, for load
        (queue, slots, the real-time budget), all or none, taking nothing: the check before
        requests are planned, so refused ones cost no tokenization."""
        with self.lock:
            self._check_room(list(works), commit=False)

    def enqueue(self, streams: list[Stream]) -> None:
        """Queue new streams, all or none: raises when the queue is full, their work does not
        fit the engine's real-time budget (:class:`WorkAdmission`) or an id is taken."""
        with self.lock:
            ids = [s.request_id for s in streams]
            if len(set(ids)) < len(ids) or any(
                    i in self.active or any(s.request_id == i for s in self.pending) for i in ids):
                raise InvalidRequestError("duplicate request id", "request_id")
            self._check_room([s.work for s in streams])
            for stream in streams:
                stream.committed = True
            self.pending.extend(streams)
            self._streamed.update((s.request_id, s) for s in streams if s.fed_text is not None)

    def _check_room(self, works: list[StreamWork], commit: bool = True) -> None:
        """The queue's room, the slots' (admitting by work) and the budget's for new streams;
        with ``commit``, their work is taken (under the lock)."""
        if len(self.pending) + len(works) > self._max_queued:
            raise EngineOverloadedError("engine queue is full", "queue")
        if self.work.by_work:
            self._refuse_without_slots(works)
        self.work.take(works, queued_ahead=len(self.pending),
                       admissions_per_step=self._admissions_per_step, commit=commit)

    def _refuse_without_slots(self, works: list[StreamWork]) -> None:
        """Admitting by work, new streams need free slots beyond those the queue will take
        (a chat stream an LLM slot too); else they are refused now (under the lock)."""
        chat = sum(w.chat for w in works)
        queued_chat = sum(s.plan.is_chat for s in self.pending)
        if (len(self.pending) + len(works) > len(self._free_slots)
                or queued_chat + chat > len(self._free_llm_slots)):
            raise self.work.refuse_now(works, "slots", "every stream slot is taken")

    def feed(self, request_id: str, delta: str, done: bool) -> None:
        """Hand text to a streamed request (see :meth:`Engine.feed_text` for the errors)."""
        with self.lock:
            stream = self._streamed.get(request_id)
            if stream is None:
                raise unknown_stream(request_id)
            stream.fed_text.append(delta, done)

    def take_fed_text(self, stream: Stream) -> tuple[str, bool]:
        with self.lock:
            return stream.fed_text.take()

    def request_abort(self, request_id: str) -> None:
        with self.lock:
            self._aborts.add(request_id)
            self._streamed.pop(request_id, None)

    def stats(self) -> EngineStats:
        with self.lock:
            self._stats.active_streams = len(self.active)
            self._stats.queued_streams = len(self.pending)
            if self.work.by_work:  # a stream without a free slot is refused (enqueue)
                self._stats.free_slots = max(len(self._free_slots) - len(self.pending), 0)
            stats = EngineStats(**self._stats.as_dict())
        return stats.with_work(self.work.snapshot())

    def open_by_kind(self) -> np.ndarray:
        """The running streams by kind (STREAM_KINDS counts), for the admission's step model."""
        return self._running.copy()

    def expire_waiting(self, now: float, next_step: bool = False) -> list[Stream]:
        """Queued streams whose first audio can no longer come in time (admission by work;
        with ``next_step``, not by the next step's admission either): out of the queue, their
        work released; the caller refuses them."""
        with self.lock:
            oldest = self.pending[0].submitted_at if self.pending else now
            if now - oldest <= self.work.shortest_wait_s(next_step):
                return []  # the oldest has not waited past any allowance: none has
            # a streamed-text session's stream keeps its place (admitted at session.start)
            late = [gone and s.fed_text is None for s, gone in zip(self.pending, self.work.expired(
                [(now - s.submitted_at, s.plan.is_chat) for s in self.pending], next_step))]
            if not any(late):
                return []
            expired = [s for s, gone in zip(self.pending, late) if gone]
            self.pending = collections.deque(s for s, gone in zip(self.pending, late) if not gone)
        for stream in expired:
            stream.committed = False
        return expired

    # ---- step thread -----------------------------------------------------------------------

    def idle(self) -> bool:
        return not self.active and not self.pending and not self._aborts

    def running(self) -> list[Stream]:
        return list(self.active.values())

    def take_aborted(self) -> list[Stream]:
        """Streams aborted since the last step, out of the queue or released from their slots."""
        with self.lock:
            aborts, self._aborts = self._aborts, set()
            taken = [s for s in self.pending if s.request_id in aborts]
            self.pending = collections.deque(s for s in self.pending if s.request_id not in aborts)
            self._stats.aborted += len(taken)
        for stream in taken:
            self._uncommit(stream)
        for request_id in aborts:
            stream = self.active.get(request_id)
            if stream is not None:
                self.release(stream)
                taken.append(stream)
                with self.lock:
                    self._stats.aborted += 1
        return taken

    def admit(self, step: int, fits: Callable[[Stream], bool] | None = None) -> list[Stream]:
        """Queued streams that get slots now, in order (a chat stream also needs an LLM slot);
        with ``fits``, only while it accepts the next stream (the step's prefill budget): the
        rest wait, in order, for the next step."""
        admitted: list[Stream] = []
        queued = len(self.pending)
        # batch admissions (one LLM prefill per few steps instead of one per step), or a
        # listener ran dry lately (the engine catches up first: WorkAdmission)
        waits = bool(self.active) and bool(step % self._admission_interval or self.work.holding())
        if not waits:
            self._start_queued(admitted, fits)
        self.work.observe_queue(len(admitted), queued, self._admissions_per_step)
        return admitted

    def _start_queued(self, admitted: list[Stream], fits: Callable[[Stream], bool] | None) -> None:
        """Start queued streams into ``admitted`` while slots (and ``fits``) allow, in order."""
        with self.lock:
            while self.pending and self._free_slots:
                stream = self.pending[0]
                if stream.plan.is_chat and not self._free_llm_slots:
                    break
                if fits is not None and not fits(stream):
                    break
                self.pending.popleft()
                stream.slot = heapq.heappop(self._free_slots)
                if stream.plan.is_chat:
                    stream.llm_slot = heapq.heappop(self._free_llm_slots)
                admitted.append(stream)
                self.active[stream.request_id] = stream
                self._running += stream.work.vector()

    def admit_within(self, step: int, budget: PrefillBudget,
                     prompt_ids: Callable[[Stream], list[int]]) -> list[Stream]:
        """:meth:`admit` within the step's token budget: queued streams get slots while their
        prompts (``prompt_ids``) fit ``budget``, which then holds the prompts to prefill."""
        return self.admit(step, lambda stream: budget.take(prompt_ids(stream)))

    def free_llm_slot(self, stream: Stream) -> None:
        with self.lock:
            if stream.llm_slot >= 0:
                heapq.heappush(self._free_llm_slots, stream.llm_slot)
        stream.llm_slot = -1

    def _uncommit(self, stream: Stream) -> None:
        if stream.committed:
            stream.committed = False
            self.work.release(stream.work)

    def release(self, stream: Stream) -> None:
        """The stream leaves: its slots and its work are free for the next admission."""
        self._uncommit(stream)
        if self.active.pop(stream.request_id, None) is not None:
            self._running -= stream.work.vector()
        with self.lock:
            self._streamed.pop(stream.request_id, None)
            if stream.slot >= 0:
                heapq.heappush(self._free_slots, stream.slot)
            if stream.llm_slot >= 0:
                heapq.heappush(self._free_llm_slots, stream.llm_slot)
        stream.slot = stream.llm_slot = -1

    def count(self, completed: int = 0, failed: int = 0, llm_steps: int = 0) -> None:
        with self.lock:
            self._stats.completed += completed
            self._stats.failed += failed
            self._stats.llm_steps += llm_steps

    def count_step_time(self, seconds: float, cpu_seconds: float = 0.0, ran_dry: int = 0) -> None:
        """A step ended: its time, and its chunks that came after their listener ran out."""
        with self.lock:
            self._stats.step_seconds += seconds
            self._stats.step_cpu_seconds += cpu_seconds
            self._stats.ran_dry_chunks += ran_dry

    def count_step(self, batch_size: int) -> None:
        with self.lock:
            self._stats.steps += 1
            self._stats.last_batch_size = batch_size
            self._stats.max_batch_size_seen = max(self._stats.max_batch_size_seen, batch_size)
