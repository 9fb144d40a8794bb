"""Admission by work: a stream starts only while the engine can keep it real-time.

Counting slots admits a chat stream as if it cost what a read stream costs; an engine whose
slots hold twice the work it can speak then lets every stream run late. Here each engine keeps a
model of its own step, measured as it runs, and admits a stream only while the projected load
stays inside its real-time budget with a margin (``admission_margin``). What does not fit is
refused at once, before any work is spent on it, with an :class:`EngineOverloadedError` whose
``reason`` says why (the service answers 503 with ``Retry-After``).

**Load** is the share of its real-time budget the engine's step uses: for MiniCPM-o the step's
time over the audio each stream gets from one step (``EngineStats.step_budget_s``); for Piper,
the engine seconds its open streams need per second to be spoken in real time (its streams
times its recent engine seconds per audio second). 1.0 means the engine only just keeps real
time.

**The model** (:class:`StepLoadModel`): load = intercept + the sum over open streams of their
kind's cost, with one cost per :data:`STREAM_KINDS` feature: a read stream, a chat stream, and
the extra of a cloned voice and of streamed-in text. It is fitted by least squares over the
engine's recent steps, so the costs follow the GPU, the model's size and
the mix actually served; nothing is written per GPU. Before it has seen load, its prior is slot
admission's (a read stream costs ``limit / max_slots``, a chat stream ``limit / max_chat_slots``),
so a cold engine admits no more than the slots would; a prior's weight in the fit is a few steps.

**Committed work** counts every stream from its admission to its end: queued and running, and a
streamed-text session while it waits for text, so the work a session will still bring keeps its
place and sessions opened later cannot starve it (its later text is never refused for load).

**Slots**: the work a stream brings may fit while every slot is taken (a read stream costs
little, and slots bound how many run); a stream for which no slot is free, counting those
queued ahead, is refused at once (reason ``slots``): waiting for a stream to end would be
waiting seconds.

**Waiting**: a stream that cannot take a slot now may wait in the engine's queue only as long as
its first audio can still come within ``first_audio_deadline_s``, its kind's recent first audio
after admission taken at its 90th percentile (the tail, not the mean: the deadline bounds the
admitted streams' TTFB p99), at most ``max_queue_wait_s`` (a refusal from the queue is quick,
or it is not one), and never less than one step (every queued stream gets the next
admission). A step's admission refuses the queued streams it did not start whose wait would
outlast their allowance by the next one (reason ``wait``): a refusal comes at the last
admission that could have started the stream, not after its allowance, and before any work on
it. At submission, a queue that already holds more than that time's admissions refuses at
once (reason ``queue``), at the pace it has been starting streams while it held more (holds
and prefill budgets included), not the most a step may start: a queue that starts fewer would
refuse them late.

**Behind**: the model projects a steady step; a burst of admissions, a slower mix or a pause can
still let a listener's audio run out (a stream *ran dry*: its next audio came after it had
played all it had). With ``behind_hold_s`` set, a step where any stream ran dry stops
admission for that long: new streams are refused (reason ``behind``) and queued ones wait
for a slot, so the engine catches up on what it holds instead of taking more; a queued one
whose wait would outlast its allowance (Waiting) is refused at the next step, not once the
allowance has run out. And a step whose listeners ran thin faster than it could cut their
audio (``audio_cuts: on_demand``) starts no queued stream at the next: a ramp of new streams,
each thin after its first chunk, paces itself to what the engine can keep fed; a new stream's
projected wait counts that step, and a queued one that cannot wait a step more is refused at
its start (``thin_holds_queue``; without it the queue starts anyway). The model's projection
alone cannot see what the engine's listeners see.

``admission: slots`` keeps the old rule (a free slot admits, the queue waits as long as the
timeouts allow): the A/B of the overload benchmark.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

from .errors import EngineOverloadedError

if TYPE_CHECKING:
    from .base import SpeechRequest

STREAM_KINDS = ("read", "chat", "cloned", "streamed")
ADMISSION_MODES = ("work", "slots")
REFUSAL_REASONS = ("work", "wait", "queue", "behind", "slots")
# New streams wait while the last steps' measured load (EWMA) is this far over the limit.
MEASURED_SLACK = 0.1
MIN_WAIT_STEPS = 1  # a queued stream may always wait this many steps for its slot
# The first audio after admission a queued stream's wait leaves room for: this quantile of each
# kind's last FIRST_AUDIO_SAMPLES (Waiting).
FIRST_AUDIO_QUANTILE = 0.9
FIRST_AUDIO_SAMPLES = 200
# The fit's assumed noise in one step's load (its std, as a share of the budget): the prior's
# weight against the data.
STEP_LOAD_NOISE = 0.05
# A step's load counts at most this far from the fit's (half the budget): a collection's pause
# is clipped, while a real change of pace, however large, moves the fit within a few steps.
OUTLIER = 0.5
# Each cost may move this many times its prior's size (its prior's std) before data pins it.
PRIOR_SPREAD = 2.0
# The fit sees the last this many steps (about a minute of a GPU engine's 50 ms steps).
WINDOW_STEPS = 1000
# No measured cost falls below this share of its prior (a fit at light load sees a flat step).
COST_FLOOR_SHARE = 0.25
PRIOR_INTERCEPT_SHARE = 0.1  # of the limit: the step's cost with no stream
# The queue's measured pace (streams started a step) is taken as at least this (Waiting).
DRAIN_FLOOR = 0.5


@dataclass(frozen=True)
class StreamWork:
    """What one stream brings, as counts of :data:`STREAM_KINDS` (1 or 0 each)."""

    chat: bool = False
    cloned: bool = False
    streamed: bool = False

    @classmethod
    def of_request(cls, request: SpeechRequest, cloned: bool = False) -> "StreamWork":
        """What a request will bring: chat or read by its mode, streamed-in text by its input,
        ``cloned`` when it speaks in a cloned voice (the engine knows which voices are)."""
        return cls(chat=request.mode == "chat", cloned=cloned,
                   streamed=request.text_input == "streamed")

    def vector(self) -> np.ndarray:
        return np.array([0.0 if self.chat else 1.0, 1.0 if self.chat else 0.0,
                         float(self.cloned), float(self.streamed)])

    @property
    def kind(self) -> str:
        return "chat" if self.chat else "read"


class StepLoadModel:
    """load = intercept + costs . counts, fitted to the last :data:`WINDOW_STEPS` steps by
    least squares with the prior as a ridge: a direction the window's steps do not vary in
    (only read streams for a while, say) keeps its prior, never a wild value, and one odd step
    (a collection's pause) counts as at most half a budget off among the window's."""

    def __init__(self, prior_costs: Sequence[float], prior_intercept: float) -> None:
        self._prior = np.array([prior_intercept, *prior_costs], dtype=np.float64)
        spread = np.maximum(self._prior * PRIOR_SPREAD, 1e-9)
        self._ridge = np.diag(STEP_LOAD_NOISE ** 2 / spread ** 2)
        size = len(self._prior)
        self._xx = np.zeros((size, size))  # the window's sums of x x^T and x y
        self._xy = np.zeros(size)
        self._window: collections.deque[tuple[np.ndarray, float]] = collections.deque()
        self.theta = self._prior.copy()
        self._stale = False

    def observe(self, counts: Sequence[float], load: float) -> None:
        """One step: the open streams by kind, and the load it measured."""
        x = np.array([1.0, *counts], dtype=np.float64)
        # an odd step counts as half a budget off at most
        expected = float(x @ self._fitted())
        load = min(max(load, expected - OUTLIER), expected + OUTLIER)
        self._window.append((x, load))
        self._xx += np.outer(x, x)
        self._xy += x * load
        if len(self._window) > WINDOW_STEPS:
            old, old_load = self._window.popleft()
            self._xx -= np.outer(old, old)
            self._xy -= old * old_load
        self._stale = True

    def _fitted(self) -> np.ndarray:
        if self._stale:
            self.theta = np.linalg.solve(self._xx + self._ridge,
                                         self._xy + self._ridge @ self._prior)
            self._stale = False
        return self.theta

    @property
    def intercept(self) -> float:
        return max(float(self._fitted()[0]), 0.0)

    @property
    def costs(self) -> np.ndarray:
        """Each kind's cost, never below a share of its prior."""
        return np.maximum(self._fitted()[1:], self._prior[1:] * COST_FLOOR_SHARE)

    def load(self, counts: np.ndarray) -> float:
        return self.intercept + float(self.costs @ counts)


@dataclass
class AdmissionCounters:
    """Admissions and refusals so far, by reason; ``refused_load`` sums the refused streams'
    projected load (the demand the autoscaler adds)."""

    admitted: int = 0
    refused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REFUSAL_REASONS, 0))
    refused_load: float = 0.0


