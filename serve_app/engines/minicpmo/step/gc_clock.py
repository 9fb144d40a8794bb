"""The garbage-collection clock: how long Python's cyclic garbage collector has run."""

from __future__ import annotations

import gc
import time


class GarbageCollectionClock:
    """Seconds Python's cyclic garbage collector has run, from ``gc.callbacks`` (a collection
    stops every thread: a long one is a step's spike)."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._started: float | None = None
        gc.callbacks.append(self._on_collection)

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.total_s += time.perf_counter() - self._started
            self._started = None

    def close(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)
