"""The Synthesizer replica's check of its engine's room, before any submission.

The engine pushes its stats about ten times a second (``EngineClient.stats``). Under a burst,
hundreds of requests reach the replica between two pushes; checked against the last stats
alone, every one of them passes while the stats say there is room for a few, and the rest
queue for their submission round trips to a busy engine process, which then refuses them:
refusals in over a second (read at 3x on an H200: the replica's wait before the engine 1.25 s
at p99, its engine's first audio 0.41 s). :class:`RoomCheck` counts the streams it let through
since the stats it checked came, each weighed as the routing reports weigh a stream of another
kind (``serve_app/gpu/routing.py:room_left``), and refuses at once what the stats' headroom no
longer covers. It never counts a stream twice: the count starts again with each new push, so
a stream that passed before it is in the push's figures, or in neither (the engine decides).
A stream counts for :data:`PASS_WINDOW_S` at most: the engine pushes only when its stats
change, and on a loaded machine its pushes come late, while streams that passed long ago have
long been in its figures (and some have ended). An engine that held nothing in its last stats
takes what comes, as it would itself.
"""

from __future__ import annotations

import collections
import time

from serve_app.engines.stats import EngineStats

# How long a stream let through counts against the last stats: a few of the engine's pushes
# (serve_app/gpu/engine_process.py, STATS_INTERVAL_S 0.1 s).
PASS_WINDOW_S = 0.3


class RoomCheck:
    """Whether one more stream fits: the last stats pushed, less what passed since (module
    docstring). Called on the replica's event loop only."""

    def __init__(self) -> None:
        self._stats: EngineStats | None = None
        # streams let through since ``_stats`` came: (time.monotonic(), kind), oldest first
        self._passed: collections.deque[tuple[float, str]] = collections.deque()

    def refusal(self, stats: EngineStats, kind: str) -> str | None:
        """None when one more stream of ``kind`` fits (it is counted as passed); else why not
        (an ``EngineOverloadedError`` reason)."""
        now = time.monotonic()
        if stats is not self._stats:
            self._stats = stats
            self._passed.clear()
        while self._passed and now - self._passed[0][0] > PASS_WINDOW_S:
            self._passed.popleft()
        idle = stats.active_streams + stats.queued_streams == 0
        if stats.work_limit > 0 and not idle:
            used = self._used(stats, kind)
            if stats.headroom(kind) - used < 1:
                return stats.refusal_reason(kind, used)
        self._passed.append((now, kind))
        return None

    def _used(self, stats: EngineStats, kind: str) -> float:
        """The streams passed since ``stats``, in streams of ``kind``: each weighed by the ratio
        of the two kinds' headrooms (a chat stream is several read streams of work)."""
        room = stats.headroom(kind)
        used = 0.0
        for _, other in self._passed:
            other_room = stats.headroom(other)
            used += room / other_room if other_room > 0 else 1.0
        return used
