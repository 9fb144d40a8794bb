"""The whole service on a GPU, loaded by Locust, beside the engine alone on the same GPU.

    scripts/bench_serve --engine-results engine.json --out docs/benchmarks/served-h100.json

It starts ``serve_config.yaml`` as users run it (``serve run``), with the benchmark-only engine
setting (full-size random weights, every stream ``--audio-seconds`` long, chat answers
``--chat-tokens`` tokens) and the engine options the engine benchmark (``bench/engine/``) uses,
on one Synthesizer replica (one GPU); the CPU profile (``--config serve_config.cpu.yaml``) runs
without that setting, which is MiniCPM-o's: Piper speaks the text, its streams as long as it is
(``config.py``). Then, per mode and level, Locust (``loadtest/locustfile.py``,
``ScheduledListener``) replays the engine benchmark's arrivals (``arrivals.py``): a burst of N
streams, or Poisson arrivals holding N streams (2N requests), on the native route (pcm), or with
``--sse`` on OpenAI's as server-sent events, with word times too with ``--word-timestamps``
(``scripts/bench_timestamps`` compares the two). Per level it records TTFB p50/p90/p99, the
share of streams that never ran dry, audio seconds per second, Locust's own summary, and the CPU
each deployment's processes used (``measure.py``). The engine-alone numbers come from an engine
benchmark JSON of the same machine (``--engine-results``); the output puts both side by side
(``report.py``).

A long sweep may not fit one device command: ``--keep-running`` leaves the service up (in its
own session), a later call with ``--reuse`` measures against it, and ``--merge`` joins the parts.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.served.config import bench_config, parse_args, replica_env
from bench.served.measure import register_voices, run_sweep
from bench.served.report import (
    REALTIME_SHARE,
    compare,
    engine_part,
    event_loop,
    gpu_name,
    headline,
    merge,
    plot,
    single_stream_voices,
)
from harness.service import ROOT, git_commit, start_service, stop_service


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.write_config:
        args.write_config.write_text(yaml.safe_dump(bench_config(args), sort_keys=False))
        return 0
    if args.merge:
        result = merge([json.loads(p.read_text()) for p in args.merge])
    else:
        result = measure(args)
    gpu_tag = result["gpu"].split()[1].lower() if len(result["gpu"].split()) > 1 else "cpu"
    out = args.out or ROOT / "docs" / "benchmarks" / f"served-{gpu_tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    print(json.dumps({k: result.get(k) for k in ("gpu", "comparison")}, indent=2))
    print(f"wrote {out}")
    return 0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    base_url = f"http://127.0.0.1:{args.port}"
    config = bench_config(args)
    service = None
    if not args.reuse:
        service = start_service(config, base_url, args.log, ready_timeout_s=900)
    models = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"]
    sweep: list[dict[str, Any]] = []
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    registration = None
    try:
        registration = register_voices(base_url, args.voices) if args.voices else None
        sweep = run_sweep(base_url, args, work, registration["ids"] if registration else None)
    finally:
        if service is not None and not args.keep_running:
            stop_service(service)
    result: dict[str, Any] = {
        "gpu": gpu_name(), "git_commit": git_commit(),
        "command": " ".join(["scripts/bench_serve", *sys.argv[1:]]),
        "served_config": config, "benchmark_mode": models[0].get("benchmark_mode"),
        # the replicas' event loop: Ray runs them on uvloop when it is installed (the locked
        # requirements have it), else on asyncio's own loop
        "event_loop": event_loop(replica_env(args)),
        "audio_seconds_per_request": args.audio_seconds, "chat_tokens": args.chat_tokens,
        "rule": f"a level is real-time when >= {REALTIME_SHARE:.0%} of its streams never ran "
                f"dry and p99 TTFB <= {args.ttfb_p99_limit_ms:g} ms (Poisson arrivals)",
        "engine": engine_part(args.engine_results),
        "served": {**headline(sweep), "sweep": sweep},
    }
    if registration is not None:
        result["served"]["voice_registration"] = registration
        result["served"]["single_stream_voices"] = single_stream_voices(sweep)
    compare(result)
    return result
if __name__ == "__main__":
    raise SystemExit(main())
