"""bench_serve's TTFB breakdown (bench/served/served_logs.py) reads the lines the service writes:
the Synthesizer's first-chunk line (with the clock readings of the chunk's way back from the
engine process) and the ingress's request line, and splits the replica's leg around the
engine's own TTFB."""

from __future__ import annotations

import logging
import time

import numpy as np

from bench.served.served_logs import REPLICA_LEG, engine_busy, ttfb_breakdown
from serve_app.engines.base import AudioChunk
from serve_app.front.guard import RequestRecord
from serve_app.gpu.engine_client import stamp_way_back
from serve_app.gpu.synthesizer import ADMITTED_CLOCK, _log_first_chunk


def _first_chunk_line(caplog, request_id: str, engine_ttfb_s: float, sent_after_s: float,
                      sending_after_s: float, read_after_s: float) -> tuple[str, float]:
    """The Synthesizer's log line for a first chunk stamped as the engine client stamps it, the
    request having reached the replica ``0.1`` s ago; and the replica TTFB it logged."""
    arrived_s = time.perf_counter() - 0.1
    chunk = AudioChunk(request_id, np.zeros(480, np.float32), 24000,
                       timings_s={"ttfb_s": engine_ttfb_s})
    stamp_way_back(chunk, arrived_s + sent_after_s, arrived_s + sending_after_s,
                   arrived_s + read_after_s)
    # the engine's answer to the submission came 2 ms after the engine took the stream
    chunk.timings_s[ADMITTED_CLOCK] = arrived_s + sent_after_s - engine_ttfb_s + 0.002
    replica_ttfb_s = time.perf_counter() - arrived_s
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="serve_app.gpu.synthesizer"):
        _log_first_chunk(request_id, arrived_s, replica_ttfb_s, chunk)
    return caplog.text, replica_ttfb_s


def test_the_replica_leg_is_split_at_each_clock_reading(caplog):
    synthesizer_line, replica_ttfb_s = _first_chunk_line(
        caplog, "req-1", engine_ttfb_s=0.040, sent_after_s=0.050, sending_after_s=0.053,
        read_after_s=0.060)
    ingress_line = "request id=req-1 method=POST status=200 outcome=ok ttfb_ms=110.0\n"
    rows = [{"ok": True, "ttfb_s": 0.115, "request_id": "req-1"}]

    result = ttfb_breakdown(synthesizer_line + ingress_line, rows)

    assert result["requests"] == 1
    assert result["engine_ms"]["p50"] == 40.0
    assert result["hops_ms"]["p50"] == 75.0  # the client's 115 ms minus the engine's 40
    leg = result["replica_leg"]
    assert set(leg) == set(REPLICA_LEG)
    assert leg["to_engine_ms"]["p50"] == 10.0  # sent at 50 ms, 40 ms after the submission
    assert leg["to_admission_ms"]["p50"] == 12.0  # and its answer back 2 ms after that
    assert leg["engine_to_reader_ms"]["p50"] == 10.0
    # ... of which 3 ms before the engine's sender began writing it, 7 ms on the socket
    assert leg["engine_to_sender_ms"]["p50"] == 3.0
    assert leg["sender_to_reader_ms"]["p50"] == 7.0
    # dispatched "now": at least 100 ms after the arrival, so at least 40 ms after the read
    assert leg["reader_to_loop_ms"]["p50"] >= 39.9
    assert leg["loop_to_out_ms"]["p50"] >= 0.0
    parts = ("to_engine_ms", "engine_to_reader_ms", "reader_to_loop_ms", "loop_to_out_ms")
    total = sum(leg[part]["p50"] for part in parts) + result["engine_ms"]["p50"]
    assert abs(total - replica_ttfb_s * 1000) <= 0.5  # the parts add up to the replica's TTFB


