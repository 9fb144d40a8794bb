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
import math
import os
import random
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.served.run import (
    READ_TEXT,
    bench_config,
    git_commit,
    gpu_name,
    parse_args as bench_serve_args,
    percentile,
    replay_schedule,
)
from fleet.cluster_demo import replica_states
from bench.autoscale.gpu_meter import gpu_readings
from harness.service import ROOT, start_service, stop_service

WINDOW_S = 5.0
GPU_EVERY_S = 5.0  # NVML readings of every GPU, this often
POLICY = "serve_app.gpu.autoscaling:EngineQueuePolicy"
TTFB_RANGES_RULE = (
    "A stream counts in the range in which its request was sent (its start on the load's "
    "clock, s), wherever its first byte came; the timeline's 5 s windows too. before_scale_out: "
    "from 0 to scale_out_decision_t_s (the controller's upscale log line; no decision: the whole "
    "run); during_scale_up: from the decision to second_replica_ready_t_s (the first poll of "
    "Serve's status, about every second, that saw 2 RUNNING replicas); after_ready: from then to "
    "the end of the hold at peak_streams (the schedule's 'peak' stage), so it holds streams sent "
    "while the first replica still carried the slower streams it had started before; "
    "at_peak_after_ready: the hold at peak_streams from when 2 replicas were ready. "
    "ttfb_ms_p99_before_scale_out, _during_scale_up and _after_ready are these ranges' p99.")


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


