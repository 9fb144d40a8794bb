"""Audio cut on demand (``audio_cuts: on_demand``): a short first chunk, then more cuts whenever
a listener's buffer runs thin, decided with the clock at the end of each step's window; the
default plans them at admission instead (:mod:`.first_chunk`).

The engine makes w = ``steps_per_sync`` (5) frames a step for every stream (107 ms of audio; a
step at load takes 40-100 ms on an H100), and a piece decided at the end of one step's window
reaches the listener in the next step. Every piece holds back ``CONTEXT_FRAMES`` (4) for the
crossfade, so a first chunk of F frames gives the listener (F - 4) x 21.3 ms.

- the first chunk: the shortest length whose audio outlasts the slowest recent step (plus
  :data:`GUARD_S`), since the second piece comes a step after the first;
- after it, at the end of each step's window, a stream whose listener would run out of audio
  before the piece after next could arrive (a slow step and :data:`STEP_ENDS_S` from now, plus
  :data:`GUARD_S`) has its call's audio so far cut and sent, up to ``thin_cuts_per_step``
  streams a step (an engine option); the others wait for their call's end (upstream's pieces).

Where the planned cuts assume a step time at admission, these follow what the steps do after
it: a load that slows the steps later brings cuts back for as long as needed. Measured on the
engine alone at 768 read streams with the fp8 cache, each against the planned cuts on the same
H100 (docs/benchmarks/history/engine-h100-audio-cuts-*): on a slower machine, with a 20 ms
guard, TTFB p50 / p99 203 / 365 ms against 272 / 489 and the same decode work a step, but 2.5 %
of the streams ran dry (by up to 19 ms); on a faster one, with the 40 ms guard, even with the
planned cuts (200 / 337 against 207 / 336 ms), every stream real-time. Off by default until it
holds every stream where the planned cuts do, served too.
"""

from __future__ import annotations

import collections
from typing import Iterable

from ..options import EngineOptions
from ..scheduler import Stream
from .first_chunk import audio_sent_s
# How many recent steps the slowest is taken from (32 steps: 1.5-3 s at load)
RECENT_STEPS = 32
# Time the listener must still hold when the next audio is due (the spread of the moment in a
# step at which its chunks leave; 20 ms left 2.5 % of 768 streams dry by up to 19 ms)
GUARD_S = 0.040
# Not cut now, a stream's next audio leaves with the piece after next: the rest of this step
# (its decode queued), a whole step, and the next one's start (plan, launch, the decode awaited)
# pass first. The steps' ends and starts: about 25 ms at 1024 read streams on an H100, as
# estimated from the phases' host times there (not timed on their own)
STEP_ENDS_S = 0.040


class OnDemandCuts:
    """Follows the engine's step times; picks each new stream's first chunk and the streams whose
    audio is cut at the end of a step (the interface of :class:`.first_chunk.FirstChunkPlanner`)."""

    on_demand = True  # the step loop asks :meth:`running_thin` at each step's end

    def __init__(self, options: EngineOptions) -> None:
        self.lengths = options.first_chunk_lengths
        self.follows_load = options.first_chunk_follows_load and bool(self.lengths)
        self.recent: collections.deque[float] = collections.deque(maxlen=RECENT_STEPS)
        # thin streams the last step could not cut (over ``cuts_per_step``): admission by work
        # starts no new stream while there are any (WorkAdmission, "Behind")
        self.uncut_thin = 0
        self.cuts_per_step = options.thin_cuts_per_step

    def observe(self, step_s: float) -> None:
        """A step took ``step_s`` seconds."""
        self.recent.append(step_s)

    @property
    def slow_step_s(self) -> float:
        """The slowest of the recent steps (0 before the first)."""
        return max(self.recent, default=0.0)

    def cuts_at_admission(self) -> tuple[int, ...]:
        """Where a stream admitted now has its first call's audio cut (empty: upstream's pieces,
        one per call, as when steps are too slow for any shorter first chunk)."""
        if not self.lengths:
            return ()
        if not self.follows_load:
            return (self.lengths[0],)
        for first in self.lengths:
            if audio_sent_s(first) >= self.slow_step_s + GUARD_S:
                return (first,)
        return ()

    def running_thin(self, streams: Iterable[Stream], now: float) -> list[Stream]:
        """Of ``streams``, those whose listener (:attr:`~.scheduler.Stream.played_out_at`)
        would run out before the piece after next could come: their audio is cut now (the
        ``cuts_per_step`` thinnest)."""
        if not self.follows_load:
            return []
        due = now + self.slow_step_s + STEP_ENDS_S + GUARD_S
        thin = [(s.played_out_at, index, s) for index, s in enumerate(streams)
                if s.played_out_at is not None and s.played_out_at < due]
        self.uncut_thin = max(0, len(thin) - self.cuts_per_step)
        return [s for _, _, s in sorted(thin)[:self.cuts_per_step]]
