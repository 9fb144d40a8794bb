"""What word timestamps cost the served path: the same levels streamed as server-sent events
without them, with them, and without them again, on one service.

    scripts/bench_timestamps --config serve_config.cpu.yaml --read-levels 1 3 6 \\
        --audio-seconds 8.8 --ttfb-p99-limit-ms 2000 --single-requests 10 --rounds 2 \\
        --out docs/benchmarks/timestamps-cpu.json                 # the CPU profile (Piper)
    scripts/bench_timestamps --config-engine-options --read-levels 1 736 \\
        --single-requests 10 --out timestamps-h100.json           # a GPU, serve_config.yaml

The service is ``scripts/bench_serve``'s (``serve run`` of ``--config``, started once; every
option not listed here is bench_serve's and means what it means there). Each arm runs
bench_serve's levels of read streams over ``POST /v1/audio/speech`` with ``stream_format: sse``
and pcm: single streams (level 1), then Poisson arrivals (``--arrivals``, Poisson unless given)
at each other level. The arms differ in one thing, ``timestamp_granularities: ["word"]``, and
measure each level in the order off, on, off (``--rounds N``: off, then on, off N times, so
every on run has an off run on each side) before the next level: the off runs show how much the
numbers move with nothing changed (the machine's load, the service's warm-up), which is the
noise the on runs are judged against. Every arm measures every level (no refinement, no early
stop), so their rows line up.

TTFB is the time to the first event that carries audio. ``cost`` holds, for single-stream TTFB
p50 and the maximum real-time streams (bench_serve's rule), and per level for TTFB p50 / p99 and
the real-time share: each run's value, the means of the off and on runs, on minus off, the noise
(the off runs' spread, max - min), and ``within_noise``: ``|on - off| <= noise``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.served.arrivals import stream_request
from bench.served.config import bench_config
from bench.served.config import parse_args as served_args
from bench.served.measure import register_voices, run_level, warm_up
from bench.served.report import REALTIME_SHARE, gpu_name
from bench.served.report import headline as served_headline
from harness.service import ROOT, git_commit, start_service, stop_service

NOISE_RULE = ("noise = max - min of the off runs (run before the first on run and after each, "
              "nothing changed between them); within_noise: |mean(on runs) - mean(off runs)| "
              "<= noise")
LEVEL_FIELDS = ("ttfb_ms_p50", "ttfb_ms_p99", "realtime_share")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Path | None]:
    """bench_serve's options, read only, as server-sent events, every level measured; and the
    output path."""
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--out", type=Path, default=None)
    own.add_argument("--rounds", type=int, default=1)
    mine, rest = own.parse_known_args(argv)
    # Defaults first (the caller's own come after and win), then what every arm must be.
    args = served_args(
        ["--arrivals", "poisson", *rest, "--modes", "read", "--sse", "--refine-step", "0",
         "--stop-after-ttfb-ms", "inf"], prog="scripts/bench_timestamps",
        description=__doc__.split("\n\n")[0] + " Options: scripts/bench_serve's, --out and "
                                                 "--rounds N (off, then on, off N times; 1).")
    if args.word_timestamps or args.merge or args.write_config or mine.rounds < 1:
        raise SystemExit("scripts/bench_timestamps: --word-timestamps, --merge and "
                         "--write-config are bench_serve's alone (the arms set timestamps); "
                         "--rounds is at least 1")
    args.rounds = mine.rounds
    return args, mine.out


def arm_order(rounds: int) -> list[tuple[str, bool]]:
    """(name, word timestamps) of each arm in run order: off, then on and off ``rounds`` times."""
    return [("off", False)] + [("on", True), ("off", False)] * rounds


def arm_args(args: argparse.Namespace, word_timestamps: bool) -> argparse.Namespace:
    arm = copy.copy(args)
    arm.word_timestamps = word_timestamps
    return arm


def level_row(row: dict[str, Any]) -> dict[str, Any]:
    """A level as bench_serve measured it, less Locust's own summary (the records say it)."""
    return {key: value for key, value in row.items() if key != "locust"}


def run_arms(base_url: str, args: argparse.Namespace, voices: list[str] | None
             ) -> list[dict[str, Any]]:
    """Every arm at each level in turn (off, on, off, ...), then the next level: runs compared
    at a level are at most minutes apart, so the machine's load drifts less between them than
    over whole sweeps."""
    work = Path(tempfile.mkdtemp(prefix="bench-timestamps-"))
    arms: list[dict[str, Any]] = []
    for name, words in arm_order(args.rounds):
        route, body, label = stream_request("read", arm_args(args, words))
        arms.append({"arm": name, "run": sum(arm["arm"] == name for arm in arms) + 1,
                     "word_timestamps": words, "route": route, "label": label,
                     "body": {key: value for key, value in body.items() if key != "input"},
                     "levels": []})
    for words in (False, True):  # one unrecorded request as each arm makes them
        warm_up(base_url, "read", arm_args(args, words))
    for level in sorted(set(args.read_levels)):
        for arrival in ["single"] if level == 1 else args.arrivals:
            for arm in arms:
                print(f"level {level} {arrival}: {arm['arm']} {arm['run']} ({arm['label']})",
                      flush=True)
                load = os.getloadavg()[0]
                row = run_level(base_url, "read", level, arrival,
                                arm_args(args, arm["word_timestamps"]), work, voices)
                arm["levels"].append({**level_row(row), "load_average_1m_before": round(load, 2)})
    for arm in arms:
        headline = served_headline(arm["levels"])
        arm["single_stream"] = headline["single_stream"].get("read", {"ttfb_ms_p50": None})
        arm["max_realtime_streams"] = headline["max_realtime_streams"].get("read", 0)
    return arms


