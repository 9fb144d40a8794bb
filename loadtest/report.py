"""A load test's summary (JSON) and plot (PNG), from the per-request records the locustfile writes.

Throughput counts completed streams and the audio they carried over the run's window (first
request sent to last byte received); TTFB percentiles cover successful streams only; every
failure counts towards the error rate, whatever its cause. Streams still open when the run
ended (``ok`` is null) are counted apart as ``unfinished``.
"""

from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


def load_records(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of ``LOADTEST_RECORDS``; a missing file means no request finished."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _stats(values: Iterable[float], scale: float = 1.0, digits: int = 1) -> dict[str, float]:
    array = np.asarray([v for v in values if v is not None], dtype=float) * scale
    if array.size == 0:
        return {}
    result = {f"p{p}": round(float(np.percentile(array, p)), digits) for p in PERCENTILES}
    result["mean"] = round(float(array.mean()), digits)
    result["max"] = round(float(array.max()), digits)
    return result


def _finished(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r["ok"] is not None]


def _window(records: list[dict[str, Any]]) -> tuple[float, float]:
    start = min(r["start"] for r in records)
    end = max(r["start"] + r["total_s"] for r in records)
    return start, end


def _group(records: list[dict[str, Any]], duration_s: float) -> dict[str, Any]:
    ok = [r for r in records if r["ok"]]
    audio_s = sum(r["audio_s"] for r in ok)
    return {
        "requests": len(records),
        "failures": len(records) - len(ok),
        "requests_per_s": round(len(ok) / duration_s, 3),
        "audio_seconds_per_s": round(audio_s / duration_s, 3),
        "ttfb_ms": _stats((r["ttfb_s"] for r in ok), 1000.0),
        "rtf": _stats((r["total_s"] / r["audio_s"] for r in ok), digits=3),
    }


def locust_failures(stats_csv: Path) -> int | None:
    """Failures Locust itself counted on HTTP rows (a cross-check on the records)."""
    if not stats_csv.exists():
        return None
    with stats_csv.open() as handle:
        return sum(int(row["Failure Count"]) for row in csv.DictReader(handle)
                   if row["Type"] in ("GET", "POST"))


def summarize(records: list[dict[str, Any]], *, host: str, users: int,
              extra: dict[str, Any] | None = None,
              locust_failure_count: int | None = None) -> dict[str, Any]:
    """Requests/s, audio seconds per second, TTFB percentiles, error rate, users, breakdowns."""
    summary: dict[str, Any] = {"host": host, "users": users, **(extra or {})}
    unfinished = len(records) - len(_finished(records))
    records = _finished(records)
    summary["unfinished"] = unfinished
    if not records:
        return {**summary, "requests": 0, "failures": locust_failure_count or 0,
                "error_rate": 1.0 if locust_failure_count else 0.0, "requests_per_s": 0.0,
                "audio_seconds_per_s": 0.0, "duration_s": 0.0}
    start, end = _window(records)
    duration_s = max(end - start, 1e-9)
    ok = [r for r in records if r["ok"]]
    # a refusal (503 or 429 with Retry-After, before any audio) is the service keeping what it
    # admitted real-time: counted apart from failures (Locust counts it as one)
    refused = sum(bool(r.get("refused")) for r in records)
    failures = max(len(records) - len(ok) - refused, (locust_failure_count or 0) - refused)
    total = max(len(records), len(ok) + failures + refused)
    summary.update({
        "duration_s": round(duration_s, 2),
        "users_max_seen": max((r.get("users") or 0) for r in records),
        "requests": total,
        "successes": len(ok),
        "failures": failures,
        "refused": refused,
        "error_rate": round(failures / total, 4),
        "requests_per_s": round(len(ok) / duration_s, 3),
        "audio_seconds": round(sum(r["audio_s"] for r in ok), 2),
        "audio_seconds_per_s": round(sum(r["audio_s"] for r in ok) / duration_s, 3),
        "ttfb_ms": _stats((r["ttfb_s"] for r in ok), 1000.0),
        "total_ms": _stats((r["total_s"] for r in ok), 1000.0),
        "rtf": _stats((r["total_s"] / r["audio_s"] for r in ok), digits=3),
        "by_route": {},
        "by_length": {},
        "failure_samples": sorted({r["error"] for r in records
                                   if not r["ok"] and not r.get("refused")})[:5],
    })
    for key, field in (("by_route", "route"), ("by_length", "length")):
        groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for record in records:
            groups[record[field]].append(record)
        summary[key] = {name: _group(group, duration_s) for name, group in sorted(groups.items())}
    return summary


def _users_over_time(history_csv: Path | None) -> tuple[list[float], list[int]]:
    if history_csv is None or not history_csv.exists():
        return [], []
    times, users = [], []
    with history_csv.open() as handle:
        for row in csv.DictReader(handle):
            if row.get("Name") == "Aggregated":
                times.append(float(row["Timestamp"]))
                users.append(int(row["User Count"]))
    return times, users


def plot(records: list[dict[str, Any]], out_png: Path, *, history_csv: Path | None = None,
         title: str = "") -> None:
    """TTFB p50/p90/p99 and throughput (requests/s, audio s/s, users) over time."""
    records = _finished(records)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ttfb, ax_rate) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    ok = [r for r in records if r["ok"]]
    if records:
        start, end = _window(records)
        bin_s = max(1.0, math.ceil((end - start) / 30))
        edges = np.arange(0.0, end - start + bin_s, bin_s)
        centers = edges[:-1] + bin_s / 2
        first_byte = np.array([r["start"] + r["ttfb_s"] - start for r in ok])
        ttfb_ms = np.array([r["ttfb_s"] * 1000 for r in ok])
        for p in PERCENTILES:
            series = [np.percentile(ttfb_ms[(first_byte >= lo) & (first_byte < lo + bin_s)], p)
                      if np.any((first_byte >= lo) & (first_byte < lo + bin_s)) else np.nan
                      for lo in edges[:-1]]
            ax_ttfb.plot(centers, series, marker="o", markersize=3, label=f"p{p}")
        finished = np.array([r["start"] + r["total_s"] - start for r in ok])
        audio = np.array([r["audio_s"] for r in ok])
        counts, _ = np.histogram(finished, bins=edges)
        audio_sums, _ = np.histogram(finished, bins=edges, weights=audio)
        ax_rate.step(centers, counts / bin_s, where="mid", label="requests/s")
        ax_rate.step(centers, audio_sums / bin_s, where="mid", label="audio s/s")
        failed = [r["start"] + r["total_s"] - start for r in records if not r["ok"]]
        if failed:
            ax_rate.plot(failed, [0] * len(failed), "rx", label="failures")
        times, users = _users_over_time(history_csv)
        if times:
            ax_users = ax_rate.twinx()
            ax_users.step([t - start for t in times], users, where="post", color="grey",
                          alpha=0.6, label="users")
            ax_users.set_ylabel("users")
            ax_users.legend(loc="upper right")
    for axis in (ax_ttfb, ax_rate):
        if axis.get_legend_handles_labels()[0]:
            axis.legend(loc="upper left")
    ax_ttfb.set_ylabel("TTFB (ms)")
    ax_ttfb.set_title(title or "time to first byte, by second of first byte")
    ax_ttfb.grid(alpha=0.3)
    ax_rate.set_ylabel("per second (by end of stream)")
    ax_rate.set_xlabel("seconds since the first request")
    ax_rate.grid(alpha=0.3)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
