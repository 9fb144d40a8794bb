"""Where a replica's memory grows: its Python allocations by the line that made them, on request.

With ``TTS_TRACE_MEMORY_S`` set to a period in seconds, a replica (the Ingress, the
Synthesizer) starts :mod:`tracemalloc` and logs, that often, the allocation sites whose live
memory grew most since its first report, and their total (the first report comes one period
after the replica starts, so a warm-up's allocations are its baseline). An operator who sees a
replica's RSS climb under churn reads which line holds the memory. Tracing slows the replica
(every allocation is recorded): a diagnosis, off unless asked for. Memory outside Python's
allocator (a C library's own, the allocator's fragmentation) does not show here; RSS growing
while these totals stay flat says it is there.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import tracemalloc

logger = logging.getLogger(__name__)

ENV = "TTS_TRACE_MEMORY_S"
FRAMES = 12  # of each allocation's traceback: enough to see which of our lines made it
TOP = 12  # sites per report


def period_asked() -> float | None:
    """The report period ``TTS_TRACE_MEMORY_S`` asks for (seconds), None when unset."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    period = float(value)
    if period <= 0:
        raise ValueError(f"{ENV} must be a number of seconds > 0, not {value!r}")
    return period


def start_if_asked(replica: str) -> threading.Thread | None:
    """Start tracing and the reports (a daemon thread) when ``TTS_TRACE_MEMORY_S`` asks for
    them; the reporting thread, or None."""
    period = period_asked()
    if period is None:
        return None
    if not tracemalloc.is_tracing():
        tracemalloc.start(FRAMES)
    logger.info("memory trace: %s reports Python allocation growth every %.0f s", replica, period)
    thread = threading.Thread(target=_report_forever, args=(replica, period),
                              name="memory-trace", daemon=True)
    thread.start()
    return thread


def _report_forever(replica: str, period: float) -> None:
    baseline: tracemalloc.Snapshot | None = None
    while True:
        time.sleep(period)
        snapshot = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__)])
        if baseline is None:
            baseline = snapshot
            continue
        logger.info("%s", growth_report(replica, baseline, snapshot))


def growth_report(replica: str, baseline: tracemalloc.Snapshot,
                  snapshot: tracemalloc.Snapshot) -> str:
    """The sites that grew most from ``baseline`` to ``snapshot``, each with its most recent
    frame in this project (the line of ours that asked for the memory) and where the memory was
    allocated (the most recent frame of all)."""
    stats = snapshot.compare_to(baseline, "traceback")
    grown = sorted((s for s in stats if s.size_diff > 0), key=lambda s: -s.size_diff)[:TOP]
    total = sum(s.size_diff for s in stats)
    lines = [f"memory trace: {replica} Python allocations {total / 1e6:+.2f} MB since the "
             f"baseline; most grown:"]
    for stat in grown:
        frames = list(stat.traceback)
        ours = next((f for f in reversed(frames) if "serve_app" in f.filename), frames[-1])
        lines.append(f"  {stat.size_diff / 1e3:+.1f} kB in {stat.count_diff:+d} blocks at "
                     f"{ours.filename}:{ours.lineno} (allocated at {frames[-1].filename}:"
                     f"{frames[-1].lineno})")
    return "\n".join(lines)
