"""Synthesizer replicas scaling on the engine's own queue, under a Locust ramp, on real GPUs.

    scripts/bench_autoscale --gpus 2 --replica-gpus 1 --out docs/benchmarks/autoscale-2gpu.json

It starts ``serve_config.yaml`` as shipped (its autoscaling policy,
``serve_app.gpu.autoscaling:EngineQueuePolicy``) with the benchmark engine setting, the Synthesizer
at ``--replica-gpus`` GPUs per replica (two replicas share one GPU at 0.5, each engine capped to
``--gpu-memory-gb`` and ``--max-slots``), ``min_replicas`` 1 and ``max_replicas`` ``--max-replicas``,
and shorter delays than production (``--upscale-delay-s``, ``--downscale-delay-s``) so a whole
cycle fits one run. Locust (``ScheduledListener``) replays Poisson arrivals of fixed-length read
streams whose rate follows a schedule (:func:`load_stages`, written into the JSON): a ramp up to
``--peak-streams`` (past one replica's real-time load), held, then down to ``--low-streams``;
with ``--plateau-streams`` and ``--plateau-s`` the ramp pauses at that level for that long (a
load one replica still holds, where the policy can scale out before the ramp goes on to the
peak). A level of N streams is an arrival rate, N / (1.05 ``--audio-seconds``) per second,
bench_serve's read levels: the streams in engine slots are fewer while the engine runs faster
than real time. Every second it reads the replicas' states from Serve (starting, running,
stopping) and the engines' queue, slot occupancy and step counters from the metrics, summed and
per replica (the step time is what the policy's step budget reads); per 5 s window of stream
starts, TTFB p50/p99. It writes the timeline, failed and cut streams (ended before their audio
was complete), the time from the scale-out decision (a second replica appears) to it serving,
and TTFB p99 before the decision, during the scale-up and after the second replica is ready,
as JSON and a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.autoscale.load import arrivals_s, load_stages, run_load
from bench.autoscale.readings import StatePoller, metrics_url
from bench.autoscale.report import WINDOW_S, plot, summarize
from bench.served.config import bench_config
from bench.served.config import parse_args as bench_serve_args
from bench.served.report import gpu_name
from harness.service import ROOT, git_commit, start_service, stop_service
POLICY = "serve_app.gpu.autoscaling:EngineQueuePolicy"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/bench_autoscale",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=1, help="GPUs of this machine to use")
    parser.add_argument("--replica-gpus", type=float, default=0.5,
                        help="GPUs per Synthesizer replica (0.5: two replicas share a GPU)")
    parser.add_argument("--max-replicas", type=int, default=2)
    parser.add_argument("--gpu-memory-gb", type=float, default=38.0,
                        help="each engine's cap (0: none, for a replica per GPU)")
    parser.add_argument("--max-slots", type=int, default=160)
    parser.add_argument("--max-chat-slots", type=int, default=32)
    parser.add_argument("--peak-streams", type=int, default=240)
    parser.add_argument("--low-streams", type=int, default=4)
    parser.add_argument("--ramp-up-s", type=float, default=30.0,
                        help="seconds from 0 to --peak-streams, not counting a plateau")
    parser.add_argument("--plateau-streams", type=int, default=0,
                        help="the ramp up pauses at this level (0 < N < --peak-streams) ...")
    parser.add_argument("--plateau-s", type=float, default=0.0,
                        help="... for this long, then goes on at the same slope (0: no plateau)")
    parser.add_argument("--hold-s", type=float, default=180.0,
                        help="seconds at --peak-streams")
    parser.add_argument("--ramp-down-s", type=float, default=10.0)
    parser.add_argument("--low-s", type=float, default=100.0)
    parser.add_argument("--audio-seconds", type=float, default=10.0)
    parser.add_argument("--target-occupancy", type=float, default=0.75,
                        help="the policy's target slot occupancy (serve_config.yaml: 0.75)")
    parser.add_argument("--target-step-budget", type=float, default=0.6,
                        help="the policy's target step budget (serve_config.yaml: 0.6)")
    parser.add_argument("--upscale-delay-s", type=float, default=15.0)
    parser.add_argument("--downscale-delay-s", type=float, default=30.0)
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="real weights from this folder (e.g. the tests' tiny checkpoint "
                             "for a CPU smoke run) instead of random ones")
    parser.add_argument("--engine", default=None,
                        help="another engine (piper: a CPU smoke run of the script)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--log", type=Path, default=Path(tempfile.gettempdir()) / "bench-autoscale.log")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "autoscale-2gpu.json")
    args = parser.parse_args(argv)
    if (args.plateau_s > 0) != (args.plateau_streams > 0):
        parser.error("--plateau-streams and --plateau-s come together")
    if args.plateau_s > 0 and not 0 < args.plateau_streams < args.peak_streams:
        parser.error("--plateau-streams must be between 0 and --peak-streams")
    return args


def autoscale_config(args: argparse.Namespace) -> dict[str, Any]:
    """serve_config.yaml as bench_serve builds it (shipped engine options, benchmark setting),
    with the Synthesizer autoscaled by the shipped policy at this run's size and delays."""
    serve_args = ["--config-engine-options", "--modes", "read", "--read-levels",
                  str(args.peak_streams), "--port", str(args.port), "--cpus", str(args.cpus),
                  "--audio-seconds", str(args.audio_seconds),
                  "--engine-option", f"max_slots={args.max_slots}",
                  "--engine-option", f"max_chat_slots={args.max_chat_slots}"]
    if args.gpu_memory_gb:
        serve_args += ["--engine-option", f"gpu_memory_gb={args.gpu_memory_gb}"]
    if args.checkpoint is not None:
        serve_args += ["--checkpoint", str(args.checkpoint)]
    config = bench_config(bench_serve_args(serve_args))
    [app] = config["applications"]
    if args.engine is not None:
        app["args"]["engine"] = args.engine  # piper: its batch is the slots
        app["args"]["engine_options"] = {"max_batch_size": args.max_slots, "intra_op_threads": 1}
    for deployment in app["deployments"]:
        if deployment["name"] != "Synthesizer":
            continue
        deployment.pop("num_replicas", None)
        options = deployment.setdefault("ray_actor_options", {})
        if args.replica_gpus:
            options["num_gpus"] = args.replica_gpus
        else:
            options.pop("num_gpus", None)
        # a CPU smoke run (no GPUs) must fit two replicas beside the rest on a small machine
        options["num_cpus"] = min(options.get("num_cpus", 1), 1 if args.replica_gpus else 0.25)
        deployment["max_ongoing_requests"] = args.max_slots
        deployment["autoscaling_config"] = {
            "min_replicas": 1, "initial_replicas": 1, "max_replicas": args.max_replicas,
            "target_ongoing_requests": max(1, int(0.75 * args.max_slots)),
            "upscale_delay_s": args.upscale_delay_s, "downscale_delay_s": args.downscale_delay_s,
            "look_back_period_s": 10.0, "metrics_interval_s": 1.0,
            "policy": {"policy_function": POLICY,
                       "policy_kwargs": {"target_occupancy": args.target_occupancy,
                                         "target_step_budget": args.target_step_budget}}}
        deployment["graceful_shutdown_timeout_s"] = 120
    return config


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = autoscale_config(args)
    base_url = f"http://127.0.0.1:{args.port}"
    times = arrivals_s(args)
    service = start_service(config, base_url, args.log, ready_timeout_s=900)
    work = Path(tempfile.mkdtemp(prefix="bench-autoscale-"))
    try:
        import ray

        ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
        poller = StatePoller(metrics_url()).start()
        rows, load_t0 = run_load(base_url, times, args, work)
        time.sleep(2 * WINDOW_S)
        poller.stop()
        # Written before the service stops: a run cut short in its teardown keeps its result.
        result = {"gpu": gpu_name(), "gpus": args.gpus, "replica_gpus": args.replica_gpus,
                  "git_commit": git_commit(), "policy": POLICY,
                  "command": " ".join(["scripts/bench_autoscale", *sys.argv[1:]]),
                  "load": {k: getattr(args, k) for k in (
                      "peak_streams", "low_streams", "ramp_up_s", "plateau_streams",
                      "plateau_s", "hold_s", "ramp_down_s", "low_s", "audio_seconds",
                      "max_slots", "gpu_memory_gb", "upscale_delay_s", "downscale_delay_s")},
                  "schedule": load_stages(args),
                  "served_config": config,
                  **summarize(rows, poller.samples, load_t0, poller.t0, args,
                              args.log.read_text(errors="replace") if args.log.exists() else ""),
                  "raw_samples": poller.samples}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}", flush=True)
        plot(result, args.out.with_suffix(".png"))  # before the teardown too, for the same reason
    finally:
        stop_service(service)
    print(json.dumps({k: v for k, v in result.items()
                      if k not in ("replicas_timeline", "served_config", "raw_samples")}, indent=2))
    return 0
if __name__ == "__main__":
    raise SystemExit(main())
