"""What the engine benchmark reports from its measurements: whether a stream ran in real time
(a player starting at the first byte never runs dry), a level's step phases and slowest steps,
the largest real-time level, runs of different modes merged into one result, and the PNG."""

from __future__ import annotations

from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
SAMPLE_RATE = 24_000


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def stream_is_realtime(arrivals: list[tuple[float, int]]) -> bool:
    """A player starting at the first byte never runs dry: each chunk arrives before the audio
    already received has played out."""
    return bool(arrivals) and longest_stall_s(arrivals) <= 1e-3


def longest_stall_s(arrivals: list[tuple[float, int]]) -> float:
    """How long a player starting at the first byte waits, at its worst, for a chunk after the
    audio it holds has played out (0: it never runs dry; a player that does not pause would
    fall behind by this much at that chunk)."""
    if not arrivals:
        return 0.0
    start = arrivals[0][0]
    buffered_s = worst = 0.0
    for at, samples in arrivals:
        worst = max(worst, at - start - buffered_s)
        buffered_s += samples / SAMPLE_RATE
    return worst


def first_dry_at(arrivals: list[tuple[float, int]]) -> float | None:
    """When a player starting at the first byte first ran dry (the arrival time of the first
    chunk that came after the audio before it had played out); None if it never did."""
    if not arrivals:
        return None
    start = arrivals[0][0]
    buffered_s = 0.0
    for at, samples in arrivals:
        if at - start - buffered_s > 1e-3:
            return at
        buffered_s += samples / SAMPLE_RATE
    return None


def slow_step(record, level_start_s: float = 0.0) -> dict:
    """One step of the step log, for the JSON: when it began (seconds into the level), its time,
    streams, phases and device work."""
    return {"at_s": round(record.started_s - level_start_s, 3),
            "ms": round(record.seconds * 1000, 1), "generating": record.generating,
            "admitted": len(record.queue_waits_s), "gc_ms": round(record.gc_s * 1000, 1),
            "phase_ms": {name: round(s * 1000, 1) for name, s in record.phases_s},
            "work": dict(record.work)}


def step_phase_percentiles(records) -> dict:
    """Per phase: mean, p50 and p99 over the steps of the time the phase took in a step."""
    phases = [dict(record.phases_s) for record in records]
    out = {}
    for name in sorted({name for step in phases for name in step}):
        values = [step.get(name, 0.0) * 1000 for step in phases]
        out[name] = {"mean": round(float(np.mean(values)), 3), "p50": round(percentile(values, 50), 2),
                     "p99": round(percentile(values, 99), 2)}
    return out


def realtime_streams(rows: list[dict], floor: int = 0) -> int:
    """The largest concurrency at which every one of ``rows`` (one mode's levels, of one
    arrival or of several) is real-time (``ok``); ``floor`` when none is."""
    levels: dict[int, bool] = {}
    for row in rows:
        levels[row["concurrency"]] = levels.get(row["concurrency"], True) and row["ok"]
    return max([floor] + [concurrency for concurrency, ok in levels.items() if ok])


def headline(sweep: list[dict], mode: str) -> tuple[dict, int]:
    singles = [r for r in sweep if r["mode"] == mode and r["concurrency"] == 1]
    single = singles[0] if singles else {}
    poisson = [r for r in sweep if r["mode"] == mode and r["arrival"] == "poisson"]
    return ({"ttfb_ms_p50": single.get("ttfb_ms_p50"), "rtf": single.get("rtf_p50")},
            realtime_streams(poisson))


def largest_mixed_held(rows: list[dict]) -> dict[str, int]:
    """The mixed level with the most streams whose read and chat both held, as its counts."""
    top = max((row for row in rows if row["ok"]), key=lambda row: row["concurrency"], default=None)
    return {"read": top["read"], "chat": top["chat"]} if top else {"read": 0, "chat": 0}


def merge_results(results: list[dict]) -> dict:
    """One result from runs of different modes: per-mode tables joined, sweeps concatenated."""
    gpus = {r["gpu"] for r in results}
    commits = {r["git_commit"] for r in results}
    if len(gpus) != 1 or len(commits) != 1:
        raise SystemExit(f"refusing to merge runs of different GPUs or commits: {gpus} {commits}")
    merged = dict(results[0])
    merged["command"] = [r["command"] for r in results]
    merged["sweep"] = [row for r in results for row in r["sweep"]]
    for key in ("single_stream", "baseline_sequential_eager", "versus_baseline"):
        # per mode, the first run that measured it (a run of other levels leaves it empty)
        merged[key] = {}
        for r in results:
            for mode, value in r.get(key, {}).items():
                measured = not isinstance(value, dict) or any(v is not None for v in value.values())
                if measured and mode not in merged[key]:
                    merged[key][mode] = value
    # each run counts the levels it ran; the merged count is the highest level any run held
    merged["max_realtime_streams"] = {
        mode: max(r.get("max_realtime_streams", {}).get(mode, 0) for r in results)
        for mode in {m for r in results for m in r.get("max_realtime_streams", {})}
        if mode != "mixed"}
    mixed = [row for r in results for row in r.get("mixed", [])]
    if mixed:  # mixed levels joined
        merged["mixed"] = mixed
        merged["max_realtime_streams"]["mixed"] = largest_mixed_held(mixed)
    peaks = [r["peak_gpu_memory_gb"] for r in results if r.get("peak_gpu_memory_gb") is not None]
    merged["peak_gpu_memory_gb"] = max(peaks) if peaks else None
    return merged


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed; no plot", flush=True)
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode in ("read", "chat"):
        rows = [r for r in result["sweep"] if r["mode"] == mode and r["arrival"] == "poisson"]
        if not rows:
            continue
        xs = [r["concurrency"] for r in rows]
        for q in ("p50", "p99"):
            left.plot(xs, [r[f"ttfb_ms_{q}"] for r in rows], marker="o", label=f"{mode} {q}")
        right.plot(xs, [r["realtime_share"] * r["concurrency"] for r in rows], marker="o", label=mode)
    left.set(xscale="log", yscale="log", xlabel="concurrent streams", ylabel="TTFB (ms)",
             title=f"TTFB, Poisson arrivals ({result['gpu']})")
    left.axhline(500, color="grey", linestyle="--")
    right.set(xscale="log", xlabel="concurrent streams", ylabel="real-time streams",
              title="streams that never ran dry")
    left.legend()
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)

