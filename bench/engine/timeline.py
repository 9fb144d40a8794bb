"""Where a profiled window's GPU time went, by CUDA stream: a summary of the Chrome trace that
``bench.engine.run --kernel-profile-s S --kernel-trace-out PATH`` writes (``PATH.gz``).

For each stream: its kernels' time per second of the window and per engine step, and its
kernels that took the most; for the device: the time any kernel ran (the union over streams),
the share of the window it was busy. The steps are counted by a kernel that runs a known number
of times a step (``--step-kernel NAME --calls-per-step N``; by default the TTS attention of the
audio window, 20 layers x 5 frames), since the profiler's own pauses make the engine's step
counter over the window unreliable.

    python -m bench.engine.timeline trace.json.gz --out timeline.json
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
from pathlib import Path

STEP_KERNEL = "rope_write_attention_kernel"
# the audio window: one call a TTS layer (20) a frame (steps_per_sync 5); the LLM's calls of the
# same kernel run on another stream, so only the stream that calls it most is counted
CALLS_PER_STEP = 100


def kernels(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e.get("cat") == "kernel"]


def busy_us(events: list[dict]) -> float:
    """The time at least one of ``events`` ran (their intervals' union), in microseconds."""
    total, start, end = 0.0, None, None
    for s, e in sorted((ev["ts"], ev["ts"] + ev["dur"]) for ev in events):
        if end is None or s > end:
            if end is not None:
                total += end - start
            start, end = s, e
        else:
            end = max(end, e)
    return total + (end - start if end is not None else 0.0)


def summarize(trace: dict, step_kernel: str = STEP_KERNEL,
              calls_per_step: int = CALLS_PER_STEP, top: int = 10) -> dict:
    events = kernels(trace)
    if not events:
        raise ValueError("the trace holds no kernels")
    window_us = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    by_stream: dict[object, list[dict]] = collections.defaultdict(list)
    for e in events:
        by_stream[e["tid"]].append(e)
    marks = max((sum(1 for e in evs if e["name"] == step_kernel) for evs in by_stream.values()),
                default=0)
    steps = marks / calls_per_step
    streams = {}
    for stream, evs in sorted(by_stream.items(), key=lambda item: -sum(e["dur"] for e in item[1])):
        time_us = sum(e["dur"] for e in evs)
        names: collections.Counter = collections.Counter()
        for e in evs:
            names[e["name"]] += e["dur"]
        streams[str(stream)] = {
            "kernel_ms_per_s": round(time_us / window_us * 1000, 2),
            "kernel_ms_per_step": round(time_us / 1000 / steps, 2) if steps else None,
            "top_kernels": [{"name": name[:100], "ms_per_step": round(us / 1000 / steps, 3)
                             if steps else None, "share": round(us / time_us, 3)}
                            for name, us in names.most_common(top)]}
    union = busy_us(events)
    return {"window_s": round(window_us / 1e6, 3), "engine_steps": steps,
            "step_ms": round(window_us / 1000 / steps, 1) if steps else None,
            "gpu_busy_fraction": round(union / window_us, 3),
            "gpu_busy_ms_per_step": round(union / 1000 / steps, 1) if steps else None,
            "streams": streams}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", help="a Chrome trace, .json or .json.gz")
    parser.add_argument("--step-kernel", default=STEP_KERNEL)
    parser.add_argument("--calls-per-step", type=int, default=CALLS_PER_STEP)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt") as f:
        result = {"command": " ".join(["python -m bench.engine.timeline", *sys.argv[1:]]),
                  **summarize(json.load(f), args.step_kernel, args.calls_per_step)}
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
