"""The soak's memory record: each replica's resident memory through the run, and its trend.

Every sample reads each replica process of the app (``replicas()`` in ``harness/service.py``:
psutil, by the process title Serve gives a replica) and, for a Synthesizer, its engine process
too (the replica's child processes: Piper runs in a process of its own). A replica is one
process id: a Synthesizer restarted after the crash is a new series.

The trend is the least-squares slope of RSS (MB) over minutes, per series, from the samples
after the warm-up (``warmup_s`` into the run). Flat means under 0.2 MB a minute: issue 58 saw
an Ingress replica grow 2 MB a minute in a 6-minute GPU soak.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from harness.service import replicas

MIN_SLOPE_SAMPLES = 3
SLOPE_LIMIT_MB_PER_MIN = 0.2


def slope_per_min(samples: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of ``(t_s, mb)`` samples in MB a minute (None for < 3 samples or
    a single instant)."""
    if len(samples) < MIN_SLOPE_SAMPLES:
        return None
    minutes = [t / 60.0 for t, _ in samples]
    values = [mb for _, mb in samples]
    mean_t = sum(minutes) / len(minutes)
    mean_v = sum(values) / len(values)
    spread = sum((t - mean_t) ** 2 for t in minutes)
    if spread == 0:
        return None
    return sum((t - mean_t) * (v - mean_v) for t, v in zip(minutes, values)) / spread


def engine_children_mb(pid: int) -> float:
    """Resident memory (MiB) of the processes ``pid`` started (0 when none or gone)."""
    import psutil

    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return 0.0
    total = 0
    for child in children:
        try:
            total += child.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


class MemorySampler:
    """Samples the app's replicas every ``every_s`` seconds on a thread of its own."""

    def __init__(self, app: str, clock: Callable[[], float], every_s: float = 20.0,
                 warmup_s: float = 300.0) -> None:
        self.app, self.clock, self.every_s, self.warmup_s = app, clock, every_s, warmup_s
        self.timeline: list[dict[str, Any]] = []  # per sample: deployment -> [MB, ...]
        self.series: dict[int, dict[str, Any]] = {}  # pid -> {deployment, samples}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def by_deployment(self, record: bool = True) -> dict[str, list[float]]:
        """One sample now: each replica's RSS by deployment (and the Synthesizers' engines),
        also added to each replica's series when ``record``."""
        now = round(self.clock(), 1)
        memory: dict[str, list[float]] = {}
        for name, pid, rss_mb in sorted(replicas(self.app)):
            memory.setdefault(name, []).append(round(rss_mb, 1))
            if record:
                self._add(pid, name, now, rss_mb)
            if name == "Synthesizer":
                engine_mb = engine_children_mb(pid)
                if engine_mb:
                    memory.setdefault("SynthesizerEngine", []).append(round(engine_mb, 1))
                    if record:
                        self._add(-pid, "SynthesizerEngine", now, engine_mb)
        return memory

    def _add(self, key: int, deployment: str, t_s: float, mb: float) -> None:
        series = self.series.setdefault(key, {"deployment": deployment, "pid": abs(key),
                                              "samples": []})
        series["samples"].append((t_s, round(mb, 1)))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.timeline.append({"t_s": round(self.clock()), **self.by_deployment()})
            self._stop.wait(self.every_s)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def report(self) -> dict[str, Any]:
        """Each replica's series and slope after the warm-up, and the largest Ingress slope."""
        replicas_out = []
        for series in self.series.values():
            after = [(t, mb) for t, mb in series["samples"] if t >= self.warmup_s]
            slope = slope_per_min(after)
            replicas_out.append({
                "deployment": series["deployment"], "pid": series["pid"],
                "slope_mb_per_min_after_warmup": None if slope is None else round(slope, 3),
                "samples_after_warmup": len(after),
                "first_mb": series["samples"][0][1], "last_mb": series["samples"][-1][1],
                "samples_t_s_mb": [list(sample) for sample in series["samples"]]})
        replicas_out.sort(key=lambda r: (r["deployment"], r["samples_t_s_mb"][0][0]))
        ingress = [r["slope_mb_per_min_after_warmup"] for r in replicas_out
                   if r["deployment"] == "Ingress"
                   and r["slope_mb_per_min_after_warmup"] is not None]
        return {
            "ingress_rss_slope_mb_per_min": max(ingress) if ingress else None,
            "slope_limit_mb_per_min": SLOPE_LIMIT_MB_PER_MIN,
            "warmup_s": self.warmup_s, "every_s": self.every_s,
            "replicas": replicas_out,
        }
