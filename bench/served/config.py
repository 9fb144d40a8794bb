"""The served benchmark's options and the app it serves: the production config with the benchmark
engine setting and the engine benchmark's options (or the config's own), one Synthesizer
replica, and the stream caps and Ingress replicas raised to what the largest level needs on
this machine's CPUs."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from bench.served.arrivals import SINGLE_STREAM_REQUESTS
from bench.served.report import TTFB_P99_LIMIT_MS
from harness.service import ROOT

DESCRIPTION = "The whole service on a GPU, loaded by Locust, beside the engine alone on the same GPU."
APP = "tts"
# The engine options the engine benchmark uses by default, so both runs build the same engine.
BENCH_ENGINE_OPTIONS = {"max_slots": 256, "max_chat_slots": 128, "max_queued": 4096,
                        "tts_max_positions": 1024, "llm_max_positions": 512,
                        "tts_sampling": "sample"}


def parse_args(argv: list[str] | None = None, *, prog: str = "scripts/bench_serve",
               description: str | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog,
                                     description=description or DESCRIPTION)
    parser.add_argument("--config", type=Path, default=ROOT / "serve_config.yaml")
    parser.add_argument("--config-engine-options", action="store_true",
                        help="keep --config's engine options (a deployment profile, e.g. "
                             "serve_config.a10g.yaml) instead of the engine benchmark's")
    parser.add_argument("--modes", nargs="+", default=["read", "chat"])
    parser.add_argument("--read-levels", nargs="+", type=int, default=[1, 64, 128, 256])
    parser.add_argument("--chat-levels", nargs="+", type=int, default=[1, 32, 64, 128])
    parser.add_argument("--arrivals", nargs="+", default=["poisson", "burst"])
    parser.add_argument("--audio-seconds", type=float, default=10.0)
    parser.add_argument("--chat-tokens", type=int, default=40)
    parser.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                        help="engine option over the bench defaults (value parsed as YAML)")
    parser.add_argument("--deployment-option", action="append", default=[],
                        metavar="DEPLOYMENT.KEY=VALUE",
                        help="a deployment option over the config's, value parsed as YAML "
                             "(e.g. Synthesizer.max_ongoing_requests=512)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable for the app's replicas (runtime_env)")
    parser.add_argument("--tts-tokenizer", type=Path,
                        default=ROOT / "tests" / "golden" / "chattts_tokenizer")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="real weights from this folder instead of random ones (lengths "
                             "stay fixed); e.g. the tests' tiny checkpoint for a CPU smoke run")
    parser.add_argument("--engine-results", type=Path, default=None,
                        help="the engine benchmark's JSON from this machine, shown beside the served")
    parser.add_argument("--refine-step", type=int, default=32,
                        help="between a mode's largest real-time level and the next level "
                             "measured, try levels this many streams apart, upwards, until one "
                             "fails (0: off)")
    parser.add_argument("--single-requests", type=int, default=SINGLE_STREAM_REQUESTS,
                        help="requests of a single-stream level, one after another")
    parser.add_argument("--ttfb-p99-limit-ms", type=float, default=TTFB_P99_LIMIT_MS,
                        help="a level is real-time only with p99 TTFB at most this (the CPU "
                             "profile's first audio alone takes about 0.3-0.5 s)")
    parser.add_argument("--stop-after-ttfb-ms", type=float, default=1500.0,
                        help="skip a mode's larger levels once p99 TTFB passes this")
    parser.add_argument("--voices", type=int, default=0,
                        help="register this many cloned voices over HTTP (synthetic 5 s clips) "
                             "and spread every level's requests over them; level 1 also runs "
                             "in the default voice, for single-stream TTFB side by side")
    parser.add_argument("--sse", action="store_true",
                        help="stream over POST /v1/audio/speech as server-sent events (pcm, "
                             "read only) instead of the native route; TTFB is still the first "
                             "audio byte (the first event with audio)")
    parser.add_argument("--word-timestamps", action="store_true",
                        help="--sse, each stream asking timestamp_granularities [\"word\"]")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 1,
                        help="CPUs of the Ray cluster the service starts on (this machine's): "
                             "the Ingress replicas are sized to fit them")
    parser.add_argument("--reuse", action="store_true", help="measure the service already up")
    parser.add_argument("--keep-running", action="store_true", help="leave the service up")
    parser.add_argument("--log", type=Path, default=Path(tempfile.gettempdir()) / "bench-serve.log")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--write-config", type=Path, default=None,
                        help="write the benchmark serve config here and exit (for scripts/soak)")
    parser.add_argument("--merge", nargs="+", type=Path, default=None,
                        help="join result JSONs of one GPU and commit into --out, and exit")
    args = parser.parse_args(argv)
    args.sse = args.sse or args.word_timestamps
    if args.sse and "chat" in args.modes:
        parser.error("--sse and --word-timestamps stream OpenAI's route, which reads only: "
                     "--modes read")
    return args


def key_values(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs (``--engine-option``, ``--deployment-option``), each value read as
    YAML."""
    parsed = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        parsed[key.strip()] = yaml.safe_load(value)
    return parsed


def levels_by_mode(args: argparse.Namespace) -> dict[str, list[int]]:
    """The concurrency levels to measure, per mode."""
    return {"read": args.read_levels, "chat": args.chat_levels}