def load_stages(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The load's schedule: stages of linear change in offered streams, back to back from 0 s.

    Ramp up from 0 to ``peak_streams`` over ``ramp_up_s``; with a plateau (``plateau_streams``
    for ``plateau_s``, optional: namespaces from older runs have none) the ramp pauses there and
    then goes on at the same slope; ``hold_s`` at the peak, ``ramp_down_s`` to ``low_streams``,
    ``low_s`` there."""
    peak, low = args.peak_streams, args.low_streams
    plateau = getattr(args, "plateau_streams", 0) or 0
    plateau_s = getattr(args, "plateau_s", 0.0) or 0.0
    if plateau_s > 0 and 0 < plateau < peak:
        share = plateau / peak
        legs = [("ramp_up", 0, plateau, args.ramp_up_s * share),
                ("plateau", plateau, plateau, plateau_s),
                ("ramp_up", plateau, peak, args.ramp_up_s * (1 - share))]
    else:
        legs = [("ramp_up", 0, peak, args.ramp_up_s)]
    legs += [("peak", peak, peak, args.hold_s), ("ramp_down", peak, low, args.ramp_down_s),
             ("low", low, low, args.low_s)]
    stages, at = [], 0.0
    for name, start, end, seconds in legs:
        stages.append({"stage": name, "from_t_s": round(at, 3), "to_t_s": round(at + seconds, 3),
                       "from_streams": start, "to_streams": end})
        at += seconds
    return stages


def load_seconds(args: argparse.Namespace) -> float:
    """How long the load runs: the end of its last stage."""
    return load_stages(args)[-1]["to_t_s"]


def peak_span_s(args: argparse.Namespace) -> tuple[float, float]:
    """When the load holds ``peak_streams``: (start, end) on the load's clock."""
    [peak] = [s for s in load_stages(args) if s["stage"] == "peak"]
    return peak["from_t_s"], peak["to_t_s"]


def target_streams(t_s: float, args: argparse.Namespace) -> float:
    """The schedule (:func:`load_stages`): concurrent streams wanted ``t_s`` after the load
    starts."""
    for stage in load_stages(args):
        if t_s < stage["to_t_s"]:
            span = stage["to_t_s"] - stage["from_t_s"]
            share = (t_s - stage["from_t_s"]) / span if span > 0 else 1.0
            return stage["from_streams"] + (stage["to_streams"] - stage["from_streams"]) * share
    return args.low_streams


def arrivals_s(args: argparse.Namespace, seed: int = 0) -> list[float]:
    """Poisson arrivals whose rate holds :func:`target_streams` streams of
    ``--audio-seconds`` (Little's law), drawn by thinning."""
    rng = random.Random(seed)
    period = args.audio_seconds * 1.05
    peak_rate = max(args.peak_streams, args.low_streams) / period
    end = load_seconds(args)
    times, now = [], 0.0
    while True:
        now += rng.expovariate(peak_rate)
        if now >= end:
            return times
        if rng.random() < target_streams(now, args) / period / peak_rate:
            times.append(now)


class StatePoller:
    """Serve's view of the Synthesizer's replicas every second, and the engines' gauges."""

    def __init__(self, metrics_url: str | None) -> None:
        self.samples: list[dict[str, Any]] = []
        self.metrics_url = metrics_url
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.t0 = time.time()
        self._next_gpu_t_s = 0.0

    def start(self) -> StatePoller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            sample: dict[str, Any] = {"t_s": round(time.time() - self.t0, 1)}
            try:
                sample["states"] = replica_states()
            except Exception as exc:  # a slow controller must not end the record
                sample["error"] = type(exc).__name__
            sample.update(self._gauges())
            if sample["t_s"] >= self._next_gpu_t_s:
                sample["gpus"] = gpu_readings()
                self._next_gpu_t_s = sample["t_s"] + GPU_EVERY_S
            self.samples.append(sample)
            self._stop.wait(1.0)

    def _gauges(self) -> dict[str, Any]:
        if not self.metrics_url:
            return {}
        try:
            text = httpx.get(self.metrics_url, timeout=2).text
        except httpx.HTTPError:
            return {}
        return engine_gauges(text)


def engine_gauges(text: str) -> dict[str, Any]:
    """The engines' queue, streams in slots, slots and step counters from one metrics scrape:
    summed over the Synthesizer replicas, and per replica (Serve's ``replica`` label) with
    their cumulative steps and busy seconds (:func:`step_ms_by_replica` reads the step time)."""
    from prometheus_client.parser import text_string_to_metric_families

    from serve_app.observability.metrics import (
        ENGINE_ACTIVE_STREAMS,
        ENGINE_SLOTS,
        ENGINE_STEP_SECONDS_TOTAL,
        ENGINE_STEPS_TOTAL,
        QUEUED_REQUESTS,
    )

    # Ray exports the app's metrics with its "ray_" prefix.
    fields = {f"ray_{QUEUED_REQUESTS}": "queued", f"ray_{ENGINE_ACTIVE_STREAMS}": "active_streams",
              f"ray_{ENGINE_SLOTS}": "slots", f"ray_{ENGINE_STEPS_TOTAL}": "steps",
              f"ray_{ENGINE_STEP_SECONDS_TOTAL}": "step_seconds"}
    per_replica: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            field = fields.get(sample.name)
            if field is not None:
                replica = per_replica.setdefault(sample.labels.get("replica", ""),
                                                 dict.fromkeys(fields.values(), 0.0))
                replica[field] += sample.value
    for values in per_replica.values():
        values["slot_occupancy"] = round(values["active_streams"] / values["slots"], 3) \
            if values["slots"] else 0.0
    sums = {name: sum(r[name] for r in per_replica.values())
            for name in ("queued", "active_streams", "slots")}
    sums["slot_occupancy"] = round(sums["active_streams"] / sums["slots"], 3) \
        if sums["slots"] else 0.0
    return {**sums, "per_replica": per_replica}


def step_ms_by_replica(samples: list[dict[str, Any]], before_t_s: float) -> dict[str, float]:
    """Each replica's mean engine step (ms) over the last interval between two of its counter
    exports seen before ``before_t_s`` (Ray exports about every 10 s): busy seconds over steps
    run, what the policy's step budget reads (MiniCPM-o's budget: 5 frames, 106.7 ms)."""
    points: dict[str, list[tuple[float, float]]] = {}
    for sample in samples:
        if sample["t_s"] >= before_t_s:
            break
        for replica, values in (sample.get("per_replica") or {}).items():
            seen = points.setdefault(replica, [])
            point = (values.get("steps", 0.0), values.get("step_seconds", 0.0))
            if not seen or seen[-1] != point:
                seen.append(point)
    step_ms = {}
    for replica, seen in points.items():
        if len(seen) >= 2 and seen[-1][0] > seen[-2][0]:
            (steps_a, busy_a), (steps_b, busy_b) = seen[-2], seen[-1]
            step_ms[replica] = round(1000 * (busy_b - busy_a) / (steps_b - steps_a), 1)
    return step_ms


def metrics_url() -> str | None:
    import ray

    for node in ray.nodes():
        if node.get("Alive") and node.get("MetricsExportPort"):
            return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    return None


def run_load(base_url: str, times: list[float], args: argparse.Namespace, work: Path
             ) -> tuple[list[dict[str, Any]], float]:
    """Locust replays ``times``; returns its per-stream records and the load's start (epoch)."""
    t0 = time.time() + 5.0 + len(times) / 400
    body = {"text": READ_TEXT, "mode": "read", "format": "pcm", "sample_rate": 24000}
    _, rows = replay_schedule(base_url, work, "autoscale", t0, body, "/v1/speech/stream read",
                              times, args.audio_seconds, stop_timeout_s=60, timeout_margin_s=180)
    return rows, t0


SCALE_LINE = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) controller \d+ -- "
                        r"(Upscaling|Downscaling) Deployment\(name='Synthesizer'.*? from (\d+) "
                        r"to (\d+) replicas")


