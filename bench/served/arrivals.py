"""A served level's streams and when they arrive: the texts and routes, the arrival times (a burst,
Poisson arrivals holding N streams, or single streams one after another), and Locust replaying
those arrivals (``loadtest/locustfile.py``, ``ScheduledListener``)."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from harness.service import ROOT
from loadtest.report import load_records
NATIVE_ROUTE = "/v1/speech/stream"
OPENAI_ROUTE = "/v1/audio/speech"
LOCUSTFILE = ROOT / "loadtest" / "locustfile.py"
READ_TEXT = ("Streaming speech synthesis turns text into audio while the text is still arriving. "
             "The weather today is sunny and warm, and I hope you have a wonderful day ahead.")
CHAT_TEXT = "Tell me something nice about the sea."
# Single-stream TTFB: enough requests for a steady p50 (with 8, one lease measured chat's p50
# at 144.9 and 165.0 ms in two runs of the same code).
SINGLE_STREAM_REQUESTS = 20
SINGLE_STREAM_GAP_SHARE = 0.3
SINGLE_STREAM_GAP_MIN_S = 3.0


def arrivals_s(level: int, arrival: str, audio_seconds: float,
               single_requests: int = SINGLE_STREAM_REQUESTS) -> list[float]:
    """The engine benchmark's arrivals: N at once, or Poisson holding about N streams (2N); or
    ``single``: ``single_requests`` requests one after another, each starting
    :data:`SINGLE_STREAM_GAP_SHARE` of the audio's length after the last (at least
    :data:`SINGLE_STREAM_GAP_MIN_S`): the engine generates a stream several times faster than
    real time (RTF about 0.1 for one stream), so the last one has finished and no two overlap
    (the engine benchmark's single-stream TTFB is likewise one stream at a time)."""
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
