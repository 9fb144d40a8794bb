"""What the autoscaling benchmark reports: the timeline in 5 s windows of stream starts, the
controller's scaling decisions, TTFB before, during and after the scale-out, failed and cut
streams, and the PNG."""

from __future__ import annotations

import argparse
import math
import re
import time
from pathlib import Path
from typing import Any

from bench.autoscale.load import peak_span_s, target_streams
from bench.autoscale.readings import step_ms_by_replica
from bench.served.served_logs import percentile
WINDOW_S = 5.0
TTFB_RANGES_RULE = (
    "A stream counts in the range in which its request was sent (its start on the load's "
    "clock, s), wherever its first byte came; the timeline's 5 s windows too. before_scale_out: "
    "from 0 to scale_out_decision_t_s (the controller's upscale log line; no decision: the whole "
    "run); during_scale_up: from the decision to second_replica_ready_t_s (the first poll of "
    "Serve's status, about every second, that saw 2 RUNNING replicas); after_ready: from then to "
    "the end of the hold at peak_streams (the schedule's 'peak' stage), so it holds streams sent "
    "while the first replica still carried the slower streams it had started before; "
    "at_peak_after_ready: the hold at peak_streams from when 2 replicas were ready. "
    "ttfb_ms_p99_before_scale_out, _during_scale_up and _after_ready are these ranges' p99.")
SCALE_LINE = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) controller \d+ -- "
                        r"(Upscaling|Downscaling) Deployment\(name='Synthesizer'.*? from (\d+) "
                        r"to (\d+) replicas")


def scale_decisions(log_text: str, load_t0_s: float) -> list[dict[str, Any]]:
    """Serve controller's scaling decisions for the Synthesizer, on the load's clock."""
    decisions = []
    for match in SCALE_LINE.finditer(log_text):
        at = time.mktime(time.strptime(match[1], "%Y-%m-%d %H:%M:%S")) + int(match[2]) / 1000
        decisions.append({"t_s": round(at - load_t0_s, 1), "action": match[3].lower(),
                          "from": int(match[4]), "to": int(match[5])})
    return decisions


def summarize(rows: list[dict[str, Any]], samples: list[dict[str, Any]], load_t0_s: float,
              poll_t0: float, args: argparse.Namespace, log_text: str = "") -> dict[str, Any]:
    """The timeline in 5 s windows (on the load's clock), the failures and the scale events
    (the decisions from the controller's log, the replicas' states from Serve's status)."""
    offset = poll_t0 - load_t0_s  # poll time + offset = load time
    for sample in samples:
        sample["t_s"] = round(sample["t_s"] + offset, 1)
    cut = [r for r in rows if r.get("ok") and r.get("audio_s", 0) < 0.95 * args.audio_seconds]
    failed = [r for r in rows if not r.get("ok")]
    end = max([s["t_s"] for s in samples] + [0.0])
    # (start on the load's clock, TTFB ms) of every stream that had one
    ttfb_ms = [(r["start"] - load_t0_s, r["ttfb_s"] * 1000) for r in rows
               if r.get("ok") and r.get("ttfb_s")]

    def ttfbs_between(start: float, stop: float) -> list[float]:
        return [ms for at, ms in ttfb_ms if start <= at < stop]

    timeline = []
    for index in range(int(math.ceil(end / WINDOW_S)) + 1):
        low, high = index * WINDOW_S, (index + 1) * WINDOW_S
        window = [s for s in samples if low <= s["t_s"] < high]
        if not window:
            continue
        states: dict[str, int] = window[-1].get("states", {})
        starts = [r for r in rows if low <= r["start"] - load_t0_s < high]
        ttfbs = ttfbs_between(low, high)
        timeline.append({
            "t_s": low, "replicas": states.get("RUNNING", 0),
            "starting": states.get("STARTING", 0) + states.get("UPDATING", 0),
            "draining": states.get("STOPPING", 0), "target_streams": round(target_streams(low, args)),
            "queued": max((s.get("queued", 0.0) for s in window), default=0.0),
            "slot_occupancy": max((s.get("slot_occupancy", 0.0) for s in window), default=0.0),
            "streams_started": len(starts), "ttfb_ms_p50": percentile(ttfbs, 50),
            "ttfb_ms_p99": percentile(ttfbs, 99),
            "gpus": next((s["gpus"] for s in reversed(window) if s.get("gpus")), []),
            "per_replica": _per_replica_window(window, step_ms_by_replica(samples, high))})
    total = [s for s in samples if "states" in s]
    decisions = scale_decisions(log_text, load_t0_s)
    decided = next((d["t_s"] for d in decisions if d["action"] == "upscaling"),
                   next((s["t_s"] for s in total if sum(s["states"].values()) >= 2), None))
    ready = next((s["t_s"] for s in total if s["states"].get("RUNNING", 0) >= 2), None)
    back = next((s["t_s"] for s in total if ready is not None and s["t_s"] > ready
                 and s["states"].get("RUNNING", 0) == 1 and sum(s["states"].values()) == 1), None)

    def ttfb_range(start: float | None, stop: float | None) -> dict[str, Any]:
        """The streams that started in [start, stop) (stop None: to the end of the run)."""
        ttfbs = [] if start is None else ttfbs_between(start, stop if stop is not None else 1e9)
        return {"from_t_s": start, "to_t_s": stop, "streams": len(ttfbs),
                "ttfb_ms_p50": percentile(ttfbs, 50), "ttfb_ms_p99": percentile(ttfbs, 99)}

    peak_start, hold_end = peak_span_s(args)
    both_at_peak = max(ready, peak_start) if ready is not None and ready < hold_end else None
    ranges = {"before_scale_out": ttfb_range(0.0, decided),
              "during_scale_up": ttfb_range(decided, ready),
              "after_ready": ttfb_range(ready, hold_end),
              "at_peak_after_ready": ttfb_range(both_at_peak, hold_end)}
    peak = max((row["replicas"] for row in timeline), default=0)
    return {
        "replicas_timeline": timeline, "scale_decisions": decisions,
        "failed_streams": len(failed), "cut_streams": len(cut),
        "streams": len(rows), "errors": sorted({r.get("error") or "" for r in failed})[:5],
        "peak_replicas": peak, "replicas_went": _went(timeline),
        "scale_out_decision_t_s": decided, "second_replica_ready_t_s": ready,
        "second_replica_ready_s": round(ready - decided, 1) if ready is not None
        and decided is not None else None,
        "back_to_one_t_s": back,
        "ttfb_ms_p99_during_scale_up": ranges["during_scale_up"]["ttfb_ms_p99"],
        "ttfb_ms_p99_after_ready": ranges["after_ready"]["ttfb_ms_p99"],
        "ttfb_ms_p99_before_scale_out": ranges["before_scale_out"]["ttfb_ms_p99"],
        "ttfb_ranges": ranges, "ttfb_ranges_rule": TTFB_RANGES_RULE,
    }


