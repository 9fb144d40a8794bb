"""bench/engine/timeline.py: a profiled window's kernels summed by CUDA stream, the device's busy
time as the union over streams (overlapping kernels counted once), steps counted by a kernel
that runs a known number of times a step."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

from bench.engine.timeline import busy_us, summarize


def kernel(name: str, stream: int, start: float, duration: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": start,
            "dur": duration}


def two_steps() -> dict:
    """Two 1000 us steps: the window's stream runs two marker kernels a step (0-400 us), the
    LLM's stream one 300 us kernel a step overlapping it by 100 us; a runtime call besides."""
    events = []
    for step in (0, 1000):
        events += [kernel("mark", 16, step, 200), kernel("mark", 16, step + 200, 200),
                   kernel("gemm", 29, step + 300, 300)]
    events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "pid": 0,
                   "tid": 1, "ts": 0, "dur": 5})
    return {"traceEvents": events}


def test_the_union_counts_overlapping_kernels_once():
    assert busy_us([kernel("a", 1, 0, 10), kernel("b", 2, 5, 10), kernel("c", 1, 30, 5)]) == 20


def test_a_window_by_stream_and_step():
    result = summarize(two_steps(), step_kernel="mark", calls_per_step=2, top=2)
    assert result["engine_steps"] == 2
    assert result["step_ms"] == 0.8  # the first kernel's start to the last one's end, by 2
    assert result["gpu_busy_ms_per_step"] == 0.6  # 0-600 us of each step
    assert list(result["streams"]) == ["16", "29"]  # the busiest first
    window, llm = result["streams"]["16"], result["streams"]["29"]
    assert (window["kernel_ms_per_step"], llm["kernel_ms_per_step"]) == (0.4, 0.3)
    assert window["top_kernels"] == [{"name": "mark", "ms_per_step": 0.4, "share": 1.0}]


def test_it_reads_the_gzipped_trace_the_engine_bench_writes(tmp_path):
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(two_steps(), f)
    out = tmp_path / "timeline.json"
    subprocess.run([sys.executable, "-m", "bench.engine.timeline", str(path), "--step-kernel",
                    "mark", "--calls-per-step", "2", "--out", str(out)], check=True,
                   capture_output=True, cwd=Path(__file__).resolve().parents[2], timeout=120)
    assert json.loads(out.read_text())["streams"]["29"]["kernel_ms_per_s"] == 375.0
