"""The whole service on a GPU, loaded by Locust, beside the engine alone on the same GPU.

    scripts/bench_serve --engine-results engine.json --out docs/benchmarks/served-h100.json

It starts ``serve_config.yaml`` as users run it (``serve run``), with the benchmark-only engine
setting (full-size random weights, every stream ``--audio-seconds`` long, chat answers
``--chat-tokens`` tokens) and the engine options ``bench/engine/run.py`` uses, on one
Synthesizer replica (one GPU); the CPU profile (``--config serve_config.cpu.yaml``) runs
without that setting, which is MiniCPM-o's: Piper speaks the text, its streams as long as it is.
Then, per mode and level, Locust (``loadtest/locustfile.py``,
``ScheduledListener``) replays the arrivals ``bench_engine.py`` uses: a burst of N streams, or
Poisson arrivals holding N streams (2N requests), on the native route (pcm), or with ``--sse``
on OpenAI's as server-sent events, with word times too with ``--word-timestamps``
(``scripts/bench_timestamps`` compares the two). Per level it records TTFB p50/p90/p99, the
share of streams that never ran dry, audio seconds per second, Locust's own summary, and the CPU
each deployment's processes used. The engine-alone numbers come from a ``bench_engine.py`` JSON
of the same machine (``--engine-results``); the output puts both side by side.

A long sweep may not fit one device command: ``--keep-running`` leaves the service up (in its
own session), a later call with ``--reuse`` measures against it, and ``--merge`` joins the parts.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from loadtest.report import load_records
from bench.served.served_logs import engine_busy, locust_summary, percentile, ttfb_breakdown
from harness.service import ROOT, replicas, start_service, stop_service

APP = "tts"
NATIVE_ROUTE = "/v1/speech/stream"
OPENAI_ROUTE = "/v1/audio/speech"
LOCUSTFILE = ROOT / "loadtest" / "locustfile.py"
READ_TEXT = ("Streaming speech synthesis turns text into audio while the text is still arriving. "
             "The weather today is sunny and warm, and I hope you have a wonderful day ahead.")
CHAT_TEXT = "Tell me something nice about the sea."
# The engine options bench_engine.py uses by default, so both runs build the same engine.
BENCH_ENGINE_OPTIONS = {"max_slots": 256, "max_chat_slots": 128, "max_queued": 4096,
                        "tts_max_positions": 1024, "llm_max_positions": 512,
                        "tts_sampling": "sample"}
REALTIME_SHARE = 0.99
# Single-stream TTFB: enough requests for a steady p50 (with 8, one lease measured chat's p50
# at 144.9 and 165.0 ms in two runs of the same code).
SINGLE_STREAM_REQUESTS = 20
SINGLE_STREAM_GAP_SHARE = 0.3
SINGLE_STREAM_GAP_MIN_S = 3.0
TTFB_P99_LIMIT_MS = 500.0


def parse_args(argv: list[str] | None = None, *, prog: str = "scripts/bench_serve",
               description: str | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog,
                                     description=description or __doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "serve_config.yaml")
    parser.add_argument("--config-engine-options", action="store_true",
                        help="keep --config's engine options (a deployment profile, e.g. "
                             "serve_config.a10g.yaml) instead of bench_engine.py's")
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
                        help="bench_engine.py's JSON from this machine, shown beside the served")
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


def _options(pairs: list[str]) -> dict[str, Any]:
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
    options.update(_options(args.engine_option))
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
    if slots and slots < top:  # bench_engine.py builds its engine with the top level's slots
        print(f"warning: engine max_slots {slots} < the top level {top}: above it streams "
              "queue for a slot; --engine-option max_slots=N measures the engine bench_engine.py "
              "builds", file=sys.stderr, flush=True)
    size_for_streams(config, top, args.cpus)
    overrides = _options(args.deployment_option)
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


def arrivals_s(level: int, arrival: str, audio_seconds: float,
               single_requests: int = SINGLE_STREAM_REQUESTS) -> list[float]:
    """bench_engine.py's arrivals: N at once, or Poisson holding about N streams (2N); or
    ``single``: ``single_requests`` requests one after another, each starting
    :data:`SINGLE_STREAM_GAP_SHARE` of the audio's length after the last (at least
    :data:`SINGLE_STREAM_GAP_MIN_S`): the engine generates a stream several times faster than
    real time (RTF about 0.1 for one stream), so the last one has finished and no two overlap
    (bench_engine.py's single-stream TTFB is likewise one stream at a time)."""
    if arrival == "single":
        gap_s = max(SINGLE_STREAM_GAP_MIN_S, audio_seconds * SINGLE_STREAM_GAP_SHARE)
        return [i * gap_s for i in range(single_requests)]
    if arrival == "burst":
        return [0.0] * level
    rng = random.Random(level)
    rate = level / (audio_seconds * 1.05)
    times, now = [], 0.0
    for _ in range(max(level * 2, 4)):
        times.append(now)
        now += rng.expovariate(rate)
    return times


class CpuMeter:
    """CPU seconds each deployment's replica processes, their engine processes, Ray's HAProxy
    and Serve's proxy used over a window."""

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self._started = time.monotonic()
        processes = self._processes()
        self._before = self._sample(processes)
        self._threads_before = self._engine_threads(processes)

    def _processes(self) -> dict[str, list[Any]]:
        found: dict[str, list[Any]] = {}
        for name, pid, _ in replicas(APP):
            process = self._psutil.Process(pid)
            found.setdefault(name, []).append(process)
            for child in process.children():  # the Synthesizer's engine process
                if "serve_app.gpu.engine_process" in " ".join(child.cmdline()):
                    found.setdefault(f"{name}Engine", []).append(child)
        for process in self._psutil.process_iter(["name", "cmdline"]):
            command = " ".join(process.info["cmdline"] or [])
            if "ProxyActor" in command:
                found.setdefault("ServeProxy", []).append(process)
            elif process.info["name"] == "haproxy":
                found.setdefault("HAProxy", []).append(process)
        return found

    def _sample(self, found: dict[str, list[Any]]) -> dict[int, tuple[str, float]]:
        sample = {}
        for name, processes in found.items():
            for process in processes:
                try:
                    times = process.cpu_times()
                except self._psutil.Error:
                    continue
                sample[process.pid] = (name, times.user + times.system)
        return sample

    def _engine_threads(self, found: dict[str, list[Any]]) -> dict[tuple[int, int], float]:
        """CPU seconds of each thread of the engine processes, by (process, thread) id."""
        sample = {}
        for name, processes in found.items():
            for process in processes if name.endswith("Engine") else ():
                try:
                    threads = process.threads()
                except self._psutil.Error:
                    continue
                for thread in threads:
                    sample[(process.pid, thread.id)] = thread.user_time + thread.system_time
        return sample

    def percent(self) -> dict[str, Any]:
        """Per deployment (or process kind), CPU as a percentage of one core over the window:
        ``sum`` over its processes, and its ``busiest_process``; and the engine processes'
        threads that ran, busiest first (the step thread, then the ones that may hold the GIL
        it waits for: the socket's reader and sender, the event loop, CUDA's and PyTorch's)."""
        processes = self._processes()
        after = self._sample(processes)
        threads_after = self._engine_threads(processes)
        wall = time.monotonic() - self._started
        used: dict[str, list[float]] = {}
        for pid, (name, seconds) in after.items():
            start = self._before.get(pid, (name, seconds))[1]
            used.setdefault(name, []).append(seconds - start)
        threads = sorted((round(100 * (seconds - self._threads_before.get(key, 0.0)) / wall, 1)
                          for key, seconds in threads_after.items()), reverse=True)
        return {"sum": {name: round(100 * sum(s) / wall, 1) for name, s in sorted(used.items())},
                "busiest_process": {name: round(100 * max(s) / wall, 1)
                                    for name, s in sorted(used.items())},
                "engine_threads": [share for share in threads if share > 0]}


def register_voices(base_url: str, count: int) -> dict[str, Any]:
    """``count`` cloned voices created through POST /v1/audio/voices from deterministic
    synthetic 5 s clips; their ids and how long each creation took (the clip's embedding)."""
    import soundfile

    from serve_app.engines.minicpmo.model.synthetic import synthetic_voice_clip

    ids, took_ms = [], []
    for index in range(count):
        clip = io.BytesIO()
        soundfile.write(clip, synthetic_voice_clip(index, seconds=5.0), 16_000, format="WAV")
        started = time.perf_counter()
        response = httpx.post(f"{base_url}/v1/audio/voices", headers=_auth_headers(), timeout=120,
                              data={"name": f"bench {index}", "consent": "true"},
                              files={"audio_sample": ("clip.wav", clip.getvalue(), "audio/wav")})
        response.raise_for_status()
        took_ms.append(round((time.perf_counter() - started) * 1000, 1))
        ids.append(response.json()["id"])
    # One short request per voice loads it into the Synthesizer's engine, as any first request
    # would; the levels then measure voices in use, and the first use is timed here.
    first_use_ms = [speak_once(base_url, {"text": "A voice's first words.", "voice": voice,
                                          "format": "pcm"}) for voice in ids]
    return {"voices": count, "clip_seconds": 5.0, "ids": ids, "create_ms": took_ms,
            "create_ms_p50": percentile(took_ms, 50),
            "first_request_ttfb_ms": first_use_ms}


def run_level(base_url: str, mode: str, level: int, arrival: str, args: argparse.Namespace,
              work: Path, voices: list[str] | None = None) -> dict[str, Any]:
    times = arrivals_s(level, arrival, args.audio_seconds, args.single_requests)
    users = len(times)
    # All users exist before the first arrival; a burst then starts together.
    t0 = time.time() + 3.0 + users / 200
    route, body, label = stream_request(mode, args)
    # Numbered in run order, so a repeated level gets files of its own.
    run = len(list(work.glob("*.schedule.json")))
    name = f"{run:02d}-{mode}-{arrival}-{level}" + (f"-{len(voices)}voices" if voices else "")
    meter = CpuMeter()
    log_offset = args.log.stat().st_size if args.log.exists() else 0
    started = time.monotonic()
    locust, rows = replay_schedule(base_url, work, name, t0, body, label, times,
                                   args.audio_seconds, voices=voices, csv=True, route=route)
    wall = time.monotonic() - started
    cpu = meter.percent()
    level_log = _read_from(args.log, log_offset)
    ok = [r for r in rows if r["ok"]]
    ttfbs = [r["ttfb_s"] * 1000 for r in ok if r["ttfb_s"] is not None]
    gaps = [r["longest_gap_s"] * 1000 for r in ok if r.get("longest_gap_s")]
    span = (max(r["start"] + r["total_s"] for r in rows) - min(r["start"] for r in rows)
            if rows else wall)
    result = {
        "mode": mode, "arrival": arrival, "concurrency": level, "voices": len(voices or []),
        "route": label,
        "requests": users,
        "completed": len(ok), "failures": len(rows) - len(ok) + (users - len(rows)),
        "ttfb_ms_p50": percentile(ttfbs, 50), "ttfb_ms_p90": percentile(ttfbs, 90),
        "ttfb_ms_p99": percentile(ttfbs, 99),
        # each stream's longest wait between two pieces of audio, as bench_engine.py's
        "longest_gap_ms_p50": percentile(gaps, 50), "longest_gap_ms_p99": percentile(gaps, 99),
        "realtime_share": round(sum(bool(r.get("realtime")) for r in rows) / users, 4),
        "audio_seconds_per_second": round(sum(r["audio_s"] for r in ok) / span, 2),
        "requests_per_s": round(users / span, 3),
        "cpu_percent_of_a_core": cpu["sum"],
        "cpu_percent_of_a_core_busiest_process": cpu["busiest_process"],
        "cpu_percent_of_a_core_engine_threads": cpu["engine_threads"],
        "engine_busy": engine_busy(level_log), "locust": locust_summary(work / f"{name}_stats.csv"),
        "ttfb_breakdown": ttfb_breakdown(level_log, rows),
        "errors": sorted({r["error"] for r in rows if r.get("error")})[:5],
        "locust_exit_code": locust.returncode,
    }
    if args.sse:  # the words each stream's events carried (none unless asked for)
        words = [r.get("words") or 0 for r in ok]
        result["streams_with_words"] = sum(count > 0 for count in words)
        result["words_per_stream_p50"] = percentile(words, 50)
    result["ok"] = bool(result["realtime_share"] >= REALTIME_SHARE
                        and (result["ttfb_ms_p99"] or 1e9) <= args.ttfb_p99_limit_ms)
    if locust.returncode not in (0, 1):
        result["locust_stderr"] = locust.stderr[-2000:]
    print(json.dumps({k: v for k, v in result.items() if k != "locust"}), flush=True)
    return result


def replay_schedule(base_url: str, work: Path, name: str, t0: float, body: dict[str, Any],
                    label: str, times: list[float], audio_seconds: float, *,
                    voices: list[str] | None = None, stop_timeout_s: int = 30,
                    timeout_margin_s: int = 120, csv: bool = False, route: str = NATIVE_ROUTE,
                    ) -> tuple[subprocess.CompletedProcess, list[dict[str, Any]]]:
    """Locust's ``ScheduledListener`` starts one stream of ``body`` to ``route`` (pcm at 24 kHz,
    as bytes or server-sent events) per arrival in ``times`` (seconds after the epoch ``t0``),
    its schedule and records in ``work`` as ``name``.*, and Locust's stats CSVs there too with
    ``csv``; Locust's exit and the per-stream records."""
    schedule = work / f"{name}.schedule.json"
    schedule.write_text(json.dumps({"t0": t0, "route": route, "body": body,
                                    "name": label, "format": "pcm", "sample_rate": 24000,
                                    "arrivals_s": times, "voices": voices or []}))
    records = work / f"{name}.jsonl"
    users = len(times)
    run_time_s = int(times[-1] + 3 * audio_seconds + 90)
    command = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "ScheduledListener",
               "--headless", "-u", str(users), "-r", str(max(users, 1)), "--host", base_url,
               "--run-time", f"{run_time_s}s", "--stop-timeout", str(stop_timeout_s),
               "--only-summary", *(["--csv", str(work / name)] if csv else []),
               "--loglevel", "WARNING"]
    env = {**os.environ, "LOADTEST_SCHEDULE": str(schedule), "LOADTEST_RECORDS": str(records)}
    locust = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=run_time_s + timeout_margin_s)
    return locust, load_records(records)


