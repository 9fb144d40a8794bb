"""The way between the Ingress and the Synthesizer replica (bench/served/crossings.py), read
from the lines the replicas write: the Ingress's request line (its call's clock reading), the
Synthesizer's first-chunk line or its answer line (a refusal), and the collector's pauses that
each replica process logs (serve_app/observability/gc_pauses.py)."""

from __future__ import annotations

import gc
import logging
import time

import numpy as np

from bench.served.crossings import crossing_legs, gc_pause_list, gc_pauses
from serve_app import errors
from serve_app.engines.base import AudioChunk
from serve_app.front.guard import RequestRecord
from serve_app.gpu.synthesizer import _answered, _log_first_chunk
from serve_app.observability import gc_pauses as pauses_module
from serve_app.observability.gc_pauses import GcPauses, settle_replica_process


def _ingress_line(caplog, request_id: str, dispatched_s: float, first_item_s: float,
                  status: int) -> str:
    """The Ingress's line for a request it called the synthesizer for at ``dispatched_s`` and
    got the first item (or the refusal) of at ``first_item_s`` (perf_counter readings)."""
    record = RequestRecord({"method": "POST", "path": "/v1/speech/stream"},
                           {"x-request-id": request_id})
    record.started_s = dispatched_s - 0.001
    record.state["speech"] = {"mode": "read", "format": "pcm", "dispatched_s": dispatched_s,
                              "first_item_s": first_item_s}
    record.status, record.completed = status, True
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="serve_app.requests"):
        record.log()
    return caplog.text


def test_an_admitted_streams_crossing_splits_into_the_way_there_and_back(caplog):
    dispatched_s = time.perf_counter() - 0.200
    arrived_s = dispatched_s + 0.030  # 30 ms on the way there
    replica_ttfb_s = 0.100
    chunk = AudioChunk("req-1", np.zeros(480, np.float32), 24000, timings_s={"ttfb_s": 0.08})
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="serve_app.gpu.synthesizer"):
        _log_first_chunk("req-1", arrived_s, replica_ttfb_s, chunk)
    synthesizer_line = caplog.text
    ingress_line = _ingress_line(caplog, "req-1", dispatched_s, arrived_s + 0.105, 200)

    legs = crossing_legs(synthesizer_line + ingress_line, {"req-1"})

    assert legs["requests"] == 1
    assert abs(legs["to_replica_ms"]["p50"] - 30.0) <= 0.2
    assert legs["replica_ms"]["p50"] == 100.0
    assert abs(legs["back_ms"]["p50"] - 5.0) <= 0.2  # the first item took 105 ms after arrival
    assert legs["slow_crossings"] == 0  # 35 ms across, under the 100 ms looked at


def test_a_refusals_crossing_is_split_by_the_synthesizers_answer_line(caplog):
    arrived_s = time.perf_counter() - 0.001
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="serve_app.gpu.synthesizer"):
        answer = _answered("req-2", arrived_s, errors.overloaded("work"))
    synthesizer_line = caplog.text
    assert answer.status_code == 503 and "status=503 code=overloaded" in synthesizer_line
    replica_ms = float(synthesizer_line.split("replica_ms=")[1].split()[0])
    dispatched_s = arrived_s - 0.150  # 150 ms to reach the replica
    first_item_s = arrived_s + replica_ms / 1000 + 0.002
    ingress_line = _ingress_line(caplog, "req-2", dispatched_s, first_item_s, 503)

    legs = crossing_legs(synthesizer_line + ingress_line, {"req-2", "req-other"})

    assert legs["requests"] == 1
    assert abs(legs["to_replica_ms"]["p50"] - 150.0) <= 0.2
    assert abs(legs["back_ms"]["p50"] - 2.0) <= 0.2
    assert legs["slow_crossings"] == 1
    assert legs["slow_crossings_in_gc_pause"] == {}  # no collection was logged
    # a long collection of the Synthesizer's process in that window is counted against it
    pause = (f"(ServeReplica:tts:Synthesizer pid=7) gc pause at_clock={dispatched_s + 0.05:.6f} "
             "ms=60.0 generation=2\n")
    legs = crossing_legs(pause + synthesizer_line + ingress_line, {"req-2"})
    assert legs["slow_crossings_in_gc_pause"] == {"Synthesizer": 1}


def test_a_process_logs_its_collections_and_the_benchmark_sums_them_by_deployment(caplog):
    recorder = GcPauses(min_ms=0.0)
    try:
        garbage = []
        for _ in range(20000):
            node: list = []
            node.append(node)  # a cycle: only the collector frees it
            garbage.append(node)
        del garbage, node
        gc.collect()
        with caplog.at_level(logging.INFO, logger="serve_app.observability.gc_pauses"):
            recorder.log()
    finally:
        recorder.close()
    lines = [line for line in caplog.text.splitlines() if "gc pause" in line]
    assert lines and not recorder.pending
    text = "\n".join(f"(ServeReplica:tts:Ingress pid=42) {line}" for line in lines)
    summary = gc_pauses(text)
    assert summary["Ingress"]["count"] == len(lines)
    assert summary["Ingress"]["processes"] == 1
    assert summary["Ingress"]["max_ms"] == max(ms for _, _, ms in gc_pause_list(text))
    assert any(generation == 2 for generation in
               (int(line.rsplit("generation=", 1)[1]) for line in lines))


def test_a_settled_replica_freezes_what_it_built_and_records_pauses(monkeypatch):
    monkeypatch.setattr(pauses_module, "_pauses", None)
    try:
        settle_replica_process()
        assert gc.get_freeze_count() > 0
        assert pauses_module._pauses is not None
    finally:
        if pauses_module._pauses is not None:
            pauses_module._pauses.close()
        gc.unfreeze()
    # the A/B switch leaves the heap where the collector sees it
    monkeypatch.setenv(pauses_module.FREEZE_ENV, "0")
    monkeypatch.setattr(pauses_module, "_pauses", None)
    try:
        settle_replica_process()
        assert gc.get_freeze_count() == 0
    finally:
        if pauses_module._pauses is not None:
            pauses_module._pauses.close()
