"""Served capacity as Synthesizer replicas are added: ``bench_serve`` runs of one machine and
commit, each with the Synthesizer fixed at its own replica count, joined into one file.

    scripts/bench_serve --config-engine-options --modes read --read-levels 1 704 736 \\
        --arrivals poisson --refine-step 0 --out one.json
    scripts/bench_serve --config-engine-options --modes read --read-levels 1408 1472 \\
        --arrivals poisson --refine-step 0 \\
        --deployment-option Synthesizer.num_replicas=2 --out two.json
    python3 -m bench.served.replica_capacity one.json two.json --gpus 2 \\
        --engine-results engine.json --out docs/benchmarks/served-2gpu.json

It writes the largest real-time level per replica count (``max_realtime_streams``, keyed
``one_replica``, ``two_replicas``, ...), their ratio, every run's sweep rows (each row with its
``replicas``), the CPU each process kind used at each count's largest real-time level, and
from that the front's size per 1000 streams: the cores its Ingress replicas and HAProxy used,
and the Ingress replicas that takes at :data:`INGRESS_CORE_TARGET` of a core each.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from bench.served.report import engine_part

COUNT_WORDS = {1: "one_replica", 2: "two_replicas", 3: "three_replicas", 4: "four_replicas"}
# An Ingress replica reserves one CPU (serve_config.yaml); sized to run at this share of it, as
# its autoscaling target (target_ongoing_requests) aims for at mp3.
INGRESS_CORE_TARGET = 0.8
# The front's processes: the Ingress replicas and Ray's HAProxy in front of them.
FRONT_PROCESSES = ("Ingress", "HAProxy")


def synthesizer_replicas(run: dict[str, Any]) -> int:
    """The Synthesizer's fixed replica count in a bench_serve run's served config."""
    [app] = run["served_config"]["applications"]
    [synthesizer] = [d for d in app["deployments"] if d["name"] == "Synthesizer"]
    return int(synthesizer.get("num_replicas", 1))


def top_passing_row(run: dict[str, Any]) -> dict[str, Any] | None:
    """The sweep row of the run's largest real-time Poisson level."""
    best = run["served"]["max_realtime_streams"].get("read", 0)
    rows = [r for r in run["served"]["sweep"]
            if r["mode"] == "read" and r["arrival"] == "poisson" and r["concurrency"] == best]
    return rows[-1] if rows else None


def front_per_1000_streams(row: dict[str, Any]) -> dict[str, Any]:
    """What the front used at ``row``'s level, scaled to 1000 streams."""
    used = row["cpu_percent_of_a_core"]
    cores = sum(used.get(name, 0.0) for name in FRONT_PROCESSES) / 100
    per_1000 = cores * 1000 / row["concurrency"]
    return {"streams": row["concurrency"], "front_cores": round(cores, 2),
            "front_cores_per_1000_streams": round(per_1000, 2),
            "ingress_replicas_per_1000_streams": math.ceil(per_1000 / INGRESS_CORE_TARGET),
            "format": "pcm 24 kHz (no encoding: mp3 costs about 33 ms of CPU per audio second)"}


def join(runs: list[dict[str, Any]], gpus: int,
         engine: dict[str, Any] | None = None) -> dict[str, Any]:
    if len({r["gpu"] for r in runs}) != 1 or len({r["git_commit"] for r in runs}) != 1:
        raise SystemExit("refusing to join runs of different GPUs or commits")
    by_count = {synthesizer_replicas(run): run for run in runs}
    if len(by_count) != len(runs):
        raise SystemExit("two runs have the same replica count")
    best = {COUNT_WORDS.get(n, f"{n}_replicas"): run["served"]["max_realtime_streams"].get("read", 0)
            for n, run in sorted(by_count.items())}
    sweep, cpu, front = [], {}, {}
    for count, run in sorted(by_count.items()):
        sweep += [{**row, "replicas": count} for row in run["served"]["sweep"]]
        row = top_passing_row(run)
        if row is not None:
            cpu[COUNT_WORDS.get(count, f"{count}_replicas")] = {
                "streams": row["concurrency"], "percent_of_a_core": row["cpu_percent_of_a_core"],
                "busiest_process": row["cpu_percent_of_a_core_busiest_process"]}
            front[COUNT_WORDS.get(count, f"{count}_replicas")] = front_per_1000_streams(row)
    one, most = by_count.get(1), max(by_count)
    ratio = None
    if one is not None and most > 1:
        base = one["served"]["max_realtime_streams"].get("read", 0)
        top = by_count[most]["served"]["max_realtime_streams"].get("read", 0)
        ratio = round(top / base, 3) if base else None
    return {"gpu": runs[0]["gpu"], "gpus": gpus, "git_commit": runs[0]["git_commit"],
            "commands": [run["command"] for _, run in sorted(by_count.items())],
            "rule": runs[0]["rule"], "max_realtime_streams": best,
            f"{COUNT_WORDS.get(most, f'{most}_replicas')}_over_one_replica": ratio,
            "cpu_per_process": cpu, "front_sizing": front,
            # one GPU's engine alone in the same lease, beside the served figures
            "engine_one_gpu": engine, "sweep": sweep}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m bench.served.replica_capacity",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="bench_serve JSONs, one per count")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs of the machine they ran on")
    parser.add_argument("--engine-results", type=Path, default=None,
                        help="bench_engine.py's JSON from one GPU of the same machine")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    result = join([json.loads(path.read_text()) for path in args.runs], args.gpus,
                  engine_part(args.engine_results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "sweep"}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
