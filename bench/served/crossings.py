"""The way between the Ingress and the Synthesizer replica, request by request, from the
service's log lines; and the garbage collector's pauses in each replica's process.

The Ingress logs when it called the synthesizer (``dispatch_clock``) and when the first item
came back (``first_item_ms``, since the request reached it); the Synthesizer logs when the
request reached it (``arrived_clock``) and its own time to the first chunk or to its answer
(a refusal). The clocks are ``time.perf_counter``: one clock for every process of a machine, so
on one machine the crossing splits into the way there (``to_replica_ms``: Serve's routing in the
Ingress, the transport, the replica taking the call) and the way back (``back_ms``: the first
item from the replica's ``yield`` to the Ingress). Replicas log each collection of at least 5 ms
(``serve_app/observability/gc_pauses.py``); a slow crossing that overlaps one is counted.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

DISPATCH_LINE = re.compile(r"request id=(\S+) .*?dispatched_ms=([\d.]+) first_item_ms=([\d.]+)"
                           r".*? dispatch_clock=([\d.]+)")
FIRST_AUDIO_LINE = re.compile(r"first audio of stream=(\S+) replica_ttfb_ms=([\d.]+)"
                              r".*? arrived_clock=([\d.]+)")
ANSWER_LINE = re.compile(r"answered stream=(\S+) status=(\d+) code=(\S+) arrived_clock=([\d.]+)"
                         r" replica_ms=([\d.]+)")
# Ray prefixes each replica's line on the driver's output with its actor:
# "(ServeReplica:<app>:<deployment> pid=N)"
GC_LINE = re.compile(r"^[^\n(]*(?:\(ServeReplica:[^:\s]+:(\w+) pid=(\d+)\))?[^\n]*?gc pause "
                     r"at_clock=([\d.]+) ms=([\d.]+) generation=(-?\d+)", re.MULTILINE)
SLOW_CROSSING_MS = 100.0  # a crossing this long is looked at against the collector's pauses
OVERLAP_PAUSE_MS = 20.0  # ... and against pauses at least this long


def crossing_legs(log_text: str, request_ids: set[str]) -> dict[str, Any] | None:
    """For ``request_ids`` (a level's admitted streams, or its refusals): p50 / p99 of the way
    there, the replica's own time (to the first chunk or the answer) and the way back; how many
    crossings took longer than :data:`SLOW_CROSSING_MS` and how many of those overlapped a
    collection of :data:`OVERLAP_PAUSE_MS` or more, by the deployment that paused."""
    calls = {m[1]: (float(m[4]), (float(m[3]) - float(m[2])) / 1000)
             for m in DISPATCH_LINE.finditer(log_text) if m[1] in request_ids}
    replica = {m[1]: (float(m[3]), float(m[2]) / 1000)
               for m in FIRST_AUDIO_LINE.finditer(log_text) if m[1] in request_ids}
    replica.update({m[1]: (float(m[4]), float(m[5]) / 1000)
                    for m in ANSWER_LINE.finditer(log_text) if m[1] in request_ids})
    joined = [(calls[rid], replica[rid]) for rid in calls if rid in replica]
    if not joined:
        return None
    pauses = gc_pause_list(log_text)
    there, inside, back, slow, slow_in_pause = [], [], [], 0, {}
    for (dispatch, waited), (arrived, own) in joined:
        there.append((arrived - dispatch) * 1000)
        inside.append(own * 1000)
        back.append((waited - (arrived - dispatch) - own) * 1000)
        if (waited - own) * 1000 < SLOW_CROSSING_MS:
            continue
        slow += 1
        for deployment in {d for d, start, ms in pauses if ms >= OVERLAP_PAUSE_MS
                           and start < dispatch + waited and start + ms / 1000 > dispatch}:
            slow_in_pause[deployment] = slow_in_pause.get(deployment, 0) + 1
    return {"requests": len(joined), "to_replica_ms": _p(there), "replica_ms": _p(inside),
            "back_ms": _p(back), "slow_crossings": slow,
            "slow_crossings_in_gc_pause": slow_in_pause}


def gc_pause_list(log_text: str) -> list[tuple[str, float, float]]:
    """(deployment, clock at start, ms) of each logged collection."""
    return [(m[1] or "unknown", float(m[3]), float(m[4])) for m in GC_LINE.finditer(log_text)]


def gc_pauses(log_text: str) -> dict[str, Any]:
    """The collections the replicas logged over a level, by deployment: how many, their total
    and longest ms, and how many processes logged them."""
    by_deployment: dict[str, dict[str, Any]] = {}
    for match in GC_LINE.finditer(log_text):
        entry = by_deployment.setdefault(match[1] or "unknown",
                                         {"count": 0, "total_ms": 0.0, "max_ms": 0.0,
                                          "pids": set()})
        ms = float(match[4])
        entry["count"] += 1
        entry["total_ms"] = round(entry["total_ms"] + ms, 1)
        entry["max_ms"] = max(entry["max_ms"], ms)
        entry["pids"].add(match[2])
    return {name: {"count": e["count"], "total_ms": e["total_ms"], "max_ms": e["max_ms"],
                   "processes": len(e["pids"])} for name, e in by_deployment.items()}


def _p(values: list[float]) -> dict[str, float]:
    return {"p50": round(float(np.percentile(values, 50)), 1),
            "p99": round(float(np.percentile(values, 99)), 1)}
