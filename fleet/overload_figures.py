"""What ``scripts/overload_nodes`` saw, as figures: each phase's streams counted as the overload
benchmark counts them (``bench/overload/levels.py:summarize``), where they ran, the
autoscaler's launch, the third replica's times, the timeline and the acceptance checks."""

from __future__ import annotations

from typing import Any

from bench.overload.levels import StreamFate, summarize as level_figures
from bench.overload.run import REALTIME_SHARE
from fleet.autoscaling_cluster import HEAD_NODE_ID, node_launches

FILL, BURST, FOLLOW = "fill", "burst", "follow"


def phase_figures(fates: list[StreamFate]) -> dict[str, Any]:
    """A phase's streams counted as a level of the overload benchmark, less what only a level
    of fixed length has (goodput, the offered rate: in the run's ``load``) and its per-kind
    split (every stream here is a read stream)."""
    figures = level_figures(fates, "read", 0.0, 1.0)
    for key in ("mix", "offered_x", "window_s", "goodput_streams_per_s",
                "goodput_audio_s_per_s", "by_kind"):
        figures.pop(key)
    return figures


def admitted_by_replica(fates: list[StreamFate], placed: dict[str, str]) -> dict[str, int]:
    """Admitted streams per Synthesizer replica (``None``: not found in the replicas' logs)."""
    counts: dict[str, int] = {}
    for fate in fates:
        if fate.admitted:
            replica = str(placed.get(fate.request_id or ""))
            counts[replica] = counts.get(replica, 0) + 1
    return counts


def third_running_at(samples: list[dict[str, Any]], since: float) -> float | None:
    """The first sample after ``since`` with three Synthesizer replicas running."""
    return next((s["at"] for s in samples if s["at"] >= since
                 and (s.get("replicas") or {}).get("RUNNING", 0) >= 3), None)


def third_replica_times(samples: list[dict[str, Any]], since: float) -> dict[str, Any]:
    """When (seconds after ``since``) Serve first had a third Synthesizer replica in any state,
    and when three first ran."""
    asked = next((s["at"] for s in samples if s["at"] >= since
                  and sum((s.get("replicas") or {}).values()) >= 3), None)
    return {"third_replica_asked_t_s": _after(asked, since),
            "third_replica_running_t_s": _after(third_running_at(samples, since), since)}


def _after(at: float | None, since: float) -> float | None:
    return None if at is None else round(at - since, 1)


def timeline(samples: list[dict[str, Any]], streams: list[tuple[str, float, StreamFate]],
             t0: float) -> list[dict[str, Any]]:
    """Each sample on the burst's clock, with the streams that arrived and were refused since
    the sample before and those playing at it."""
    rows, before = [], float("-inf")
    for sample in samples:
        at = sample["at"]
        arrived = [(phase, start, f) for phase, start, f in streams if before < start <= at]
        playing = sum(1 for _, start, f in streams if f.admitted and f.first_audio_s is not None
                      and start + f.first_audio_s <= at < start + f.first_audio_s + f.audio_s)
        rows.append({"t_s": round(at - t0, 1), **{k: v for k, v in sample.items() if k != "at"},
                     "arrived": len(arrived), "refused": sum(f.refused for _, _, f in arrived),
                     "playing": playing})
        before = at
    return rows


def realtime_while_node_started(streams: list[tuple[str, float, StreamFate]],
                                since: float | None, until: float | None) -> dict[str, Any]:
    """The real-time share of the admitted streams that played while the added node started
    (from the autoscaler's launch to the third replica running: its processes share this
    machine's cores with the running replicas) and of the others."""
    during, other = [], []
    for _, start, fate in streams:
        if not fate.admitted or fate.first_audio_s is None:
            continue
        begins = start + fate.first_audio_s
        overlaps = (since is not None and until is not None
                    and begins < until and begins + fate.audio_s > since)
        (during if overlaps else other).append(fate.realtime)
    return {"admitted_while_node_started": len(during),
            "realtime_share_while_node_started": sum(during) / len(during) if during else None,
            "admitted_otherwise": len(other),
            "realtime_share_otherwise": sum(other) / len(other) if other else None}


