"""What a synthesizer replica watches of its engine: the engine gauges while it is busy (and its
busy periods in the log), the signals its autoscaling policy reads, and the engine process's
death, after which the replica ends itself."""

from __future__ import annotations

import asyncio
import logging
import os
import threading

from serve_app.engines.base import EngineStats
from serve_app.gpu.autoscaling import engine_signals
from serve_app.gpu.engine_client import EngineClient
from serve_app.observability.metrics import SynthesizerMetrics

logger = logging.getLogger(__name__)

# How often the engine gauges are refreshed while the engine is busy.
METRICS_REFRESH_S = 0.5
# After its engine process died: time for the failed streams' errors to reach their callers
# before this replica exits (Serve then stops routing here and starts a new one).
EXIT_AFTER_ENGINE_DEATH_S = 1.0
ENGINE_DIED_EXIT_CODE = 70


class EngineWatch:
    """The engine's gauges and autoscaling signals; ``waiting_for_admission`` holds the ids of
    the requests that wait for their batch (the synthesizer adds and removes them)."""

    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine
        self._metrics = SynthesizerMetrics()
        self.waiting_for_admission: set[str] = set()
        self._stats_at_last_report: EngineStats | None = None  # autoscaling_stats
        self._task: asyncio.Task | None = None
        self.refresh()

    def watch(self) -> None:
        """A request arrived: refresh the gauges until the engine idles again."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._watch_busy_period())

    async def _watch_busy_period(self) -> None:
        """Refresh the engine gauges while the engine is busy, and once more when it idles;
        then log the busy period's steps and time per step (scripts/bench_serve reads it)."""
        before = self._engine.stats()
        phases_before = await self._step_phase_seconds()
        while self.refresh():
            await asyncio.sleep(METRICS_REFRESH_S)
        after = self._engine.stats()
        steps = after.steps - before.steps
        if steps > 0:
            busy_s = after.step_seconds - before.step_seconds
            cpu_s = after.step_cpu_seconds - before.step_cpu_seconds
            phases = {name: (seconds - phases_before.get(name, 0.0)) * 1000 / steps
                      for name, seconds in (await self._step_phase_seconds()).items()}
            logger.info("engine busy period: steps=%d busy_s=%.3f ms_per_step=%.2f "
                        "cpu_ms_per_step=%.2f streams_ended=%d llm_steps=%d "
                        "device_memory_peak_gb=%.2f phase_ms_per_step=%s", steps, busy_s,
                        busy_s * 1000 / steps, cpu_s * 1000 / steps,
                        (after.completed + after.aborted + after.failed)
                        - (before.completed + before.aborted + before.failed),
                        after.llm_steps - before.llm_steps, after.device_memory_peak_bytes / 1e9,
                        ",".join(f"{name}:{ms:.3f}" for name, ms in phases.items()) or "-")

    async def _step_phase_seconds(self) -> dict[str, float]:
        """The engine's host seconds by step phase so far; empty from an engine without
        phases (or one that cannot answer now)."""
        try:
            return await self._engine.call("step_phase_seconds")
        except Exception:  # an engine without phases; its death is handled elsewhere
            return {}

    def refresh(self) -> bool:
        """Record the engine's state; True while requests wait or streams run."""
        try:
            stats = self._engine.stats()
            self._metrics.refresh(stats, len(self.waiting_for_admission))
        except Exception:  # metrics must never break serving
            logger.exception("metrics refresh failed")
            return False
        return bool(self.waiting_for_admission or stats.active_streams or stats.queued_streams)

    def autoscaling_stats(self) -> dict[str, float]:
        """What the Synthesizer's autoscaling policy reads (serve_app/gpu/autoscaling.py):
        streams waiting, slot occupancy, step time over its real-time budget since the last
        report."""
        stats = self._engine.stats()
        signals = engine_signals(stats, self._stats_at_last_report,
                                 len(self.waiting_for_admission))
        self._stats_at_last_report = stats
        return signals


def exit_soon() -> None:
    """The engine process is gone: end this replica once the streams' errors are out."""
    logger.critical("the engine process exited; this replica exits in %.0f s",
                    EXIT_AFTER_ENGINE_DEATH_S)

    def leave() -> None:
        for handler in logging.getLogger("serve_app").handlers:
            handler.flush()
        os._exit(ENGINE_DIED_EXIT_CODE)

    timer = threading.Timer(EXIT_AFTER_ENGINE_DEATH_S, leave)
    timer.daemon = True
    timer.start()


def rss_bytes(pid: int) -> int:
    """Resident memory of the process ``pid`` (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # the process is gone
        return 0