class WorkAdmission:
    """The engine's admission by work (module docstring). Thread-safe: callers' threads submit,
    the step thread observes steps and expires waiting streams."""

    def __init__(self, mode: str, margin: float, first_audio_deadline_s: float,
                 max_slots: int, max_chat_slots: int, behind_hold_s: float = 0.0,
                 max_queue_wait_s: float = math.inf, thin_holds_queue: bool = True) -> None:
        if mode not in ADMISSION_MODES:
            raise ValueError(f"admission must be one of {ADMISSION_MODES}")
        if not 0 <= margin < 1:
            raise ValueError("admission_margin must be in [0, 1)")
        self.mode = mode
        self.limit = 1.0 - margin
        self.first_audio_deadline_s = first_audio_deadline_s
        self.max_queue_wait_s = max_queue_wait_s
        self.thin_holds_queue = thin_holds_queue  # Behind: thin listeners pause the queue
        # the prior: the slots full of one kind just fill the limit
        intercept = PRIOR_INTERCEPT_SHARE * self.limit
        read = (self.limit - intercept) / max(max_slots, 1)
        chat = (self.limit - intercept) / max_chat_slots if max_chat_slots else read
        self.model = StepLoadModel([read, chat, 0.1 * read, 0.1 * read], intercept)
        self._committed = np.zeros(len(STREAM_KINDS))
        self._lock = threading.Lock()
        # admission to first audio, read and chat: the recent samples and their quantile
        self._first_audio_samples = (collections.deque(maxlen=FIRST_AUDIO_SAMPLES),
                                     collections.deque(maxlen=FIRST_AUDIO_SAMPLES))
        self._first_audio_s = [0.0, 0.0]
        self._step_s = 0.0  # recent step time (EWMA)
        self.measured_load = 0.0  # recent steps' load as measured (EWMA), the model aside
        self.behind_hold_s = behind_hold_s
        self._behind_until = 0.0  # time.monotonic() until which admission holds (Behind)
        self._thin = False  # the last step left thin listeners uncut (Behind)
        # streams the queue started per step while it held more (EWMA; 0: not seen yet)
        self._drain_per_step = 0.0
        self.counters = AdmissionCounters()

    @property
    def by_work(self) -> bool:
        return self.mode == "work"

    # ---- callers' threads ------------------------------------------------------------------

    def take(self, works: Sequence[StreamWork], queued_ahead: int = 0,
             admissions_per_step: int = 0, commit: bool = True) -> None:
        """Commit the work of new streams, all or none; raises :class:`EngineOverloadedError`
        (``reason``) if they do not fit (in ``work`` mode; ``slots`` mode only counts). Without
        ``commit``, only the check (a refusal is counted): a caller's look before it spends
        work on a request (its tokenization), which the committing take repeats."""
        added = sum((w.vector() for w in works), np.zeros(len(STREAM_KINDS)))
        with self._lock:
            if self.by_work:
                load = self.model.load(self._committed + added)
                # the projection, and what the last steps measured: a fit that lags a change
                # of pace cannot admit past what the engine is doing now
                # an engine that holds nothing takes what it is offered: a model that learned
                # a slow spell would otherwise refuse for ever, with no step to unlearn it
                busy = bool(self._committed.any())
                if busy and (load > self.limit
                             or self.measured_load > self.limit + MEASURED_SLACK):
                    self._refuse("work", added)
                    raise EngineOverloadedError("the engine's real-time budget is full", "work")
                if self._behind():
                    self._refuse("behind", added)
                    raise EngineOverloadedError(
                        "the engine is catching up on the streams it holds", "behind")
                if admissions_per_step and (queued_ahead or self._thin_hold()):
                    # the steps until its admission, and the next one if it holds the queue
                    per_step = min(admissions_per_step, self._drain_per_step or admissions_per_step)
                    wait_s = (math.ceil((queued_ahead + 1) / per_step) * self._step_s
                              + self._before_next_start_s(False))
                    if wait_s > max(self._wait_allowance_s(w.chat) for w in works):
                        self._refuse("queue", added)
                        raise EngineOverloadedError("the engine's queue would start it too late", "queue")
            if commit:
                self._committed += added
                self.counters.admitted += len(works)

    def refuse_now(self, works: Sequence[StreamWork], reason: str,
                   message: str) -> EngineOverloadedError:
        """New streams refused before they were taken (the engine's own check): counted."""
        with self._lock:
            self._refuse(reason, sum((w.vector() for w in works), np.zeros(len(STREAM_KINDS))))
        return EngineOverloadedError(message, reason)

    def release(self, work: StreamWork) -> None:
        """A committed stream ended (completed, failed, aborted or refused while waiting)."""
        with self._lock:
            self._committed = np.maximum(self._committed - work.vector(), 0.0)

    def snapshot(self) -> dict[str, float]:
        """The load committed now, the limit, each kind's cost (stats and routing)."""
        with self._lock:
            costs = self.model.costs
            return {"work_load": self.model.load(self._committed),
                    "measured_load": self.measured_load,
                    "work_limit": self.limit if self.by_work else 0.0,
                    **{f"{kind}_stream_load": float(cost)
                       for kind, cost in zip(STREAM_KINDS, costs)},
                    "admitted_streams": self.counters.admitted,
                    **{f"refused_{reason}": count
                       for reason, count in self.counters.refused.items()},
                    "refused_load": self.counters.refused_load}

    # ---- step thread -----------------------------------------------------------------------

    def committed(self) -> np.ndarray:
        """The admitted and queued streams by kind (STREAM_KINDS counts)."""
        with self._lock:
            return self._committed.copy()

    def shortest_wait_s(self, next_step: bool = False) -> float:
        """The shortest a queued stream of any kind may still wait, the hold left (Behind)
        and with ``next_step`` a step counted as waited (inf admitting by slots)."""
        if not self.by_work:
            return math.inf
        with self._lock:
            return (min(self._wait_allowance_s(False), self._wait_allowance_s(True))
                    - self._hold_left_s() - self._before_next_start_s(next_step))

    def holding(self) -> bool:
        """Whether queued streams wait for their slots (Behind): a stream ran dry lately, or
        the last step left thin listeners uncut."""
        with self._lock:
            return self._behind() or self._thin_hold()

    def observe_step(self, counts: np.ndarray, load: float, step_s: float,
                     ran_dry: int = 0, uncut_thin: int = 0) -> None:
        """One step ran with ``counts`` streams open by kind and measured ``load``; ``ran_dry``
        of its chunks came after their listener had played all it had, and ``uncut_thin``
        thin listeners were left for a later step."""
        with self._lock:
            self._thin = self.by_work and uncut_thin > 0
            if ran_dry and self.by_work and self.behind_hold_s:
                self._behind_until = time.monotonic() + self.behind_hold_s
            self._step_s = step_s if not self._step_s else 0.9 * self._step_s + 0.1 * step_s
            if counts.any():
                self.model.observe(counts, load)
                self.measured_load = 0.8 * self.measured_load + 0.2 * load
            else:
                self.measured_load = 0.0

    def observe_queue(self, started: int, queued: int, most: int) -> None:
        """A step began with ``queued`` streams waiting and started ``started`` of them (0 on a
        step that held them), ``most`` at most. The pace at which the queue starts streams,
        holds and prefill budgets included, is what a new stream's wait is projected at: a
        queue that empties says only that it could start ``most``."""
        if queued <= 0:
            return
        sample = float(started if started < queued else most)
        with self._lock:
            self._drain_per_step = max(DRAIN_FLOOR, sample if not self._drain_per_step
                                       else 0.8 * self._drain_per_step + 0.2 * sample)

    def observe_first_audio(self, after_admission_s: float, chat: bool = False) -> None:
        """A stream's first audio came ``after_admission_s`` after it got its slot."""
        with self._lock:
            samples = self._first_audio_samples[chat]
            samples.append(after_admission_s)
            self._first_audio_s[chat] = float(np.quantile(samples, FIRST_AUDIO_QUANTILE))

    def expired(self, waits: Iterable[tuple[float, bool]], next_step: bool = False) -> list[bool]:
        """Which waiting streams can no longer have their first audio in time (``work`` mode
        only): (seconds waited so far, chat or not) of each, in order; with ``next_step``,
        those that could not by the next step's admission either (the caller's admission just
        passed them over). A hold (Behind) starts no queued stream before it ends: a stream
        whose allowance ends first is refused now, not when its allowance runs out (a refusal
        is quick, or it is not one); so is one the coming admission will not start because
        thin listeners hold the queue, and that cannot wait for the next."""
        if not self.by_work:
            return [False for _ in waits]
        with self._lock:
            allowance = [self._wait_allowance_s(False), self._wait_allowance_s(True)]
            ahead_s = self._hold_left_s() + self._before_next_start_s(next_step)
        return [waited + ahead_s > allowance[chat] for waited, chat in waits]

    def refuse_waiting(self, work: StreamWork) -> EngineOverloadedError:
        """A waiting stream is refused: its work leaves, and the refusal is counted."""
        with self._lock:
            self._committed = np.maximum(self._committed - work.vector(), 0.0)
            self._refuse("wait", work.vector())
        return EngineOverloadedError("the engine could not start it in time", "wait")

    # ---- inside the lock ---------------------------------------------------------------------

    def _behind(self) -> bool:
        return self.by_work and time.monotonic() < self._behind_until

    def _thin_hold(self) -> bool:
        return self._thin and self.thin_holds_queue

    def _hold_left_s(self) -> float:
        """How long the hold (Behind) still stops queued streams from starting."""
        return max(self._behind_until - time.monotonic(), 0.0) if self.by_work else 0.0

    def _before_next_start_s(self, next_step: bool) -> float:
        """A step if the next admission that may start a queued stream is a step away: one
        just passed it over (``next_step``), or the coming one starts none (thin listeners)."""
        return self._step_s if next_step or self._thin_hold() else 0.0

    def _wait_allowance_s(self, chat: bool) -> float:
        """How long a queued stream may wait for its slot: what its deadline leaves after its
        kind's first audio takes, at most ``max_queue_wait_s``, and never less than a few steps
        (an engine slower than the deadline still serves what it can start at once)."""
        return max(min(self.first_audio_deadline_s - self._first_audio_s[chat],
                       self.max_queue_wait_s), MIN_WAIT_STEPS * self._step_s)

    def _refuse(self, reason: str, added: np.ndarray) -> None:
        self.counters.refused[reason] += int(round(added[0] + added[1])) or 1
        self.counters.refused_load += float(self.model.costs @ added)