def refinement(sweep: list[dict[str, Any]], mode: str, step: int) -> list[int]:
    """The levels between ``mode``'s largest real-time Poisson level and the smallest failed
    one above it, ``step`` streams apart (to run upwards until one fails); none if no level
    failed above a passing one."""
    runs: dict[int, list[bool]] = {}
    for row in sweep:
        if row["mode"] == mode and row["arrival"] == "poisson":
            runs.setdefault(row["concurrency"], []).append(bool(row["ok"]))
    passed = [level for level, oks in runs.items() if all(oks)]
    if step <= 0 or not passed:
        return []
    best = max(passed)
    failed = [level for level, oks in runs.items() if level > best and not all(oks)]
    if not failed:
        return []
    return list(range(best + step, min(failed), step))


def stream_request(mode: str, args: argparse.Namespace) -> tuple[str, dict[str, Any], str]:
    """The route, body and Locust name of a level's streams: the native route (pcm, 24 kHz);
    with ``--sse`` OpenAI's as server-sent events (pcm, 24 kHz, the same text), asking for word
    times with ``--word-timestamps`` (the one difference between the two)."""
    if not args.sse:
        return NATIVE_ROUTE, {"text": READ_TEXT if mode == "read" else CHAT_TEXT, "mode": mode,
                              "format": "pcm", "sample_rate": 24000}, f"{NATIVE_ROUTE} {mode}"
    body = {"model": "tts-1", "voice": "alloy", "input": READ_TEXT, "response_format": "pcm",
            "stream_format": "sse"}
    if args.word_timestamps:
        body["timestamp_granularities"] = ["word"]
    return OPENAI_ROUTE, body, f"{OPENAI_ROUTE} sse" + (" words" if args.word_timestamps else "")