def scale_decisions(log_text: str, load_t0_s: float) -> list[dict[str, Any]]:
    """Serve controller's scaling decisions for the Synthesizer, on the load's clock."""
    decisions = []
    for match in SCALE_LINE.finditer(log_text):
        at = time.mktime(time.strptime(match[1], "%Y-%m-%d %H:%M:%S")) + int(match[2]) / 1000
        decisions.append({"t_s": round(at - load_t0_s, 1), "action": match[3].lower(),
                          "from": int(match[4]), "to": int(match[5])})
    return decisions


def summarize(rows: list[dict[str, Any]], samples: list[dict[str, Any]], load_t0_s: float,
              poll_t0: float, args: argparse.Namespace, log_text: str = "") -> dict[str, Any]:
    """The timeline in 5 s windows (on the load's clock), the failures and the scale events
    (the decisions from the controller's log, the replicas' states from Serve's status)."""
    offset = poll_t0 - load_t0_s  # poll time + offset = load time
    for sample in samples:
        sample["t_s"] = round(sample["t_s"] + offset, 1)
    cut = [r for r in rows if r.get("ok") and r.get("audio_s", 0) < 0.95 * args.audio_seconds]
    failed = [r for r in rows if not r.get("ok")]
    end = max([s["t_s"] for s in samples] + [0.0])
    # (start on the load's clock, TTFB ms) of every stream that had one
    ttfb_ms = [(r["start"] - load_t0_s, r["ttfb_s"] * 1000) for r in rows
               if r.get("ok") and r.get("ttfb_s")]

    def ttfbs_between(start: float, stop: float) -> list[float]:
        return [ms for at, ms in ttfb_ms if start <= at < stop]

    timeline = []
    for index in range(int(math.ceil(end / WINDOW_S)) + 1):
        low, high = index * WINDOW_S, (index + 1) * WINDOW_S
        window = [s for s in samples if low <= s["t_s"] < high]
        if not window:
            continue
        states: dict[str, int] = window[-1].get("states", {})
        starts = [r for r in rows if low <= r["start"] - load_t0_s < high]
        ttfbs = ttfbs_between(low, high)
        timeline.append({
            "t_s": low, "replicas": states.get("RUNNING", 0),
            "starting": states.get("STARTING", 0) + states.get("UPDATING", 0),
            "draining": states.get("STOPPING", 0), "target_streams": round(target_streams(low, args)),
            "queued": max((s.get("queued", 0.0) for s in window), default=0.0),
            "slot_occupancy": max((s.get("slot_occupancy", 0.0) for s in window), default=0.0),
            "streams_started": len(starts), "ttfb_ms_p50": percentile(ttfbs, 50),
            "ttfb_ms_p99": percentile(ttfbs, 99),
            "gpus": next((s["gpus"] for s in reversed(window) if s.get("gpus")), []),
            "per_replica": _per_replica_window(window, step_ms_by_replica(samples, high))})
    total = [s for s in samples if "states" in s]
    decisions = scale_decisions(log_text, load_t0_s)
    decided = next((d["t_s"] for d in decisions if d["action"] == "upscaling"),
                   next((s["t_s"] for s in total if sum(s["states"].values()) >= 2), None))
    ready = next((s["t_s"] for s in total if s["states"].get("RUNNING", 0) >= 2), None)
    back = next((s["t_s"] for s in total if ready is not None and s["t_s"] > ready
                 and s["states"].get("RUNNING", 0) == 1 and sum(s["states"].values()) == 1), None)

    def ttfb_range(start: float | None, stop: float | None) -> dict[str, Any]:
        """The streams that started in [start, stop) (stop None: to the end of the run)."""
        ttfbs = [] if start is None else ttfbs_between(start, stop if stop is not None else 1e9)
        return {"from_t_s": start, "to_t_s": stop, "streams": len(ttfbs),
                "ttfb_ms_p50": percentile(ttfbs, 50), "ttfb_ms_p99": percentile(ttfbs, 99)}

    peak_start, hold_end = peak_span_s(args)
    both_at_peak = max(ready, peak_start) if ready is not None and ready < hold_end else None
    ranges = {"before_scale_out": ttfb_range(0.0, decided),
              "during_scale_up": ttfb_range(decided, ready),
              "after_ready": ttfb_range(ready, hold_end),
              "at_peak_after_ready": ttfb_range(both_at_peak, hold_end)}
    peak = max((row["replicas"] for row in timeline), default=0)
    return {
        "replicas_timeline": timeline, "scale_decisions": decisions,
        "failed_streams": len(failed), "cut_streams": len(cut),
        "streams": len(rows), "errors": sorted({r.get("error") or "" for r in failed})[:5],
        "peak_replicas": peak, "replicas_went": _went(timeline),
        "scale_out_decision_t_s": decided, "second_replica_ready_t_s": ready,
        "second_replica_ready_s": round(ready - decided, 1) if ready is not None
        and decided is not None else None,
        "back_to_one_t_s": back,
        "ttfb_ms_p99_during_scale_up": ranges["during_scale_up"]["ttfb_ms_p99"],
        "ttfb_ms_p99_after_ready": ranges["after_ready"]["ttfb_ms_p99"],
        "ttfb_ms_p99_before_scale_out": ranges["before_scale_out"]["ttfb_ms_p99"],
        "ttfb_ranges": ranges, "ttfb_ranges_rule": TTFB_RANGES_RULE,
    }


