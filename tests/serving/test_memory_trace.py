"""The replicas' memory trace (serve_app/observability/memory_trace.py): off unless
TTS_TRACE_MEMORY_S asks; when on, its report names the line of ours whose allocations grew."""

from __future__ import annotations

import tracemalloc

import pytest

from serve_app.observability import memory_trace
from tests.own_process import call_in_own_process


def test_it_is_off_unless_asked_and_a_bad_period_is_refused(monkeypatch):
    monkeypatch.delenv(memory_trace.ENV, raising=False)
    assert memory_trace.start_if_asked("Ingress") is None
    monkeypatch.setenv(memory_trace.ENV, "0")
    with pytest.raises(ValueError, match=memory_trace.ENV):
        memory_trace.period_asked()
    monkeypatch.setenv(memory_trace.ENV, "30")
    assert memory_trace.period_asked() == 30.0


def report_of_a_megabyte_kept() -> tuple[int, str]:
    """Run in a process of its own (tests/own_process.py says why): how many buffers a line of
    this module kept, and the trace's report of that growth."""
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start(memory_trace.FRAMES)
    try:
        baseline = tracemalloc.take_snapshot()
        kept = [bytearray(4096) for _ in range(256)]  # ~1 MB held by this test's line
        report = memory_trace.growth_report("Ingress", baseline, tracemalloc.take_snapshot())
    finally:
        if started:
            tracemalloc.stop()
    return len(kept), report


def test_the_report_names_the_line_whose_allocations_grew():
    # tracemalloc in the suite's process crashed a whole run (SIGSEGV in traceback_new, from a
    # native thread an earlier test's Ray driver left)
    kept, report = call_in_own_process("tests.serving.test_memory_trace",
                                       "report_of_a_megabyte_kept")
    assert kept == 256
    first, top = report.splitlines()[:2]
    assert first.startswith("memory trace: Ingress Python allocations +1.")
    # the most grown site is this test's line (no frame of serve_app/ in its traceback)
    assert "kB in +" in top and "test_memory_trace.py" in top