def speak_once(base_url: str, body: dict[str, Any], route: str = NATIVE_ROUTE) -> float:
    """One whole stream on ``route``; its time to first byte in ms."""
    started = time.perf_counter()
    ttfb_ms = 0.0
    with httpx.stream("POST", f"{base_url}{route}", json=body, timeout=300,
                      headers=_auth_headers()) as response:
        response.raise_for_status()
        for piece in response.iter_bytes():
            if piece and not ttfb_ms:
                ttfb_ms = round((time.perf_counter() - started) * 1000, 1)
    return ttfb_ms


def warm_up(base_url: str, mode: str, args: argparse.Namespace) -> None:
    """One unrecorded request per mode first, as the levels will make it, as bench_engine.py
    warms each mode: the first call through each deployment handle sets up its router and
    connections. (Cloned voices are primed by :func:`register_voices`.)"""
    route, body, _ = stream_request(mode, args)
    speak_once(base_url, body, route)


def _auth_headers() -> dict[str, str]:
    key = os.environ.get("LOADTEST_API_KEY")
    return {"authorization": f"Bearer {key}"} if key else {}


def _read_from(path: Path, offset: int) -> str:
    """What the service logged since ``offset`` (its lines reach the log a little late, so it
    waits 2 s first); nothing, at once, when there is no log (a service this run did not start,
    ``--reuse``, that logs elsewhere)."""
    if not path.exists():
        return ""
    time.sleep(2.0)
    with path.open("rb") as log:
        log.seek(offset)
        return log.read().decode("utf-8", "replace")