def _per_replica_window(window: list[dict[str, Any]], step_ms: dict[str, float]
                        ) -> dict[str, dict[str, Any]]:
    """Per replica in a window: its largest slot occupancy and queue, and its step time."""
    replicas: dict[str, dict[str, Any]] = {}
    for sample in window:
        for replica, values in (sample.get("per_replica") or {}).items():
            row = replicas.setdefault(replica, {"slot_occupancy": 0.0, "active_streams": 0.0,
                                                "queued": 0.0})
            for name in row:
                row[name] = max(row[name], values.get(name, 0.0))
    for replica, row in replicas.items():
        row["step_ms"] = step_ms.get(replica)
    return replicas


def _went(timeline: list[dict[str, Any]]) -> list[int]:
    """The running replica counts in order, repeats folded: [1, 2, 1] for a full cycle."""
    went: list[int] = []
    for row in timeline:
        if row["replicas"] and (not went or went[-1] != row["replicas"]):
            went.append(row["replicas"])
    return went


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["replicas_timeline"]
    t = [r["t_s"] for r in rows]
    gpus = sorted({g["index"] for r in rows for g in r.get("gpus", [])})
    fig, axes = plt.subplots(3 if gpus else 2, 1, figsize=(10, 10 if gpus else 7), sharex=True)
    top, bottom = axes[0], axes[1]
    top.step(t, [r["replicas"] for r in rows], where="post", label="running replicas")
    top.step(t, [r["starting"] for r in rows], where="post", label="starting")
    top.set_ylabel("Synthesizer replicas")
    streams = top.twinx()
    streams.plot(t, [r["target_streams"] for r in rows], "k:", label="offered streams")
    streams.plot(t, [r["slot_occupancy"] * 100 for r in rows], "g--", label="slot occupancy %")
    streams.set_ylabel("streams / occupancy %")
    top.legend(loc="upper left")
    streams.legend(loc="upper right")
    for q, style in (("p50", "-"), ("p99", "-")):
        bottom.plot(t, [r[f"ttfb_ms_{q}"] for r in rows], style, marker=".", label=f"TTFB {q}")
    bottom.axhline(500, color="grey", linestyle=":")
    bottom.set(xlabel="seconds since the load started", ylabel="TTFB (ms)",
               title=f"{result['gpu']}: {result['policy']}")
    bottom.legend()
    if gpus:
        memory = axes[2].twinx()
        for index in gpus:
            readings = [(r["t_s"], g) for r in rows for g in r.get("gpus", [])
                        if g["index"] == index]
            axes[2].plot([t for t, _ in readings], [g["utilization_percent"] for _, g in readings],
                         label=f"GPU {index} utilization %")
            memory.plot([t for t, _ in readings], [g["memory_used_gib"] for _, g in readings],
                        "--", label=f"GPU {index} memory GiB")
        axes[2].set(xlabel="seconds since the load started", ylabel="utilization %")
        memory.set_ylabel("memory used (GiB)")
        axes[2].legend(loc="upper left")
        memory.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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
