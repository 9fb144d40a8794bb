"""Pauses of Python's cyclic garbage collector in a replica's process: kept out of the way, and
logged.

A collection stops every thread of its process. In a replica relaying a thousand streams a full
collection walks every live object (the imports, Ray, the app, each stream's state): the kind of
pause that shows in a tail and nowhere in a mean. :func:`settle_replica_process` runs once a
replica has built itself: what exists then lives as long as the process, and ``gc.freeze`` takes
it out of the collector's sight, as the engine process does after loading its model
(``serve_app/engines/minicpmo/engine.py:settle_gpu_process``; vLLM does the same).

Each collection of at least :data:`LOGGED_PAUSE_MS` is recorded with its clock reading
(``time.perf_counter``, one clock for every process of a machine) and logged by the next call of
:func:`log_pauses` (the replicas call it when they log a request), never from inside the
collector's callback: ``gc pause at_clock=... ms=... generation=...``. The served benchmarks
read these lines (``bench/served/served_logs.py:gc_pauses``).
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections import deque

logger = logging.getLogger(__name__)

FREEZE_ENV = "SERVE_APP_GC_FREEZE"
LOGGED_PAUSE_MS = 5.0  # shorter collections are the young generation's routine ones


class GcPauses:
    """Collections of this process that took at least ``min_ms``, until logged."""

    def __init__(self, min_ms: float = LOGGED_PAUSE_MS) -> None:
        self.min_s = min_ms / 1000
        self.pending: deque[tuple[float, float, int]] = deque(maxlen=1000)
        self._started: float | None = None
        gc.callbacks.append(self._on_collection)

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        took = time.perf_counter() - self._started
        if took >= self.min_s:
            self.pending.append((self._started, took, int(info.get("generation", -1))))
        self._started = None

    def log(self) -> None:
        while self.pending:
            started, took, generation = self.pending.popleft()
            logger.info("gc pause at_clock=%.6f ms=%.1f generation=%d", started, took * 1000,
                        generation)

    def close(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)


_pauses: GcPauses | None = None


def settle_replica_process() -> None:
    """Once a replica has built itself: freeze what it built out of the collector's sight and
    start recording its collections' pauses (once per process). ``SERVE_APP_GC_FREEZE=0`` in
    the replicas' environment leaves the heap in the collector's sight (for an A/B)."""
    global _pauses
    if os.environ.get(FREEZE_ENV, "1") != "0":
        gc.collect()
        gc.freeze()
    if _pauses is None:
        _pauses = GcPauses()


def log_pauses() -> None:
    """Log the collections recorded since the last call (none before settle_replica_process)."""
    if _pauses is not None:
        _pauses.log()
