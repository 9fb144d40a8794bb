"""Run Locust headless for a bounded time against a host; write CSV, HTML, summary JSON and PNG.

    scripts/loadtest --host http://127.0.0.1:8000 --duration 20 --users 4

Output (``--out``, default ``artifacts/loadtest/<timestamp>``): ``locust_stats.csv``,
``locust_stats_history.csv``, ``locust_failures.csv``, ``locust.html`` (Locust's own),
``requests.jsonl`` (one line per stream), ``summary.json`` and ``summary.png``. Exits 1 when the
run had no successful stream or its error rate exceeds ``--max-error-rate``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from loadtest import report

ROOT = Path(__file__).resolve().parents[1]
LOCUSTFILE = ROOT / "loadtest" / "locustfile.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/loadtest",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="http://127.0.0.1:8000")
    parser.add_argument("--duration", type=float, default=20.0,
                        help="seconds of load (default 20); streams still open then may finish "
                             "within --stop-timeout")
    parser.add_argument("--users", type=int, default=4, help="concurrent users (peak)")
    parser.add_argument("--spawn-rate", type=float, default=2.0, help="users started per second")
    parser.add_argument("--shape", choices=("constant", "ramp", "steps"), default="constant",
                        help="constant: --users at --spawn-rate; ramp or steps: the locustfile's "
                             "load shapes")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default artifacts/loadtest/<timestamp>)")
    parser.add_argument("--api-key", default=os.environ.get("LOADTEST_API_KEY"),
                        help="Bearer key (default: $LOADTEST_API_KEY)")
    parser.add_argument("--mix", default=None, help="text lengths, e.g. short=5,medium=3,long=1")
    parser.add_argument("--weights", default=None, help="tasks, e.g. openai=3,read=2,chat=1")
    parser.add_argument("--wait", default=None, help="think time between streams: min,max s")
    parser.add_argument("--stop-timeout", type=float, default=30.0,
                        help="seconds open streams may take to finish after the load stops")
    parser.add_argument("--ready-timeout", type=float, default=120.0,
                        help="seconds to wait for GET /readyz to answer 200 first")
    parser.add_argument("--max-error-rate", type=float, default=0.0,
                        help="exit 1 above this failed fraction (default 0)")
    return parser.parse_args(argv)


def wait_ready(host: str, timeout_s: float, headers: dict[str, str]) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{host}/readyz", headers=headers, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"loadtest: {host}/readyz not 200 within {timeout_s:.0f} s")
        time.sleep(0.5)


def run_locust(args: argparse.Namespace, out: Path) -> int:
    env = {**os.environ, "LOADTEST_RECORDS": str(out / "requests.jsonl")}
    for name, value in (("LOADTEST_API_KEY", args.api_key), ("LOADTEST_MIX", args.mix),
                        ("LOADTEST_WEIGHTS", args.weights), ("LOADTEST_WAIT_S", args.wait)):
        if value:
            env[name] = value
    # The shape times the run (see the locustfile), so no --run-time here.
    env["LOADTEST_SHAPE"] = args.shape
    env["LOADTEST_RUN_TIME_S"] = str(args.duration)
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
        "--host", args.host, "--users", str(args.users), "--spawn-rate", str(args.spawn_rate),
        "--stop-timeout", f"{round(args.stop_timeout)}s",
        "--csv", str(out / "locust"), "--csv-full-history", "--html", str(out / "locust.html"),
        "--only-summary", "--exit-code-on-error", "0",
        "--loglevel", "INFO", "--logfile", str(out / "locust.log"),
    ]
    # Bounded even if Locust hangs: load + drain + a minute for start-up and reports.
    limit_s = args.duration + args.stop_timeout + 60
    try:
        with (out / "locust.stdout").open("w") as log:
            return subprocess.run(command, cwd=ROOT, env=env, timeout=limit_s, stdout=log,
                                  stderr=subprocess.STDOUT, check=False).returncode
    except subprocess.TimeoutExpired:
        print(f"loadtest: locust ran past {limit_s:.0f} s and was stopped", file=sys.stderr)
        return 124


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    host = args.host.rstrip("/")
    out = args.out or ROOT / "artifacts" / "loadtest" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    (out / "requests.jsonl").unlink(missing_ok=True)
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    wait_ready(host, args.ready_timeout, headers)

    started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    load_before = os.getloadavg()[0]
    print(f"loadtest: {args.users} users ({args.shape}) for {args.duration:.0f} s on {host} "
          f"-> {out}", file=sys.stderr)
    exit_code = run_locust(args, out)
    records = report.load_records(out / "requests.jsonl")
    extra: dict[str, Any] = {
        "started_at": started_at, "shape": args.shape, "load_s": args.duration,
        "spawn_rate": args.spawn_rate, "locust_exit_code": exit_code,
        "cpu_count": os.cpu_count(),
        # The machine's 1-minute load average around the run: other work skews the numbers.
        "load_average_1m": {"before": round(load_before, 2),
                            "after": round(os.getloadavg()[0], 2)},
    }
    summary = report.summarize(records, host=host, users=args.users, extra=extra,
                               locust_failure_count=report.locust_failures(
                                   out / "locust_stats.csv"))
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    report.plot(records, out / "summary.png", history_csv=out / "locust_stats_history.csv",
                title=f"{host}: {args.users} users ({args.shape}), {args.duration:.0f} s")

    ttfb = summary.get("ttfb_ms", {})
    print(f"loadtest: {summary['requests']} streams, {summary['failures']} failed "
          f"(error rate {summary['error_rate']:.2%}), {summary.get('refused', 0)} refused "
          f"(503/429 with Retry-After), {summary['unfinished']} cut by the end; "
          f"{summary['requests_per_s']:.2f} req/s, "
          f"{summary['audio_seconds_per_s']:.2f} audio s/s; TTFB p50/p90/p99 "
          f"{ttfb.get('p50', float('nan')):.0f}/{ttfb.get('p90', float('nan')):.0f}/"
          f"{ttfb.get('p99', float('nan')):.0f} ms", file=sys.stderr)
    print(f"loadtest: wrote {out / 'summary.json'} and {out / 'summary.png'}", file=sys.stderr)
    if exit_code not in (0,) or summary.get("successes", 0) == 0 \
            or summary["error_rate"] > args.max_error_rate:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