def single_stream_voices(sweep: list[dict[str, Any]]) -> dict[str, Any]:
    """Single-stream TTFB p50 in the default voice and in the cloned ones, per mode."""
    out = {}
    for mode in sorted({r["mode"] for r in sweep}):
        ones = [r for r in sweep if r["mode"] == mode and r["concurrency"] == 1]
        default = [r["ttfb_ms_p50"] for r in ones if not r.get("voices")]
        cloned = [r["ttfb_ms_p50"] for r in ones if r.get("voices")]
        out[mode] = {"ttfb_ms_default_voice": default[0] if default else None,
                     "ttfb_ms_cloned_voice": cloned[0] if cloned else None}
    return out


def headline(sweep: list[dict[str, Any]]) -> dict[str, Any]:
    """What bench_engine.py reports: single-stream TTFB (default voice) and the largest
    real-time level."""
    single, best = {}, {}
    for mode in sorted({r["mode"] for r in sweep}):
        ones = [r for r in sweep if r["mode"] == mode and r["concurrency"] == 1
                and not r.get("voices")] or [r for r in sweep if r["mode"] == mode
                                             and r["concurrency"] == 1]
        single[mode] = {"ttfb_ms_p50": ones[0]["ttfb_ms_p50"] if ones else None,
                        "ttfb_ms_p90": ones[0].get("ttfb_ms_p90") if ones else None}
        # A level counts only if every run of it passed (repeats too), as in bench_engine.py.
        runs: dict[int, list[bool]] = {}
        for r in sweep:
            if r["mode"] == mode and r["arrival"] in ("poisson", "single"):
                runs.setdefault(r["concurrency"], []).append(bool(r["ok"]))
        ok = [level for level, passed in runs.items() if all(passed)]
        best[mode] = max(ok) if ok else 0
    return {"single_stream": single, "max_realtime_streams": best}


