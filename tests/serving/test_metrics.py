"""The service's own metrics, read from Ray's Prometheus export port while the real app serves."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve_app.observability import metrics
from tests.serving.conftest import APP_NAME, Server

pytestmark = pytest.mark.slow

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "serving-dashboard.json"

STREAMS = 3
# Long enough that the engine is still busy for a few metric reports (about 1 s apart).
LONG_TEXT = " ".join(f"This is sentence number {n} of a text that keeps the engine busy."
                     for n in range(1, 9))
Samples = list[tuple[dict[str, str], float]]


def scrape(server: Server) -> dict[str, Samples]:
    """The session app's samples on the export port, by sample name (``_bucket``/``_count``
    names kept). Other test modules deploy apps of their own on this cluster, and Ray keeps
    exporting a deleted app's last values for a while: their series are left out."""
    text = httpx.get(server.metrics_url, timeout=10).text
    samples: dict[str, Samples] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("application", APP_NAME) == APP_NAME:
                samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


HTTP_POSTS = {"application": APP_NAME, "method": "POST", "status_code": "200"}


def total(samples: dict[str, Samples], name: str, **labels: str) -> float:
    """Sum over replicas of the samples of ``name`` whose labels include ``labels``."""
    return sum(value for sample_labels, value in samples.get(name, [])
               if labels.items() <= sample_labels.items())


def wait_for(server: Server, check: Callable[[dict[str, Samples]], bool],
             timeout_s: float = 30) -> dict[str, Samples]:
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(server)
        if check(samples):
            return samples
        assert time.monotonic() < deadline, ("metrics never showed the expected values", {
            name: values for name, values in samples.items() if name.startswith("ray_tts_")
            or name == "ray_serve_num_http_requests_total"})
        time.sleep(0.3)


def settled(server: Server, name: str, timeout_s: float = 60) -> dict[str, Samples]:
    """A snapshot once ``name`` has stopped moving for two report intervals, so that earlier
    tests' last reports are in it."""
    deadline = time.monotonic() + timeout_s
    previous = scrape(server)
    while True:
        time.sleep(2.5)
        current = scrape(server)
        if total(current, name) == total(previous, name):
            return current
        assert time.monotonic() < deadline, f"{name} never settled"
        previous = current


def speak(server: Server, text: str) -> tuple[int, float]:
    """Bytes of 24 kHz pcm received, and the request's wall seconds."""
    with httpx.Client(base_url=server.base_url, headers=server.auth, timeout=120) as client:
        started_s = time.perf_counter()
        response = client.post("/v1/speech/stream", json={"text": text, "format": "pcm"})
        assert response.status_code == 200
        return len(response.content), time.perf_counter() - started_s


