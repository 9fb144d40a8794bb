"""What a served benchmark reads back from a level: the service's log lines (the Ingress's per
request, the Synthesizer's first chunk and engine busy periods) and Locust's stats CSV.

Used by ``bench/served/run.py`` for each level it measures.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path
from typing import Any

import numpy as np


INGRESS_LINE = re.compile(r"request id=(\S+) .*? ttfb_ms=([\d.]+)"
                          r"(?: dispatched_ms=([\d.]+))?(?: first_item_ms=([\d.]+))?")
SYNTHESIZER_LINE = re.compile(
    r"first audio of stream=(\S+) replica_ttfb_ms=([\d.]+) engine_ttfb_ms=([\d.]+|-)"
    r"(?: engine_sent_ms=([\d.]+|-) replica_received_ms=([\d.]+|-)"
    r" replica_dispatched_ms=([\d.]+|-))?(?: engine_sending_ms=([\d.]+|-))?"
    r"(?: replica_admitted_ms=([\d.]+|-))?")
# The Synthesizer replica's leg of a first chunk, split by the clock readings its log line
# carries (ms since the request reached the replica): name -> (later reading, earlier one).
REPLICA_LEG = {
    # arrival -> the engine process submitted it (its send time minus the engine's own TTFB):
    # @serve.batch admission and the submission to the engine process
    "to_engine_ms": ("sent", "engine"),
    # ... split: arrival -> the engine's answer to its submission came back (the replica's
    # room check, @serve.batch's queue, the submission's round trip) ...
    "to_admission_ms": ("admitted", "arrival"),
    # the engine process's sink took the chunk -> the replica's reader thread read it; split:
    "engine_to_reader_ms": ("received", "sent"),
    # ... the sink took it -> the engine's sender thread began writing it (pickling on the step
    # thread, the messages before it, the sender's wait for the GIL)
    "engine_to_sender_ms": ("sending", "sent"),
    # ... the sender began writing -> the reader had it all, unpickled (the audio ring or the
    # socket, both sides' threads)
    "sender_to_reader_ms": ("received", "sending"),
    # the reader thread -> the replica's event loop put it in the stream's inbox
    "reader_to_loop_ms": ("dispatched", "received"),
    # the inbox -> the chunk left the replica (Serve took it from the stream)
    "loop_to_out_ms": ("replica", "dispatched"),
}


BUSY_LINE = re.compile(r"engine busy period: steps=(\d+) busy_s=([\d.]+)"
                       r"(?:.*? cpu_ms_per_step=([\d.]+))?"
                       r"(?:.*? llm_steps=(\d+))?(?:.*? device_memory_peak_gb=([\d.]+))?"
                       r"(?:.*? phase_ms_per_step=(\S+))?")


def engine_busy(log_text: str) -> dict[str, Any] | None:
    """The served engine's steps and its time per step (inside steps, idle left out) over the
    level, from the synthesizer's busy-period log lines: bench_engine.py's
    ``busy_ms_per_step``, so the two runs show whether the engine itself ran slower here, and
    its step thread's CPU time per step (``step_cpu_ms_per_step``)."""
    matches = list(BUSY_LINE.finditer(log_text))
    periods = [(int(m[1]), float(m[2]), float(m[3] or 0) * int(m[1]), int(m[4] or 0),
                float(m[5] or 0)) for m in matches]
    steps = sum(p[0] for p in periods)
    if not steps:
        return None
    busy_s = sum(p[1] for p in periods)
    phase_ms: dict[str, float] = {}  # each phase's host ms summed over the periods' steps
    for m in matches:
        for pair in (m[6] or "-").split(","):
            name, _, ms = pair.partition(":")
            if ms:
                phase_ms[name] = phase_ms.get(name, 0.0) + float(ms) * int(m[1])
    return {"steps": steps, "busy_s": round(busy_s, 3),
            "busy_ms_per_step": round(busy_s * 1000 / steps, 3),
            "step_cpu_ms_per_step": round(sum(p[2] for p in periods) / steps, 3),
            "llm_steps_per_step": round(sum(p[3] for p in periods) / steps, 3),
            "device_memory_peak_gb": max(p[4] for p in periods),
            # host ms per step by phase: bench_engine's step_phase_ms means, inside the service
            "phase_ms_per_step": {name: round(total / steps, 3)
                                  for name, total in phase_ms.items()}}