def compare(result: dict[str, Any]) -> None:
    """Served against engine, per mode, with the acceptance bars of the served-path issue."""
    engine, served = result.get("engine"), result["served"]
    if not engine:
        return
    comparison = {}
    for mode in served["single_stream"]:
        engine_ttfb = engine["single_stream"].get(mode, {}).get("ttfb_ms_p50")
        served_ttfb = served["single_stream"][mode]["ttfb_ms_p50"]
        engine_best = engine["max_realtime_streams"].get(mode, 0)
        served_best = served["max_realtime_streams"].get(mode, 0)
        delta = (served_ttfb - engine_ttfb) if engine_ttfb and served_ttfb else None
        ratio = served_best / engine_best if engine_best else None
        comparison[mode] = {
            "single_stream_ttfb_p50_ms": {"engine": engine_ttfb, "served": served_ttfb,
                                          "served_minus_engine": delta,
                                          "within_20_ms": delta is not None and delta <= 20},
            "max_realtime_streams": {"engine": engine_best, "served": served_best,
                                     "served_over_engine": ratio,
                                     "at_least_95_percent": ratio is not None and ratio >= 0.95}}
    result["comparison"] = comparison


def engine_part(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    data = json.loads(path.read_text())
    return {"single_stream": data["single_stream"],
            "max_realtime_streams": data["max_realtime_streams"], "sweep": data["sweep"],
            "command": data.get("command"), "git_commit": data.get("git_commit"),
            "gpu": data.get("gpu")}


def replica_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment variables ``--env`` gives the app's replicas."""
    return dict(pair.split("=", 1) for pair in args.env)


def event_loop(env: dict[str, str]) -> str:
    """The event loop Ray gives the service's replicas here: ``uvloop <version>`` where it is
    installed and not switched off (``RAY_USE_UVLOOP=0`` here or in ``env``, the
    replicas' ``--env``), else ``asyncio``."""
    try:
        import uvloop
    except ImportError:
        return "asyncio"
    setting = env.get("RAY_USE_UVLOOP", os.environ.get("RAY_USE_UVLOOP", "1"))
    if setting.lower() in ("0", "false"):
        return "asyncio"
    return f"uvloop {uvloop.__version__}"


def gpu_name() -> str:
    try:
        return subprocess.check_output(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                       text=True).splitlines()[0].strip()
    except (OSError, subprocess.CalledProcessError):
        return "cpu"


def git_commit() -> str:
    if os.environ.get("BENCH_GIT_COMMIT"):
        return os.environ["BENCH_GIT_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    if len({p["gpu"] for p in parts}) != 1 or len({p["git_commit"] for p in parts}) != 1:
        raise SystemExit("refusing to merge runs of different GPUs or commits")
    merged = dict(parts[0])
    merged["command"] = [p["command"] for p in parts]
    sweep = [row for p in parts for row in p["served"]["sweep"]]
    merged["served"] = {**headline(sweep), "sweep": sweep}
    engines = [p["engine"] for p in parts if p.get("engine")]
    merged["engine"] = engines[0] if engines else None
    compare(merged)
    return merged


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted(result["served"]["single_stream"])
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.5), squeeze=False)
    for axis, mode in zip(axes[0], modes):
        for label, part, style in (("engine", result.get("engine"), "--"),
                                   ("served", result["served"], "-")):
            rows = [r for r in (part or {}).get("sweep", [])
                    if r["mode"] == mode and r.get("ttfb_ms_p99")]
            for arrival in sorted({r["arrival"] for r in rows}):  # Poisson, burst: what ran
                level = [r for r in rows if r["arrival"] == arrival]
                for q in ("p50", "p99"):
                    axis.plot([r["concurrency"] for r in level],
                              [r[f"ttfb_ms_{q}"] for r in level], style, marker="o",
                              label=f"{label} {arrival} TTFB {q}")
        axis.axhline(TTFB_P99_LIMIT_MS, color="grey", linestyle=":")
        axis.set(xscale="log", yscale="log", xlabel="concurrent streams",
                 ylabel="TTFB (ms)", title=f"{mode}: engine alone vs Serve + HTTP ({result['gpu']})")
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


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


