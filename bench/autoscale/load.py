"""The autoscaling benchmark's load: a schedule of offered streams (a ramp up to a peak, an optional
plateau on the way, a hold, a ramp down, a low tail), the Poisson arrivals that follow it, and
Locust replaying them."""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

from bench.served.arrivals import READ_TEXT, replay_schedule


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


def run_load(base_url: str, times: list[float], args: argparse.Namespace, work: Path
             ) -> tuple[list[dict[str, Any]], float]:
    """Locust replays ``times``; returns its per-stream records and the load's start (epoch)."""
    t0 = time.time() + 5.0 + len(times) / 400
    body = {"text": READ_TEXT, "mode": "read", "format": "pcm", "sample_rate": 24000}
    _, rows = replay_schedule(base_url, work, "autoscale", t0, body, "/v1/speech/stream read",
                              times, args.audio_seconds, stop_timeout_s=60, timeout_margin_s=180)
    return rows, t0
