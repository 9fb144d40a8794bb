"""What the autoscaling benchmark reads while its load runs: Serve's replica states every second,
the engines' gauges from one metrics scrape (summed and per replica), each GPU's memory and
utilization, and each replica's step time from its counters."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx

from bench.autoscale.gpu_meter import gpu_readings
from harness.service import replica_states
GPU_EVERY_S = 5.0  # NVML readings of every GPU, this often


class StatePoller:
    """Serve's view of the Synthesizer's replicas every second, and the engines' gauges."""

    def __init__(self, metrics_url: str | None) -> None:
        self.samples: list[dict[str, Any]] = []
        self.metrics_url = metrics_url
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.t0 = time.time()
        self._next_gpu_t_s = 0.0

    def start(self) -> StatePoller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            sample: dict[str, Any] = {"t_s": round(time.time() - self.t0, 1)}
            try:
                sample["states"] = replica_states()
            except Exception as exc:  # a slow controller must not end the record
                sample["error"] = type(exc).__name__
            sample.update(self._gauges())
            if sample["t_s"] >= self._next_gpu_t_s:
                sample["gpus"] = gpu_readings()
                self._next_gpu_t_s = sample["t_s"] + GPU_EVERY_S
            self.samples.append(sample)
            self._stop.wait(1.0)

    def _gauges(self) -> dict[str, Any]:
        if not self.metrics_url:
            return {}
        try:
            text = httpx.get(self.metrics_url, timeout=2).text
        except httpx.HTTPError:
            return {}
        return engine_gauges(text)


def engine_gauges(text: str) -> dict[str, Any]:
    """The engines' queue, streams in slots, slots and step counters from one metrics scrape:
    summed over the Synthesizer replicas, and per replica (Serve's ``replica`` label) with
    their cumulative steps and busy seconds (:func:`step_ms_by_replica` reads the step time)."""
    from prometheus_client.parser import text_string_to_metric_families

    from serve_app.observability.metrics import (
        ENGINE_ACTIVE_STREAMS,
        ENGINE_SLOTS,
        ENGINE_STEP_SECONDS_TOTAL,
        ENGINE_STEPS_TOTAL,
        QUEUED_REQUESTS,
    )

    # Ray exports the app's metrics with its "ray_" prefix.
    fields = {f"ray_{QUEUED_REQUESTS}": "queued", f"ray_{ENGINE_ACTIVE_STREAMS}": "active_streams",
              f"ray_{ENGINE_SLOTS}": "slots", f"ray_{ENGINE_STEPS_TOTAL}": "steps",
              f"ray_{ENGINE_STEP_SECONDS_TOTAL}": "step_seconds"}
    per_replica: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            field = fields.get(sample.name)
            if field is not None:
                replica = per_replica.setdefault(sample.labels.get("replica", ""),
                                                 dict.fromkeys(fields.values(), 0.0))
                replica[field] += sample.value
    for values in per_replica.values():
        values["slot_occupancy"] = round(values["active_streams"] / values["slots"], 3) \
            if values["slots"] else 0.0
    sums = {name: sum(r[name] for r in per_replica.values())
            for name in ("queued", "active_streams", "slots")}
    sums["slot_occupancy"] = round(sums["active_streams"] / sums["slots"], 3) \
        if sums["slots"] else 0.0
    return {**sums, "per_replica": per_replica}


def step_ms_by_replica(samples: list[dict[str, Any]], before_t_s: float) -> dict[str, float]:
    """Each replica's mean engine step (ms) over the last interval between two of its counter
    exports seen before ``before_t_s`` (Ray exports about every 10 s): busy seconds over steps
    run, what the policy's step budget reads (MiniCPM-o's budget: 5 frames, 106.7 ms)."""
    points: dict[str, list[tuple[float, float]]] = {}
    for sample in samples:
        if sample["t_s"] >= before_t_s:
            break
        for replica, values in (sample.get("per_replica") or {}).items():
            seen = points.setdefault(replica, [])
            point = (values.get("steps", 0.0), values.get("step_seconds", 0.0))
            if not seen or seen[-1] != point:
                seen.append(point)
    step_ms = {}
    for replica, seen in points.items():
        if len(seen) >= 2 and seen[-1][0] > seen[-2][0]:
            (steps_a, busy_a), (steps_b, busy_b) = seen[-2], seen[-1]
            step_ms[replica] = round(1000 * (busy_b - busy_a) / (steps_b - steps_a), 1)
    return step_ms


def metrics_url() -> str | None:
    import ray

    for node in ray.nodes():
        if node.get("Alive") and node.get("MetricsExportPort"):
            return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    return None