def ttfb_breakdown(log_text: str, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Where the served TTFB goes, per request of the level, from the client's record and the
    service's log lines (the ingress's and the synthesizer's, matched by request id): p50 and
    p99 of the client's TTFB, the ingress's (arrival there to first body byte), the
    synthesizer replica's (arrival to first chunk) and the engine's (submission to first
    audio, where the first chunk carried it); ``hops_ms`` is the client's minus the engine's,
    request by request; ``replica_leg`` splits the replica's time around the engine's
    (:data:`REPLICA_LEG`). ``requests`` counts the matched requests, ``requests_ok`` the
    level's."""
    ingress_lines = {m[1]: m for m in INGRESS_LINE.finditer(log_text)}
    ingress = {rid: float(m[2]) for rid, m in ingress_lines.items()}
    readings = {m[1]: {"replica": float(m[2]), "engine": _reading(m[3]), "sent": _reading(m[4]),
                       "received": _reading(m[5]), "dispatched": _reading(m[6]),
                       "sending": _reading(m[7]), "admitted": _reading(m[8]), "arrival": 0.0}
                for m in SYNTHESIZER_LINE.finditer(log_text)}
    ok = [r for r in rows if r.get("ok") and r.get("ttfb_s") is not None]
    joined = [(r["ttfb_s"] * 1000, ingress[r["request_id"]],
               readings[r["request_id"]]["replica"], readings[r["request_id"]]["engine"])
              for r in ok if r.get("request_id") in ingress and r.get("request_id") in readings]
    if not joined:
        return None
    result: dict[str, Any] = {"requests": len(joined), "requests_ok": len(ok)}
    for index, name in enumerate(("client", "ingress", "synthesizer", "engine")):
        values = [row[index] for row in joined if row[index] is not None]
        result[f"{name}_ms"] = {"p50": percentile(values, 50), "p99": percentile(values, 99)}
    hops = [client - engine for client, _, _, engine in joined if engine is not None]
    result["hops_ms"] = {"p50": percentile(hops, 50), "p99": percentile(hops, 99)}
    matched = [readings[r["request_id"]] for r in ok if r.get("request_id") in readings]
    leg = {}
    for name, (later, earlier) in REPLICA_LEG.items():
        values = [row[later] - row[earlier] for row in matched
                  if row[later] is not None and row[earlier] is not None]
        if values:
            leg[name] = {"p50": percentile(values, 50), "p99": percentile(values, 99)}
    if leg:
        result["replica_leg"] = leg
    front = _ingress_leg([(ingress_lines[r["request_id"]], readings[r["request_id"]]["replica"])
                          for r in ok if r.get("request_id") in ingress_lines
                          and r.get("request_id") in readings])
    if front:
        result["ingress_leg"] = front
    return result


def _ingress_leg(matched: list[tuple[re.Match, float]]) -> dict[str, Any]:
    """The Ingress replica's leg of a first chunk, from its log line's clock readings (ms since
    the request reached it) and the Synthesizer replica's TTFB: until it called the synthesizer
    (the body parsed and checked), the two crossings between the replicas (the synthesizer's
    call there and its first item back: the first item's wait minus the replica's own TTFB),
    and from that item to the first body byte."""
    parts: dict[str, list[float]] = {"to_dispatch_ms": [], "crossings_ms": [],
                                     "item_to_body_ms": []}
    for line, replica_ms in matched:
        if line[3] is None or line[4] is None:
            continue
        ttfb, dispatched, first_item = float(line[2]), float(line[3]), float(line[4])
        parts["to_dispatch_ms"].append(dispatched)
        parts["crossings_ms"].append(first_item - dispatched - replica_ms)
        parts["item_to_body_ms"].append(ttfb - first_item)
    return {name: {"p50": percentile(values, 50), "p99": percentile(values, 99)}
            for name, values in parts.items() if values}


def _reading(text: str | None) -> float | None:
    return None if text in (None, "-") else float(text)


def percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 1) if values else None


def locust_summary(stats_csv: Path) -> dict[str, Any]:
    """Locust's own numbers for the stream (POST) and TTFB rows."""
    summary: dict[str, Any] = {}
    if not stats_csv.exists():
        return summary
    with stats_csv.open(newline="") as handle:
        for row in csv.DictReader(handle):
            if row["Name"] == "Aggregated":
                continue
            summary[row["Type"]] = {
                "requests": int(row["Request Count"]), "failures": int(row["Failure Count"]),
                "requests_per_s": round(float(row["Requests/s"]), 2),
                "p50_ms": float(row["50%"]), "p90_ms": float(row["90%"]),
                "p99_ms": float(row["99%"])}
    return summary