def _per_replica_window(window: list[dict[str, Any]], step_ms: dict[str, float]
                        ) -> dict[str, dict[str, Any]]:
    """Per replica in a window: its largest slot occupancy and queue, and its step time."""
    replicas: dict[str, dict[str, Any]] = {}
    for sample in window:
        for replica, values in (sample.get("per_replica") or {}).items():
            row = replicas.setdefault(replica, {"slot_occupancy": 0.0, "active_streams": 0.0,
                                                "queued": 0.0})
            for name in row:
                row[name] = max(row[name], values.get(name, 0.0))
    for replica, row in replicas.items():
        row["step_ms"] = step_ms.get(replica)
    return replicas


def _went(timeline: list[dict[str, Any]]) -> list[int]:
    """The running replica counts in order, repeats folded: [1, 2, 1] for a full cycle."""
    went: list[int] = []
    for row in timeline:
        if row["replicas"] and (not went or went[-1] != row["replicas"]):
            went.append(row["replicas"])
    return went


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["replicas_timeline"]
    t = [r["t_s"] for r in rows]
    gpus = sorted({g["index"] for r in rows for g in r.get("gpus", [])})
    fig, axes = plt.subplots(3 if gpus else 2, 1, figsize=(10, 10 if gpus else 7), sharex=True)
    top, bottom = axes[0], axes[1]
    top.step(t, [r["replicas"] for r in rows], where="post", label="running replicas")
    top.step(t, [r["starting"] for r in rows], where="post", label="starting")
    top.set_ylabel("Synthesizer replicas")
    streams = top.twinx()
    streams.plot(t, [r["target_streams"] for r in rows], "k:", label="offered streams")
    streams.plot(t, [r["slot_occupancy"] * 100 for r in rows], "g--", label="slot occupancy %")
    streams.set_ylabel("streams / occupancy %")
    top.legend(loc="upper left")
    streams.legend(loc="upper right")
    for q, style in (("p50", "-"), ("p99", "-")):
        bottom.plot(t, [r[f"ttfb_ms_{q}"] for r in rows], style, marker=".", label=f"TTFB {q}")
    bottom.axhline(500, color="grey", linestyle=":")
    bottom.set(xlabel="seconds since the load started", ylabel="TTFB (ms)",
               title=f"{result['gpu']}: {result['policy']}")
    bottom.legend()
    if gpus:
        memory = axes[2].twinx()
        for index in gpus:
            readings = [(r["t_s"], g) for r in rows for g in r.get("gpus", [])
                        if g["index"] == index]
            axes[2].plot([t for t, _ in readings], [g["utilization_percent"] for _, g in readings],
                         label=f"GPU {index} utilization %")
            memory.plot([t for t, _ in readings], [g["memory_used_gib"] for _, g in readings],
                        "--", label=f"GPU {index} memory GiB")
        axes[2].set(xlabel="seconds since the load started", ylabel="utilization %")
        memory.set_ylabel("memory used (GiB)")
        axes[2].legend(loc="upper left")
        memory.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