def run_sweep(base_url: str, args: argparse.Namespace, work: Path,
              voices: list[str] | None = None) -> list[dict[str, Any]]:
    """Every mode's levels on the service at ``base_url``, one row per level and arrival:
    single streams first, then the larger levels, then the refinement."""
    levels = levels_by_mode(args)
    sweep: list[dict[str, Any]] = []
    # Single streams of every mode first, on a service that has carried no load yet.
    for mode in args.modes:
        warm_up(base_url, mode, args)
        if 1 in levels[mode]:
            if voices:  # single stream in the default voice too
                sweep.append(run_level(base_url, mode, 1, "single", args, work))
            sweep.append(run_level(base_url, mode, 1, "single", args, work, voices))
    for mode in args.modes:
        for level in [level for level in levels[mode] if level > 1]:
            rows = [run_level(base_url, mode, level, arrival, args, work, voices)
                    for arrival in args.arrivals]
            sweep.extend(rows)
            if any((r["ttfb_ms_p99"] or 1e9) > args.stop_after_ttfb_ms for r in rows
                   if r["arrival"] == "poisson"):
                break
        for level in refinement(sweep, mode, args.refine_step):
            sweep.append(run_level(base_url, mode, level, "poisson", args, work, voices))
            if not sweep[-1]["ok"]:
                break
    return sweep


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
