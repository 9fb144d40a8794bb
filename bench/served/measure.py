"""One served level, measured: Locust's streams replayed against the service, the CPU each
deployment's processes used meanwhile, the service's own log lines of the level (the engine's
busy periods, each stream's TTFB hop by hop); the warm-up, cloned voices created over HTTP, and
the sweep over every mode's levels."""

from __future__ import annotations

import argparse
import io
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx

from bench.served.arrivals import NATIVE_ROUTE, arrivals_s, replay_schedule, stream_request
from bench.served.config import APP, levels_by_mode
from bench.served.report import REALTIME_SHARE
from bench.served.served_logs import engine_busy, locust_summary, percentile, ttfb_breakdown
from harness.service import replicas


class CpuMeter:
    """CPU seconds each deployment's replica processes, their engine processes, Ray's HAProxy
    and Serve's proxy used over a window."""

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self._started = time.monotonic()
        self._machine_before = psutil.cpu_times()
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

    def _machine_busy_cores(self, wall: float) -> dict[str, float]:
        """The whole machine over the window (load generators and Ray's own processes too):
        cores busy on average, of how many."""
        before, after = self._machine_before, self._psutil.cpu_times()
        idle = sum(getattr(after, f, 0.0) - getattr(before, f, 0.0) for f in ("idle", "iowait"))
        total = sum(after) - sum(before)
        cores = self._psutil.cpu_count() or 1
        return {"busy": round(cores * (1 - idle / total), 2) if total > 0 else 0.0,
                "of": cores}

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
                "machine_busy_cores": self._machine_busy_cores(wall),
                "processes": {name: len(s) for name, s in sorted(used.items())},
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
    level_log = read_from(args.log, log_offset)
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
        # each stream's longest wait between two pieces of audio, as the engine benchmark's
        "longest_gap_ms_p50": percentile(gaps, 50), "longest_gap_ms_p99": percentile(gaps, 99),
        "realtime_share": round(sum(bool(r.get("realtime")) for r in rows) / users, 4),
        "audio_seconds_per_second": round(sum(r["audio_s"] for r in ok) / span, 2),
        "requests_per_s": round(users / span, 3),
        "cpu_percent_of_a_core": cpu["sum"],
        "cpu_percent_of_a_core_busiest_process": cpu["busiest_process"],
        "cpu_percent_of_a_core_engine_threads": cpu["engine_threads"],
        "machine_busy_cores": cpu["machine_busy_cores"],
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
    """One unrecorded request per mode first, as the levels will make it, as the engine benchmark
    warms each mode: the first call through each deployment handle sets up its router and
    connections. (Cloned voices are primed by :func:`register_voices`.)"""
    route, body, _ = stream_request(mode, args)
    speak_once(base_url, body, route)


def _auth_headers() -> dict[str, str]:
    key = os.environ.get("LOADTEST_API_KEY")
    return {"authorization": f"Bearer {key}"} if key else {}


def read_from(path: Path, offset: int) -> str:
    """What the service logged since ``offset`` (its lines reach the log a little late, so it
    waits 2 s first); nothing, at once, when there is no log (a service this run did not start,
    ``--reuse``, that logs elsewhere)."""
    if not path.exists():
        return ""
    time.sleep(2.0)
    with path.open("rb") as log:
        log.seek(offset)
        return log.read().decode("utf-8", "replace")


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