def bench_config(args: argparse.Namespace) -> dict[str, Any]:
    """The production config with the benchmark setting, the bench engine options (or, with
    ``--config-engine-options``, the config's own), this port, and one Synthesizer replica (one
    GPU here)."""
    config = yaml.safe_load(args.config.read_text(encoding="utf-8"))
    config["http_options"] = {**config.get("http_options", {}), "host": "127.0.0.1",
                              "port": args.port}
    [app] = config["applications"]
    app["name"] = APP
    options = app["args"].setdefault("engine_options", {})
    minicpmo = app["args"].get("engine", "piper") == "minicpmo"
    if minicpmo and not args.config_engine_options:
        options.update(BENCH_ENGINE_OPTIONS)
    options.update(key_values(args.engine_option))
    if minicpmo:  # the benchmark setting is MiniCPM-o's; Piper (CPU profile) speaks the text
        options["benchmark"] = {"random_weights": args.checkpoint is None,
                                "tts_tokenizer": str(args.tts_tokenizer),
                                "audio_seconds": args.audio_seconds,
                                "chat_tokens": args.chat_tokens}
    if args.checkpoint is not None:
        options["model"] = str(args.checkpoint.resolve())
    if args.env:
        env_vars = app.setdefault("runtime_env", {}).setdefault("env_vars", {})
        env_vars.update(replica_env(args))
    levels = levels_by_mode(args)
    top = max((level for mode in args.modes for level in levels.get(mode, [])), default=1)
    slots = options.get("max_slots", 0)
    if slots and slots < top:  # the engine benchmark builds its engine with the top level's slots
        print(f"warning: engine max_slots {slots} < the top level {top}: above it streams "
              "queue for a slot; --engine-option max_slots=N measures the engine that the engine benchmark "
              "builds", file=sys.stderr, flush=True)
    size_for_streams(config, top, args.cpus)
    overrides = key_values(args.deployment_option)
    for deployment in app.get("deployments", []):
        if deployment["name"] == "Synthesizer":
            deployment.pop("autoscaling_config", None)
            deployment["num_replicas"] = 1
        for key, value in overrides.items():
            name, _, option = key.partition(".")
            if name == deployment["name"]:
                deployment[option] = value
    return config
# Poisson arrivals that hold N streams on average hold more at times: the stream caps leave
# this much room above the largest level (a cap below it measures the cap, not the service).
STREAM_HEADROOM = 1.5
# Streams one Ingress replica fronts in a benchmark run: pcm (the benchmark's format) costs it a
# fraction of a core per hundred streams; mp3 would need a replica per ~24.
STREAMS_PER_INGRESS = 128


def size_for_streams(config: dict[str, Any], streams: int, cpus: int) -> None:
    """Raise the config's stream caps, where they are lower, to what ``streams`` concurrent
    streams on the one Synthesizer replica need, as a user serving that many would: the
    Synthesizer's ongoing requests (its engine's slots, exactly) and queue, and enough Ingress replicas
    from the start, fixed for the run (each fronts :data:`STREAMS_PER_INGRESS`; a replica
    started by the autoscaler mid-level would measure its start, not the service), each with
    a stream cap (``api.max_streams``) and ongoing requests for its share with headroom
    (HAProxy's leastconn spreads connections evenly, not exactly).

    The Ingress replicas must fit the machine's ``cpus`` beside the other deployments: where
    they would not, fewer replicas take more streams each (at 576 streams 14 one-CPU replicas
    left the engine no CPU on a 16-core machine, and Ray never placed the last ones)."""
    [app] = config["applications"]
    peak = int(streams * STREAM_HEADROOM)
    api = app["args"].setdefault("api", {})
    slots = app["args"].get("engine_options", {}).get("max_slots", 0)
    deployments = app.get("deployments", [])
    for deployment in deployments:
        if deployment["name"] == "Synthesizer":
            if slots:  # = the engine's slots, as in the shipped config
                deployment["max_ongoing_requests"] = slots
            deployment["max_queued_requests"] = max(deployment.get("max_queued_requests", 0),
                                                    peak)
    for deployment in deployments:
        if deployment["name"] != "Ingress":
            continue
        scaling = deployment.pop("autoscaling_config", None) or {}
        others = sum(replica_cpus(d) for d in deployments if d is not deployment)
        room = max(1, int((cpus - others) // replica_cpus(deployment)))
        wanted = max(scaling.get("min_replicas", 1), deployment.get("num_replicas", 1),
                     -(-peak // STREAMS_PER_INGRESS))
        deployment["num_replicas"] = min(wanted, room)
        share = -(-peak // deployment["num_replicas"])
        api["max_streams"] = max(api.get("max_streams", 0), 2 * share)
        deployment["max_ongoing_requests"] = max(deployment.get("max_ongoing_requests", 0),
                                                 api["max_streams"] + 64)


def replica_cpus(deployment: dict[str, Any]) -> float:
    """CPUs one replica of ``deployment`` reserves (Ray's default: 1)."""
    return float(deployment.get("ray_actor_options", {}).get("num_cpus", 1))


def replica_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment variables ``--env`` gives the app's replicas."""
    return dict(pair.split("=", 1) for pair in args.env)
