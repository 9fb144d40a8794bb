"""Overload, served: goodput against offered load, admission by work beside admission by slots.

    scripts/bench_overload --out docs/benchmarks/overload-h200.json      # a GPU: serve_config.yaml
    scripts/bench_overload --config serve_config.cpu.yaml --capacity-read 4 \\
        --mixes read --out docs/benchmarks/overload-cpu.json            # the CPU profile

It starts the config as users run it (``serve run``; on a GPU with bench_serve's benchmark
setting: full-size random weights, every stream ``--audio-seconds`` long) once per admission
rule (``--admissions``: the engine option ``admission``), and offers each mix (read, chat, 3 read
: 1 chat) at each level (``--levels``, times the mix's capacity: ``--capacity-*`` streams held at
once) as Poisson arrivals over ``--window-s`` (``bench/overload/levels.py``), from
``--processes`` listener processes on the native route (``bench/overload/client.py``). With
``--sessions-x X`` it also opens WebSocket sessions at X times the read capacity (admission by
work only) and counts the sessions lost after ``session.started``. It writes each level's
figures (``levels``, and ``slots_levels`` for admission by slots) and a plot of goodput against
offered load.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from bench.overload.client import offer
from bench.overload.levels import (
    LEVELS_X,
    MIXES,
    StreamFate,
    arrivals,
    level_schedules,
    summarize,
)
from bench.served.config import bench_config
from bench.served.config import parse_args as serve_args
from bench.served.crossings import crossing_legs, gc_pauses
from bench.served.measure import CpuMeter, read_from
from bench.served.report import gpu_name
from bench.served.served_logs import percentile, ttfb_breakdown
from harness.service import ROOT, git_commit, start_service, stop_service

# Per mix, the bars the acceptance names (at 2x and 3x, against the same rule's 1x).
GOODPUT_SHARE = 0.9
REALTIME_SHARE = 0.99
REFUSAL_P99_MS = 100.0
# The Ingress's line for each request (serve_app/front/guard.py): its id and time with it.
REQUEST_DURATION = re.compile(r"request id=(\S+) .*?duration_ms=([\d.]+)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/bench_overload",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "serve_config.yaml")
    parser.add_argument("--admissions", nargs="+", default=["work", "slots"],
                        choices=["work", "slots"])
    parser.add_argument("--mixes", nargs="+", default=list(MIXES), choices=list(MIXES))
    parser.add_argument("--levels", nargs="+", type=float, default=list(LEVELS_X))
    parser.add_argument("--capacity-read", type=int, default=1024)
    parser.add_argument("--capacity-chat", type=int, default=256)
    parser.add_argument("--capacity-mixed", nargs=2, type=int, default=[384, 96],
                        metavar=("READ", "CHAT"))
    parser.add_argument("--window-s", type=float, default=8.0)
    parser.add_argument("--audio-seconds", type=float, default=10.0)
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--sessions-x", type=float, default=0.0,
                        help="also offer WebSocket sessions at this many times --capacity-read")
    parser.add_argument("--ttfb-p99-ms", type=float, default=500.0,
                        help="the admitted streams' TTFB bar (the CPU profile's: 2000)")
    parser.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--log", type=Path, default=Path("/tmp/bench-overload.log"))
    parser.add_argument("--engine-results", type=Path, default=None,
                        help="bench.overload.engine's JSON from this machine: the engine "
                             "alone, written beside the served levels")
    parser.add_argument("--merge", nargs="+", type=Path, default=None,
                        help="join these runs' JSONs (one per admission rule, from calls on the "
                             "same machine) into --out instead of measuring")
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args(argv)


def service_config(args: argparse.Namespace, admission: str) -> dict[str, Any]:
    """The config as shipped (its engine options kept), for the benchmark (bench_serve's
    setting, one Synthesizer replica, front sized for the largest capacity), this admission."""
    top = max(args.capacity_read, args.capacity_chat, sum(args.capacity_mixed))
    flags = ["--config", str(args.config), "--config-engine-options", "--port", str(args.port),
             "--modes", "read", "--read-levels", str(top),
             "--audio-seconds", str(args.audio_seconds), "--engine-option",
             f"admission={admission}"]
    for option in args.engine_option:
        flags += ["--engine-option", option]
    config = bench_config(serve_args(flags))
    if admission == "work":  # as build_app derives it: every stream the engine can hold
        [app] = config["applications"]
        for deployment in app.get("deployments", []):
            if deployment["name"] == "Synthesizer":
                deployment.pop("max_ongoing_requests", None)
    return config


def run_levels(args: argparse.Namespace, base_url: str) -> list[dict[str, Any]]:
    levels = []
    for mix, capacity, offered_x, schedule in level_schedules(args):
        log_offset = args.log.stat().st_size if args.log.exists() else 0
        meter = CpuMeter()
        fates = offer(base_url, schedule, args.processes)
        level = summarize(fates, mix, offered_x, args.window_s)
        level["capacity"] = capacity
        # CPU per deployment, and the whole machine's (the load generators' and Ray's too)
        level["cpu_percent_of_a_core"] = meter.percent()
        # where the admitted streams' first audio went: client, ingress, replica and engine,
        # from the service's log lines of the level (bench_serve's breakdown)
        log_text = read_from(args.log, log_offset)
        level["ttfb_breakdown"] = ttfb_breakdown(
            log_text, [{"ok": fate.admitted, "ttfb_s": fate.first_audio_s,
                        "request_id": fate.request_id} for fate in fates])
        level["refusal_breakdown"] = refusal_breakdown(log_text, fates)
        # the way between the Ingress and the Synthesizer, there and back, for the admitted
        # streams and the refusals apart; and each replica process's collector pauses
        level["crossings"] = {
            outcome: crossing_legs(log_text, {f.request_id for f in fates if pick(f)})
            for outcome, pick in (("admitted", lambda f: f.admitted),
                                  ("refused", lambda f: f.refused))}
        level["gc_pauses"] = gc_pauses(log_text)
        print(json.dumps({k: v for k, v in level.items() if k != "by_kind"}), flush=True)
        levels.append(level)
        time.sleep(2.0)  # the last streams' slots and work are given back
    return levels


def refusal_breakdown(log_text: str, fates: list[StreamFate]) -> dict[str, Any] | None:
    """Where the refusals' time went: p50 / p99 of the client's wait for its answer, of the
    Ingress replica's time with the request (its log line's duration_ms, by request id) and of
    the rest (the client, HAProxy and the connection)."""
    inside = {m[1]: float(m[2]) for m in REQUEST_DURATION.finditer(log_text)}
    joined = [(fate.answered_s * 1000, inside[fate.request_id]) for fate in fates
              if fate.refused and fate.answered_s is not None and fate.request_id in inside]
    if not joined:
        return None
    parts = {"client_ms": [c for c, _ in joined], "ingress_ms": [i for _, i in joined],
             "outside_ingress_ms": [c - i for c, i in joined]}
    return {"refusals": len(joined), **{name: {"p50": percentile(values, 50),
                                               "p99": percentile(values, 99)}
                                        for name, values in parts.items()}}


def run_sessions(args: argparse.Namespace, base_url: str) -> dict[str, Any]:
    """WebSocket sessions at ``--sessions-x`` x the read capacity: refused at session.start or
    served whole; a session accepted and then ended without ``response.done`` is lost."""
    schedule = [(at, "session") for at, _ in arrivals(
        "read", {"read": args.capacity_read}, args.sessions_x, args.window_s,
        args.audio_seconds, seed=7)]
    fates = offer(base_url, schedule, args.processes)
    level = summarize(fates, "sessions", args.sessions_x, args.window_s)
    level["sessions_lost_after_start"] = sum(f.status == 200 and not f.whole for f in fates)
    print(json.dumps({k: v for k, v in level.items() if k != "by_kind"}), flush=True)
    return level


def acceptance(levels: list[dict[str, Any]], slots: list[dict[str, Any]],
               ttfb_p99_ms: float) -> dict[str, Any]:
    """Per mix, the issue's bars at 2x and 3x, and 1x against slot admission's 1x."""
    out = {}
    for mix in sorted({level["mix"] for level in levels}):
        mine = {level["offered_x"]: level for level in levels if level["mix"] == mix}
        base = mine.get(1.0, {}).get("goodput_streams_per_s") or 0.0
        checks = {}
        for x in (2.0, 3.0):
            level = mine.get(x)
            if level is None:
                continue
            checks[f"{x:g}x"] = {
                "goodput_vs_1x": (level["goodput_streams_per_s"] / base) if base else None,
                "goodput_ok": bool(base and level["goodput_streams_per_s"]
                                   >= GOODPUT_SHARE * base),
                "realtime_ok": (level["admitted_realtime_share"] or 0) >= REALTIME_SHARE,
                "ttfb_ok": (level["admitted_ttfb_ms_p99"] or 1e9) <= ttfb_p99_ms,
                "refusals_ok": (level["refused"] == 0 or (
                    (level["refusal_ms_p99"] or 1e9) <= REFUSAL_P99_MS
                    and level["refusals_with_retry_after"] == level["refused"])),
                "no_cuts": level["cut_after_first_byte"] == 0}
        slot_1x = next((level["goodput_streams_per_s"] for level in slots
                        if level["mix"] == mix and level["offered_x"] == 1.0), None)
        checks["1x_vs_slots"] = (base / slot_1x) if slot_1x else None
        out[mix] = checks
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mixes = sorted({level["mix"] for level in result["levels"] + result["slots_levels"]})
    fig, axes = plt.subplots(1, len(mixes), figsize=(5 * len(mixes), 4), squeeze=False)
    for axis, mix in zip(axes[0], mixes):
        for key, label, style in (("levels", "admission by work", "o-"),
                                  ("slots_levels", "admission by slots", "s--")):
            rows = [level for level in result[key] if level["mix"] == mix]
            axis.plot([r["offered_x"] for r in rows], [r["goodput_streams_per_s"] for r in rows],
                      style, label=label)
        axis.set_title(f"{mix}")
        axis.set_xlabel("offered load (x capacity)")
        axis.set_ylabel("goodput (real-time streams / s)")
        axis.grid(alpha=0.3)
        axis.legend()
    fig.suptitle(f"Overload, served: {result['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def finish(result: dict[str, Any], args: argparse.Namespace) -> None:
    """The acceptance per mix, the engine alone beside it, the JSON and its plot."""
    result["acceptance"] = acceptance(result["levels"], result["slots_levels"], args.ttfb_p99_ms)
    if args.engine_results is not None:
        result["engine_alone"] = json.loads(args.engine_results.read_text())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps(result["acceptance"], indent=1))


def merged(paths: list[Path]) -> dict[str, Any]:
    """Runs joined, in order: the last's facts, every run's levels (each with its run's
    commit, or the one it already names: a merged file's; a later run's level of the same mix
    and load replaces an earlier one's) and the last run's sessions."""
    parts = [json.loads(path.read_text()) for path in paths]
    result = {**parts[-1], "merged_from": [f"{part['git_commit']}: {part['command']}"
                                          for part in parts]}
    for key in ("levels", "slots_levels"):
        joined: dict[tuple[str, float], dict[str, Any]] = {}
        for part in parts:
            for level in part.get(key, []):
                joined[(level["mix"], level["offered_x"])] = {
                    **level, "git_commit": level.get("git_commit", part["git_commit"])}
        result[key] = sorted(joined.values(), key=lambda level: (level["mix"], level["offered_x"]))
    for part in parts:
        if "sessions" in part:
            result["sessions"] = {**part["sessions"], "git_commit": part["sessions"].get(
                "git_commit", part["git_commit"])}
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        finish(merged(args.merge), args)
        return 0
    base_url = f"http://127.0.0.1:{args.port}"
    result: dict[str, Any] = {
        "gpu": gpu_name(), "command": "scripts/bench_overload " + " ".join(sys.argv[1:]),
        "git_commit": git_commit(), "config": str(args.config),
        "audio_seconds_per_stream": args.audio_seconds, "window_s": args.window_s,
        "capacity": {"read": args.capacity_read, "chat": args.capacity_chat,
                     "mixed": {"read": args.capacity_mixed[0], "chat": args.capacity_mixed[1]}},
        "levels": [], "slots_levels": []}
    for admission in args.admissions:
        process = start_service(service_config(args, admission), base_url, args.log)
        try:
            print(f"admission by {admission}", flush=True)
            levels = run_levels(args, base_url)
            result["levels" if admission == "work" else "slots_levels"] = levels
            if admission == "work" and args.sessions_x:
                result["sessions"] = run_sessions(args, base_url)
        finally:
            stop_service(process)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")  # each rule's part as it ends
    finish(result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