def test_metrics_show_ttfb_active_streams_and_batch_occupancy(server: Server) -> None:
    before = settled(server, "ray_tts_ttfb_seconds_count")
    ttfb_count = total(before, "ray_tts_ttfb_seconds_count")
    ttfb_sum_s = total(before, "ray_tts_ttfb_seconds_sum")
    audio_s = total(before, "ray_tts_audio_seconds_total")

    with ThreadPoolExecutor(STREAMS) as pool:
        futures = [pool.submit(speak, server, LONG_TEXT) for _ in range(STREAMS)]
        # While they stream: streams hold engine slots and steps run several rows at once.
        # (Gauges are reported one by one, so wait for a snapshot where all of them moved.)
        busy = wait_for(server, lambda s: total(s, "ray_tts_engine_active_streams") >= 2
                        and total(s, "ray_tts_engine_batch_size") >= 2
                        and total(s, "ray_tts_engine_batch_occupancy") > 0)
        # The ingress reports on its own rhythm, not with the synthesizer: watch its gauge
        # over the whole time the streams are open, not in that one snapshot.
        http_streams_seen = [total(busy, "ray_tts_http_streams_active")]
        while not all(future.done() for future in futures):
            http_streams_seen.append(total(scrape(server), "ray_tts_http_streams_active"))
            time.sleep(0.3)
        sizes, walls_s = zip(*(future.result() for future in futures))
    assert all(size > 0 for size in sizes)
    assert total(busy, "ray_tts_engine_slots") == 8
    assert total(busy, "ray_tts_engine_batch_size") <= 8
    assert total(busy, "ray_tts_engine_batch_occupancy") == pytest.approx(
        total(busy, "ray_tts_engine_batch_size") / 8)
    assert max(http_streams_seen) >= 1
    assert total(busy, "ray_tts_queued_requests", stage="engine") >= 0

    # 24 kHz s16le: 48000 bytes a second.
    produced_s = sum(sizes) / 48000
    # Each replica reports its own metrics about once a second, in its own rhythm: the
    # ingress's "0 streams" may reach the port after the encoder's audio seconds. So wait for
    # the snapshot where every replica has reported the end, rather than read the first one.
    after = wait_for(server, lambda s: total(s, "ray_tts_ttfb_seconds_count")
                     >= ttfb_count + STREAMS and total(s, "ray_tts_engine_active_streams") == 0
                     and total(s, "ray_tts_audio_seconds_total") - audio_s > produced_s * 0.9
                     and total(s, "ray_tts_http_streams_active") == 0
                     and total(s, "ray_tts_engine_batch_occupancy") == 0
                     and total(s, "ray_serve_num_http_requests_total", **HTTP_POSTS) > 0)
    # TTFB: every stream observed (the count may also take in an earlier test's last report).
    count = total(after, "ray_tts_ttfb_seconds_count") - ttfb_count
    assert STREAMS <= count <= STREAMS + 2
    buckets = sorted((float(labels["le"]), value)
                     for labels, value in after["ray_tts_ttfb_seconds_bucket"]
                     if labels.get("format") == "pcm" and labels.get("mode") == "read")
    assert [value for _, value in buckets] == sorted(value for _, value in buckets)
    assert buckets[-1] == (float("inf"), total(after, "ray_tts_ttfb_seconds_count",
                                               format="pcm", mode="read"))
    mean_ttfb_s = (total(after, "ray_tts_ttfb_seconds_sum") - ttfb_sum_s) / count
    assert 0 < mean_ttfb_s < max(walls_s)
    # Idle again: no stream holds a slot, the batch gauge reads empty.
    assert total(after, "ray_tts_engine_batch_occupancy") == 0
    assert total(after, "ray_tts_http_streams_active") == 0
    # Audio produced and its real-time factor.
    assert total(after, "ray_tts_audio_seconds_total") - audio_s >= produced_s * 0.98
    assert total(after, "ray_tts_real_time_factor_count", format="pcm") >= STREAMS
    assert total(after, "ray_tts_stage_seconds_count", stage="step") > 0
    assert total(after, "ray_tts_stage_seconds_count", stage="encode") > 0
    assert total(after, "ray_tts_engine_steps_total") > 0
    assert total(after, "ray_tts_engine_step_seconds_total") > 0
    assert total(after, "ray_tts_engine_streams_total", outcome="completed") >= STREAMS
    # Ray Serve's own metrics share the port, @serve.batch admissions among them, and the HTTP
    # requests HAProxy passed (Ray's HAProxy manager counts them per application, route = the
    # app's prefix, from HAProxy's own log: Serve's Python proxy is off the path).
    assert total(after, "ray_serve_num_http_requests_total", **HTTP_POSTS) > 0, \
        after.get("ray_serve_num_http_requests_total")
    assert total(after, "ray_serve_actual_batch_size_count", deployment="Synthesizer") > 0


def test_errors_are_counted_by_code(server: Server, client: httpx.Client) -> None:
    def unknown_voice(samples: dict[str, Samples]) -> float:
        return total(samples, "ray_tts_errors_total", code="unknown_voice", status="400")

    before = unknown_voice(scrape(server))
    for _ in range(2):
        response = client.post("/v1/speech/stream", json={"text": "Hi.", "voice": "nobody"})
        assert response.status_code == 400
    wait_for(server, lambda s: unknown_voice(s) == before + 2)


def test_dashboard_charts_only_exported_metrics(server: Server) -> None:
    """Every series the Grafana dashboard queries is one this app really exports."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"]
             for target in panel.get("targets", [])]
    assert len(exprs) >= 20
    charted = {name for expr in exprs for name in re.findall(r"\bray_[a-z_]+", expr)}
    unused = [name for name in metrics.ALL_METRICS
              if not any(f"ray_{name}" in expr for expr in exprs)]
    assert not unused, f"exported but not charted: {unused}"
    exported = scrape(server)
    missing = sorted(name for name in charted if name not in exported)
    assert not missing, f"charted but not exported: {missing}"


def test_nothing_to_speak_is_an_error_counted_by_code(server: Server,
                                                      client: httpx.Client) -> None:
    """A text with nothing to say (an unassigned code point) is refused, not an empty 200."""
    def refused(samples: dict[str, Samples]) -> float:
        return total(samples, "ray_tts_errors_total", code="nothing_to_speak", status="400")

    before = refused(scrape(server))
    response = client.post("/v1/speech/stream", json={"text": "\U000c4a7e", "format": "wav"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "nothing_to_speak"
    wait_for(server, lambda s: refused(s) == before + 1)
