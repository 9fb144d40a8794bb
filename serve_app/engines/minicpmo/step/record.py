"""The step log: one :class:`StepRecord` per engine step, for benchmarks that ask what a tail
latency is made of (``Engine.step_log``; ``bench/engine/measure.py`` reads it)."""

from __future__ import annotations

import collections
import time
from collections.abc import Mapping
from dataclasses import dataclass

from ..scheduler import Stream
from .gc_clock import GarbageCollectionClock

STEP_LOG_LENGTH = 100_000  # steps kept in the step log (a few minutes of a busy engine)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step, for benchmarks that ask what a tail latency is made of."""

    started_s: float  # time.perf_counter() when the step began
    seconds: float  # how long it ran
    generating: int  # streams that got audio frames in it
    queue_waits_s: tuple[float, ...]  # each stream admitted in it: submission to admission
    gc_s: float = 0.0  # spent in Python's garbage collector during it (any thread's collection)
    # seconds of the step in each phase (host time; device time too with ``profile_phases``,
    # which syncs the GPU at each phase's end), and what the device was asked to do in it
    # (``ModelRunner.work`` counted over the step): what a slow step was slow at
    phases_s: tuple[tuple[str, float], ...] = ()
    work: tuple[tuple[str, int], ...] = ()


class StepRecorder:
    """Makes each step's :class:`StepRecord` (the step fills in ``admitted`` and ``generating``)
    and keeps the last :data:`STEP_LOG_LENGTH` of them in ``log``."""

    def __init__(self, work: Mapping[str, int]) -> None:
        self.log: collections.deque[StepRecord] = collections.deque(maxlen=STEP_LOG_LENGTH)
        self.admitted: list[Stream] = []  # streams admitted in the step
        self.generating = 0  # streams that got audio frames in it
        self._work = work  # the runner's counts of device work, which grow as it is asked
        self._gc_clock = GarbageCollectionClock()
        self._started_s = 0.0
        self._gc_before_s = 0.0
        self._work_before: dict[str, int] = {}

    def start(self) -> float:
        """A step begins; returns when (time.perf_counter())."""
        self._started_s = time.perf_counter()
        self._gc_before_s = self._gc_clock.total_s
        self._work_before = dict(self._work)
        return self._started_s

    def finish(self, phases_s: tuple[tuple[str, float], ...]) -> None:
        """Log the step that ran since :meth:`start`; the next one starts from nothing."""
        before = self._work_before
        self.log.append(StepRecord(
            self._started_s, time.perf_counter() - self._started_s, self.generating,
            tuple(s.admitted_at - s.submitted_at for s in self.admitted),
            self._gc_clock.total_s - self._gc_before_s, phases_s,
            tuple((kind, count - before.get(kind, 0)) for kind, count in self._work.items()
                  if count != before.get(kind, 0))))
        self.admitted, self.generating = [], 0

    def close(self) -> None:
        self._gc_clock.close()