def compared(off: list[float | None], on: list[float | None]) -> dict[str, Any]:
    """Each run's value, on minus off (their means), and whether that difference is within the
    off runs' own spread (:data:`NOISE_RULE`)."""
    if any(value is None for value in [*off, *on]):
        return {"off_runs": off, "on_runs": on, "within_noise": None}
    off_mean, on_mean = sum(off) / len(off), sum(on) / len(on)
    noise = max(off) - min(off)
    return {"off_runs": off, "on_runs": on, "off_mean": round(off_mean, 4),
            "on_mean": round(on_mean, 4), "on_minus_off": round(on_mean - off_mean, 4),
            "noise": round(noise, 4), "within_noise": abs(on_mean - off_mean) <= noise}


def cost(arms: list[dict[str, Any]]) -> dict[str, Any]:
    """What turning word timestamps on changed, against the noise of the off runs."""
    off = [arm for arm in arms if arm["arm"] == "off"]
    on = [arm for arm in arms if arm["arm"] == "on"]
    levels = []
    for row in on[0]["levels"]:
        key = (row["concurrency"], row["arrival"])
        rows = {name: [[r for r in arm["levels"] if (r["concurrency"], r["arrival"]) == key]
                       for arm in runs] for name, runs in (("off", off), ("on", on))}
        if not all(found for runs in rows.values() for found in runs):
            continue
        levels.append({"concurrency": row["concurrency"], "arrival": row["arrival"],
                       **{field: compared([found[0][field] for found in rows["off"]],
                                          [found[0][field] for found in rows["on"]])
                          for field in LEVEL_FIELDS}})
    return {
        "noise_rule": NOISE_RULE,
        "single_stream_ttfb_ms_p50": compared(
            [arm["single_stream"]["ttfb_ms_p50"] for arm in off],
            [arm["single_stream"]["ttfb_ms_p50"] for arm in on]),
        "max_realtime_streams": compared([arm["max_realtime_streams"] for arm in off],
                                         [arm["max_realtime_streams"] for arm in on]),
        "per_level": levels,
    }


def words_seen(arms: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether each arm got what it asked for: words on every completed stream of the on arm,
    on none of the off arms'."""
    seen = {}
    for arm in arms:
        completed = sum(row["completed"] for row in arm["levels"])
        with_words = sum(row.get("streams_with_words") or 0 for row in arm["levels"])
        seen[f"{arm['arm']} {arm['run']}"] = {"completed_streams": completed,
                                              "streams_with_words": with_words}
    seen["as_asked"] = all(
        value["streams_with_words"] == (value["completed_streams"] if name.startswith("on ")
                                        else 0) for name, value in seen.items())
    return seen


def machine() -> dict[str, Any]:
    cpu_model = None
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    return {"gpu": gpu_name(), "cpu_model": cpu_model, "cpu_count": os.cpu_count(),
            "arch": platform.machine()}


def main(argv: list[str] | None = None) -> int:
    args, out = parse_args(argv)
    base_url = f"http://127.0.0.1:{args.port}"
    config = bench_config(args)
    service = None if args.reuse else start_service(config, base_url, args.log,
                                                    ready_timeout_s=900)
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    registration = None
    try:
        registration = (register_voices(base_url, args.voices) if args.voices
                        else None)
        arms = run_arms(base_url, args, registration["ids"] if registration else None)
    finally:
        if service is not None and not args.keep_running:
            stop_service(service)
    device = machine()
    result = {
        "what": "word timestamps on and off, served: read streams as server-sent events "
                "(POST /v1/audio/speech, pcm), arms "
                f"{', '.join(name for name, _ in arm_order(args.rounds))} on one service",
        "git_commit": git_commit(),
        "command": " ".join(["scripts/bench_timestamps", *sys.argv[1:]]),
        "measured_at": started, "device": device, "config": config,
        "rule": f"a level is real-time when >= {REALTIME_SHARE:.0%} of its streams "
                f"never ran dry and p99 TTFB <= {args.ttfb_p99_limit_ms:g} ms; TTFB is "
                "the time to the first event with audio",
        "audio_seconds_per_request": args.audio_seconds, "voices": registration,
        "cost": cost(arms), "words": words_seen(arms), "arms": arms,
    }
    tag = device["gpu"].split()[1].lower() if len(device["gpu"].split()) > 1 else "cpu"
    out = out or ROOT / "docs" / "benchmarks" / f"timestamps-{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"cost": result["cost"], "words": result["words"]}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