def _ingress_line(caplog, request_id: str, dispatched_after_s: float, first_item_after_s: float,
                  ttfb_s: float) -> str:
    """The Ingress's request line as RequestRecord writes it, for a request that reached it
    now, called the synthesizer and got its first item back after the given delays."""
    record = RequestRecord({"method": "POST", "path": "/v1/speech/stream"},
                           {"x-request-id": request_id})
    record.state["speech"] = {"mode": "read", "format": "pcm",
                              "dispatched_s": record.started_s + dispatched_after_s,
                              "first_item_s": record.started_s + first_item_after_s}
    record.status, record.completed, record.ttfb_s = 200, True, ttfb_s
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="serve_app.requests"):
        record.log()
    return caplog.text


def test_the_ingress_leg_is_split_at_its_clock_readings(caplog):
    ingress_line = _ingress_line(caplog, "req-4", dispatched_after_s=0.002,
                                 first_item_after_s=0.050, ttfb_s=0.053)
    synthesizer_line = "first audio of stream=req-4 replica_ttfb_ms=41.0 engine_ttfb_ms=38.0\n"
    result = ttfb_breakdown(synthesizer_line + ingress_line,
                            [{"ok": True, "ttfb_s": 0.056, "request_id": "req-4"}])

    assert result["ingress_ms"]["p50"] == 53.0
    leg = result["ingress_leg"]
    assert leg["to_dispatch_ms"]["p50"] == 2.0
    # the first item came 48 ms after the call, 41 of them the synthesizer replica's own
    assert leg["crossings_ms"]["p50"] == 7.0
    assert leg["item_to_body_ms"]["p50"] == 3.0


def test_a_line_without_the_way_back_still_counts_and_has_no_leg():
    line = "first audio of stream=req-2 replica_ttfb_ms=61.0 engine_ttfb_ms=58.0\n"
    ingress_line = "request id=req-2 method=POST status=200 outcome=ok ttfb_ms=66.0\n"
    result = ttfb_breakdown(line + ingress_line,
                            [{"ok": True, "ttfb_s": 0.0705, "request_id": "req-2"}])

    assert result["synthesizer_ms"]["p50"] == 61.0
    assert result["hops_ms"]["p50"] == 12.5
    assert "replica_leg" not in result


def test_the_clock_readings_are_never_read_as_stage_durations():
    """The front's stage histogram takes every ``*_s`` timing of a chunk as seconds spent; the
    way-back readings are clock values, so none of them may look like one."""
    chunk = AudioChunk("req-3", np.zeros(480, np.float32), 24000, timings_s={"ttfb_s": 0.04})
    now = time.perf_counter()
    stamp_way_back(chunk, now, now, now)

    assert [name for name in chunk.timings_s if name.endswith("_s")] == ["ttfb_s"]
    assert len(chunk.timings_s) == 5


def test_busy_periods_give_time_per_step_and_each_phase_weighted_by_steps():
    log = ("engine busy period: steps=100 busy_s=1.000 ms_per_step=10.00 cpu_ms_per_step=9.00 "
           "streams_ended=2 llm_steps=40 device_memory_peak_gb=80.00 "
           "phase_ms_per_step=llm_decode:4.000,tts_step:6.000\n"
           "engine busy period: steps=300 busy_s=6.000 ms_per_step=20.00 cpu_ms_per_step=19.00 "
           "streams_ended=5 llm_steps=60 device_memory_peak_gb=81.00 "
           "phase_ms_per_step=llm_decode:8.000,tts_step:12.000\n"
           # an engine without phases (Piper) logs "-"
           "engine busy period: steps=0 busy_s=0.000 ms_per_step=0.00 cpu_ms_per_step=0.00 "
           "streams_ended=0 llm_steps=0 device_memory_peak_gb=0.00 phase_ms_per_step=-\n")
    busy = engine_busy(log)
    assert busy["steps"] == 400 and busy["busy_ms_per_step"] == 17.5
    assert busy["step_cpu_ms_per_step"] == 16.5 and busy["llm_steps_per_step"] == 0.25
    assert busy["phase_ms_per_step"] == {"llm_decode": 7.0, "tts_step": 10.5}
