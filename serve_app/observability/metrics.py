"""The service's own Prometheus metrics, recorded through Ray Serve's metrics API.

Ray exports them (prefixed ``ray_``) with its own on each node's metrics export port, tagged with
the deployment, replica and application; ``scripts/serve`` fixes that port (see the README), and
``docs/grafana/serving-dashboard.json`` charts them. Each deployment records what it alone can
see:

- Ingress: time to first byte, HTTP streams in flight, errors by code.
- Ingress (its encoding): real-time factor, audio seconds produced, per-stage seconds (the engine's
  ``AudioChunk.timings_s`` plus the encoder's own).
- Synthesizer: engine streams, queued requests, batch occupancy, steps. (Serve itself exports
  the ``@serve.batch`` admission: ``ray_serve_actual_batch_size``, ``ray_serve_batch_*``.)

Objects here are created inside a replica (in ``__init__``), where Serve adds its tags.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from ray.serve.metrics import Counter, Gauge, Histogram

from serve_app.engines.base import EngineStats
from serve_app.engines.work_admission import REFUSAL_REASONS

logger = logging.getLogger(__name__)
Method = TypeVar("Method", bound=Callable[..., None])

# Metric names as recorded; Prometheus sees each with Ray's "ray_" prefix.
TTFB_SECONDS = "tts_ttfb_seconds"
HTTP_STREAMS_ACTIVE = "tts_http_streams_active"
ERRORS_TOTAL = "tts_errors_total"
REAL_TIME_FACTOR = "tts_real_time_factor"
AUDIO_SECONDS_TOTAL = "tts_audio_seconds_total"
STAGE_SECONDS = "tts_stage_seconds"
ENGINE_ACTIVE_STREAMS = "tts_engine_active_streams"
QUEUED_REQUESTS = "tts_queued_requests"
ENGINE_SLOTS = "tts_engine_slots"
ENGINE_BATCH_SIZE = "tts_engine_batch_size"
ENGINE_BATCH_OCCUPANCY = "tts_engine_batch_occupancy"
ENGINE_STEPS_TOTAL = "tts_engine_steps_total"
ENGINE_STEP_SECONDS_TOTAL = "tts_engine_step_seconds_total"
ENGINE_STREAMS_TOTAL = "tts_engine_streams_total"
ENGINE_DEVICE_MEMORY_PEAK = "tts_engine_device_memory_peak_bytes"
ENGINE_WORK_LOAD = "tts_engine_work_load"
ENGINE_ADMISSIONS_TOTAL = "tts_engine_admissions_total"
ENGINE_RAN_DRY_TOTAL = "tts_engine_chunks_ran_dry_total"

ALL_METRICS: tuple[str, ...] = (
    TTFB_SECONDS, HTTP_STREAMS_ACTIVE, ERRORS_TOTAL, REAL_TIME_FACTOR, AUDIO_SECONDS_TOTAL,
    STAGE_SECONDS, ENGINE_ACTIVE_STREAMS, QUEUED_REQUESTS, ENGINE_SLOTS, ENGINE_BATCH_SIZE,
    ENGINE_DEVICE_MEMORY_PEAK,
    ENGINE_BATCH_OCCUPANCY, ENGINE_STEPS_TOTAL, ENGINE_STREAMS_TOTAL)

TTFB_BUCKETS_S = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
                  5.0, 10.0]
RTF_BUCKETS = [0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0]
STAGE_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


def _never_raises(method: Method) -> Method:
    """Recording a metric must never break a stream: log the failure and carry on."""
    @functools.wraps(method)
    def record(*args: Any, **kwargs: Any) -> None:
        try:
            method(*args, **kwargs)
        except Exception:
            logger.exception("recording metrics failed in %s", method.__qualname__)

    return record  # type: ignore[return-value]


class IngressMetrics:
    """What the HTTP front door sees: TTFB, streams in flight, every error it answers."""

    def __init__(self) -> None:
        self._ttfb_s = Histogram(
            TTFB_SECONDS, description="Seconds from a speech request's arrival at the ingress "
            "to its first audio bytes", boundaries=TTFB_BUCKETS_S, tag_keys=("mode", "format"))
        self._streams = Gauge(HTTP_STREAMS_ACTIVE,
                              description="Audio responses streaming from this ingress replica")
        self._errors = Counter(ERRORS_TOTAL, description="Error replies (and streams cut "
                               "mid-way) by code and HTTP status", tag_keys=("code", "status"))
        self._active = 0
        self._streams.set(0)

    @_never_raises
    def stream_started(self) -> None:
        self._active += 1
        self._streams.set(self._active)

    @_never_raises
    def stream_ended(self) -> None:
        self._active -= 1
        self._streams.set(self._active)

    @_never_raises
    def observe_ttfb(self, ttfb_s: float, mode: str, audio_format: str) -> None:
        self._ttfb_s.observe(ttfb_s, tags={"mode": mode, "format": audio_format})

    @_never_raises
    def error(self, code: str | None, status: int | str) -> None:
        self._errors.inc(tags={"code": code or "unknown", "status": str(status)})


class EncoderMetrics:
    """Per stream: real-time factor, audio produced, and where the time went."""

    def __init__(self) -> None:
        self._rtf = Histogram(
            REAL_TIME_FACTOR, description="Stream wall seconds (first call to last byte) per "
            "second of audio; below 1 is faster than real time", boundaries=RTF_BUCKETS,
            tag_keys=("format",))
        self._audio_s = Counter(AUDIO_SECONDS_TOTAL, description="Seconds of audio produced",
                                tag_keys=("format",))
        self._stage_s = Histogram(
            STAGE_SECONDS, description="Per-stage seconds: engine timings carried by each chunk "
            "(names ending in _s) and the encoder's own resample+encode",
            boundaries=STAGE_BUCKETS_S, tag_keys=("stage",))

    @_never_raises
    def chunk(self, timings_s: dict[str, float], encode_s: float) -> None:
        for name, value in timings_s.items():
            # Engines also carry counts (e.g. tts_steps); only seconds belong here.
            if name.endswith("_s") and value >= 0:
                self._stage_s.observe(float(value), tags={"stage": name[:-2]})
        self._stage_s.observe(encode_s, tags={"stage": "encode"})

    @_never_raises
    def stream_finished(self, audio_format: str, audio_s: float, wall_s: float) -> None:
        if audio_s <= 0:  # nothing to say (e.g. only punctuation): no audio, no rate
            return
        tags = {"format": audio_format}
        self._audio_s.inc(audio_s, tags=tags)
        self._rtf.observe(wall_s / audio_s, tags=tags)


class SynthesizerMetrics:
    """Engine occupancy and queues, refreshed from ``EngineStats`` while streams run."""

    def __init__(self) -> None:
        self._active = Gauge(ENGINE_ACTIVE_STREAMS,
                             description="Streams holding an engine batch slot")
        self._queued = Gauge(QUEUED_REQUESTS, description="Requests waiting: for @serve.batch "
                             "admission (stage=admission) or for an engine slot (stage=engine)",
                             tag_keys=("stage",))
        self._slots = Gauge(ENGINE_SLOTS, description="Batch slots of the engine (max_slots)")
        self._batch = Gauge(ENGINE_BATCH_SIZE,
                            description="Rows in the engine's latest step (0 when idle)")
        self._occupancy = Gauge(ENGINE_BATCH_OCCUPANCY, description="Rows in the engine's "
                                "latest step over its slots, 0..1 (0 when idle)")
        self._steps = Counter(ENGINE_STEPS_TOTAL, description="Engine batch steps run")
        self._step_s = Counter(ENGINE_STEP_SECONDS_TOTAL, description="Wall-clock seconds the "
                               "engine spent running steps (its busy time; over steps: the "
                               "time per step)")
        self._streams = Counter(ENGINE_STREAMS_TOTAL, description="Engine streams ended, by "
                                "outcome", tag_keys=("outcome",))
        self._memory_peak = Gauge(ENGINE_DEVICE_MEMORY_PEAK, description="Most GPU memory the "
                                  "engine's allocator has held since it started (0 on CPU)")
        self._work = Gauge(ENGINE_WORK_LOAD, description="The engine's real-time budget: the "
                           "load its admitted and queued streams commit (value=committed), "
                           "the limit admission keeps it under (value=limit), 1 = just real "
                           "time; 0 where it admits by slots", tag_keys=("value",))
        self._admissions = Counter(ENGINE_ADMISSIONS_TOTAL, description="Streams the engine "
                                   "admitted (outcome=admitted) or refused with a 503, by "
                                   "reason: work (real-time budget full), wait (could not "
                                   "start in time), queue (queue full), behind (a listener "
                                   "ran dry lately: the engine catches up first), slots (no "
                                   "slot free)",
                                   tag_keys=("outcome", "reason"))
        self._ran_dry = Counter(ENGINE_RAN_DRY_TOTAL, description="Audio chunks the engine "
                                "sent after their listener had played all it had (a stream "
                                "running late at the engine; 0 while it keeps real time)")
        self._last = EngineStats()

    @_never_raises
    def refresh(self, stats: EngineStats, waiting_for_admission: int) -> None:
        busy = stats.active_streams > 0
        batch = stats.last_batch_size if busy else 0
        self._active.set(stats.active_streams)
        self._queued.set(waiting_for_admission, tags={"stage": "admission"})
        self._queued.set(stats.queued_streams, tags={"stage": "engine"})
        self._slots.set(stats.max_slots)
        self._batch.set(batch)
        self._occupancy.set(batch / stats.max_slots if stats.max_slots else 0.0)
        self._memory_peak.set(stats.device_memory_peak_bytes)
        last = self._last
        if stats.steps > last.steps:
            self._steps.inc(stats.steps - last.steps)
        if stats.step_seconds > last.step_seconds:
            self._step_s.inc(stats.step_seconds - last.step_seconds)
        for outcome in ("completed", "aborted", "failed"):
            grown = getattr(stats, outcome) - getattr(last, outcome)
            if grown > 0:
                self._streams.inc(grown, tags={"outcome": outcome})
        self._work.set(stats.work_load, tags={"value": "committed"})
        self._work.set(stats.work_limit, tags={"value": "limit"})
        if stats.admitted_streams > last.admitted_streams:
            self._admissions.inc(stats.admitted_streams - last.admitted_streams,
                                 tags={"outcome": "admitted", "reason": "fits"})
        if stats.ran_dry_chunks > last.ran_dry_chunks:
            self._ran_dry.inc(stats.ran_dry_chunks - last.ran_dry_chunks)
        for reason in REFUSAL_REASONS:
            grown = getattr(stats, f"refused_{reason}") - getattr(last, f"refused_{reason}")
            if grown > 0:
                self._admissions.inc(grown, tags={"outcome": "refused", "reason": reason})
        self._last = stats