def scale_out(events: list[dict[str, Any]], since: float) -> dict[str, Any] | None:
    """The first GPU-like node launch Ray's autoscaler decided after ``since``."""
    return next((launch for launch in node_launches(events) if launch["decided_at"] >= since),
                None)


def acceptance(result: dict[str, Any]) -> dict[str, bool]:
    """The issue's checks, each true or false."""
    fill, overload = result["fill"], result["overload"]
    launch = result["scale_out"]
    return {
        "fill_more_than_one_replica_holds": result["fill_streams"] > max(
            result["capacity_idle"].values()),
        "fill_none_refused": fill["refused"] == 0 and fill["failed"] == 0
        and fill["admitted"] == result["fill_streams"],
        "fill_ran_on_both_replicas": all(
            result["fill_by_replica"].get(replica, 0) > 0 for replica in result["first_replicas"]),
        "burst_excess_refused": result["burst"]["refused"] > 0,
        "overload_none_failed": overload["failed"] == 0,
        "refusals_with_retry_after": overload["refusals_with_retry_after"] == overload["refused"],
        "admitted_realtime": (overload["admitted_realtime_share"] or 0.0) >= REALTIME_SHARE,
        "no_cut_after_first_byte": fill["cut_after_first_byte"] == 0
        and overload["cut_after_first_byte"] == 0,
        "node_launched_by_autoscaler": launch is not None and launch["node_up_s"] is not None,
        "new_node_replica_served": result["new_node_replica_streams"] > 0,
    }


def summarize(record: dict[str, Any], streams: list[tuple[str, float, StreamFate]],
              samples: list[dict[str, Any]], events: list[dict[str, Any]],
              placed: dict[str, str]) -> dict[str, Any]:
    """The run's figures from what :func:`fleet.overload_nodes.drive` recorded, every stream,
    the samples, the autoscaler's events and each stream's replica (the replicas' logs)."""
    burst_at = record["burst_at"]

    def fates(*phases: str) -> list[StreamFate]:
        return [fate for phase, _, fate in streams if phase in phases]

    first = record["first_replicas"]
    launch = scale_out(events, burst_at)
    nodes = record["replica_nodes_at_end_of_load"]
    new_on_launched = {replica for replica, node in nodes.items() if replica not in first
                       and launch is not None and node == launch["node_id"]}
    result = {
        "first_replicas": {replica: node[-5:] for replica, node in first.items()},
        "capacity_idle": record["capacity_idle"],
        "fill_streams": record["fill_streams"],
        "fill": phase_figures(fates(FILL)),
        "fill_by_replica": admitted_by_replica(fates(FILL), placed),
        "capacity_before_burst": record["capacity_before_burst"],
        "audio_s_per_stream": record["audio_s"],
        "held_s_per_stream": record["held_s"],
        "burst": phase_figures(fates(BURST)),
        "follow": phase_figures(fates(FOLLOW)),
        "overload": phase_figures(fates(BURST, FOLLOW)),
        "overload_by_replica": admitted_by_replica(fates(BURST, FOLLOW), placed),
        "new_node_replica_streams": sum(
            count for replica, count in admitted_by_replica(fates(BURST, FOLLOW), placed).items()
            if replica in new_on_launched),
        "scale_out": None if launch is None else {
            "node": (launch["node_id"] or "?")[-5:], "node_up_s": launch["node_up_s"],
            "decided_t_s": _after(launch["decided_at"], burst_at)},
        "third_replica_before_burst": any(
            sum((s.get("replicas") or {}).values()) >= 3 for s in samples if s["at"] < burst_at),
        **third_replica_times(samples, burst_at),
        "overload_realtime_by_node_start": realtime_while_node_started(
            [row for row in streams if row[0] in (BURST, FOLLOW)],
            launch["decided_at"] if launch else None, third_running_at(samples, burst_at)),
        "replicas_at_end_of_load": {replica: node[-5:] for replica, node in nodes.items()},
        "load_stopped_t_s": _after(record["load_stopped_at"], burst_at),
        "autoscaler_events": [{**{k: v for k, v in e.items() if k != "at"},
                               "t_s": _after(e["at"], burst_at)} for e in events
                              if e.get("node_id") != HEAD_NODE_ID],
        "timeline": timeline(samples, streams, burst_at),
    }
    result["acceptance"] = acceptance(result)
    return result
