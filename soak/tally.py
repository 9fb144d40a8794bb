"""What a soak's clients saw, counted under one lock (soak/run.py)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Tally:
    started_s: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)
    counts: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)
    server_errors_at_s: list[float] = field(default_factory=list)
    ttfb_s: list[float] = field(default_factory=list)
    lost_examples: list[dict] = field(default_factory=list)
    errored_at: list[dict] = field(default_factory=list)
    crash_sent_at_s: float | None = None
    recovered_at_s: float | None = None

    def now(self) -> float:
        return time.monotonic() - self.started_s

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n

    def awaiting_recovery(self) -> bool:
        """A crash was sent and no request started after it has completed yet."""
        with self.lock:
            return self.crash_sent_at_s is not None and self.recovered_at_s is None

    def status(self, code: int, refusal: bool = False) -> None:
        with self.lock:
            self.statuses[str(code)] += 1
            if code >= 500 and not refusal:
                self.server_errors_at_s.append(self.now())

    def errored(self, path: str) -> None:
        """An accepted stream was cut short (the service's explicit error): when and on which
        route, to tell a crash's streams from others."""
        with self.lock:
            self.errored_at.append({"path": path, "at_s": round(self.now(), 1)})
