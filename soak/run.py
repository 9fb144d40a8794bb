"""Soak: mixed load with random disconnects, bad requests, overload bursts and one replica crash.

Runs its own ``serve run`` of the CPU profile (``serve_config.cpu.yaml`` as it is, deployments and
all, plus an API key and the engine's fault injection) on a fresh local Ray cluster, bound to
127.0.0.1 only, for a given time; then stops it and writes a JSON report: requests accepted, completed, errored, lost (must be 0), client disconnects, status
codes, 5xx inside and outside the crash window, refusals, TTFB, and each replica's memory through
the run with its trend after the warm-up (``soak/memory.py``).

Every ``--burst-every-s`` a burst of ``--burst-size`` long streams starts at once, beyond what the
CPU profile admits: admission by work refuses some (*refused*: a 503 JSON with ``Retry-After``
and code ``overloaded``, before any audio). A refusal is neither an error nor a loss.

    scripts/soak --duration-s 600 --out docs/soak-cpu.json    (or: python -m soak.run ...)

A request is *accepted* when its 200 headers arrive; it then ends *completed* (the whole body, a
valid stream of its format), *errored* (the chunked body cut short: the service's explicit
mid-stream error), *disconnected* (the soak itself hung up, on purpose) or *lost* (no end within
the client's read timeout, or a completed body that is not valid audio).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from harness.service import git_commit, replicas, start_service, stop_service
from soak.memory import MemorySampler
from soak.payloads import BAD_REQUESTS, SENTENCES, speech_request, valid_audio
from soak.tally import Tally

ROOT = Path(__file__).resolve().parent.parent
APP = "soak"
API_KEY = "soak-key"
CRASH_TEXT = "SOAK-CRASH-NOW"
READ_TIMEOUT_S = 90.0
RECOVERY_GRACE_S = 10.0
def soak_config(config_path: Path, port: int) -> dict[str, Any]:
    """The profile's serve config, renamed, on ``port``, with a key and the crash switch."""
    config = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    config["http_options"] = {**config.get("http_options", {}), "host": "127.0.0.1",
                              "port": port}
    [app] = config["applications"]
    app["name"] = APP
    args = app["args"]
    args["engine_options"] = {**args.get("engine_options", {}),
                              "fault_injection": {"crash_process_text": CRASH_TEXT}}
    args["api"] = {**args.get("api", {}), "api_key": API_KEY}
    return config


def synthesizer_pids() -> list[int]:
    return sorted(pid for name, pid, _ in replicas(APP) if name == "Synthesizer")


def is_refusal(response: httpx.Response) -> bool:
    """Admission's refusal: 503, ``Retry-After``, a JSON error whose code is ``overloaded``."""
    if response.status_code != 503 or "retry-after" not in response.headers:
        return False
    try:
        error = response.json().get("error")
    except ValueError:
        return False
    return isinstance(error, dict) and error.get("code") == "overloaded"


def one_speech(client: httpx.Client, tally: Tally, rng: random.Random, disconnect: bool,
               text_override: str | None = None, burst: bool = False) -> bool:
    path, body, audio_format = speech_request(rng)
    if text_override is not None:
        body = {"text": text_override, "format": "pcm"}
        path, audio_format = "/v1/speech/stream", "pcm"
    started_s = time.monotonic()
    tally.add("requests_sent")
    accepted = False
    data = b""
    try:
        with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                response.read()
                refused = is_refusal(response)
                tally.status(response.status_code, refusal=refused)
                kind = ("refused" if refused else
                        "rejected_5xx" if response.status_code >= 500 else "rejected_4xx")
                tally.add(kind)
                if burst:
                    tally.add(f"burst_{kind}")
                elif refused:  # a worker waits as told, as a client would
                    time.sleep(min(float(response.headers["retry-after"] or 1), 5.0))
                if not response.headers.get("content-type", "").startswith("application/json"):
                    tally.add("non_json_errors")
                return refused
            tally.status(200)
            accepted = True
            tally.add("accepted")
            if burst:
                tally.add("burst_accepted")
            for piece in response.iter_raw():
                if not data:
                    with tally.lock:
                        tally.ttfb_s.append(time.monotonic() - started_s)
                data += piece
                if disconnect:
                    tally.add("client_disconnects")
                    return False
    except httpx.TimeoutException:
        tally.add("lost" if accepted else "timeouts_before_headers")
        with tally.lock:
            tally.lost_examples.append({"path": path, "at_s": round(tally.now(), 1)})
        return False
    except httpx.HTTPError:
        tally.add("errored" if accepted else "connection_errors")
        if accepted:
            tally.errored(path)
        return False
    if valid_audio(data, audio_format):
        tally.add("completed")
        with tally.lock:
            if (tally.crash_sent_at_s is not None and tally.recovered_at_s is None
                    and started_s - tally.started_s > tally.crash_sent_at_s):
                tally.recovered_at_s = tally.now()
    else:
        tally.add("lost")
        with tally.lock:
            tally.lost_examples.append({"path": path, "format": audio_format,
                                        "bytes": len(data), "at_s": round(tally.now(), 1)})
    return False


def one_bad(client: httpx.Client, tally: Tally, rng: random.Random) -> None:
    """A bad request: a 4xx, or, while the service is full, admission's refusal. The front's
    own checks come before any refusal for load, but text only the engine can judge (Piper's
    "nothing this voice can speak" for "...") is judged once there is room, after the replica's
    room check: under load its answer is the refusal (``bad_request_refused``)."""
    path, kwargs = rng.choice(BAD_REQUESTS)
    tally.add("requests_sent")
    tally.add("bad_requests_sent")
    response = client.post(path, **kwargs)
    refused = is_refusal(response)
    tally.status(response.status_code, refusal=refused)
    if response.status_code < 400:
        tally.add("bad_request_accepted")
    elif refused:
        tally.add("bad_request_refused")
    else:
        tally.add("rejected_5xx" if response.status_code >= 500 else "rejected_4xx")
    if not response.headers.get("content-type", "").startswith("application/json"):
        tally.add("non_json_errors")


def load_goes_on(deadline_s: float, tally: Tally) -> bool:
    """Until ``deadline_s``; past it, while the service has not recovered from the crash sent
    (at most :data:`READ_TIMEOUT_S` more), so a short run still sees the recovery."""
    now = time.monotonic()
    return now < deadline_s or (now < deadline_s + READ_TIMEOUT_S and tally.awaiting_recovery())


def worker(base_url: str, deadline_s: float, tally: Tally, seed: int) -> None:
    rng = random.Random(seed)
    timeout = httpx.Timeout(10.0, read=READ_TIMEOUT_S)
    with httpx.Client(base_url=base_url, timeout=timeout,
                      headers={"authorization": f"Bearer {API_KEY}"}) as client:
        first = True  # each worker hangs up on its first stream: a short run has some too
        while load_goes_on(deadline_s, tally):
            roll = rng.random()
            try:
                if first:
                    first = False
                    one_speech(client, tally, rng, disconnect=True)
                elif roll < 0.55:
                    one_speech(client, tally, rng, disconnect=False)
                elif roll < 0.70:
                    one_speech(client, tally, rng, disconnect=True)
                elif roll < 0.90:
                    one_bad(client, tally, rng)
                else:
                    tally.add("requests_sent")
                    response = client.get(rng.choice(["/v1/models", "/v1/voices", "/healthz"]))
                    tally.status(response.status_code)
            except httpx.HTTPError:
                tally.add("connection_errors")


def burster(base_url: str, deadline_s: float, tally: Tally, every_s: float, size: int,
            seed: int) -> None:
    """Every ``every_s`` seconds (the first half that in), ``size`` long pcm streams at once,
    each on a connection of its own; a quarter hang up after their first audio."""
    rng = random.Random(seed)
    long_text = " ".join(SENTENCES)
    timeout = httpx.Timeout(10.0, read=READ_TIMEOUT_S)
    next_s = time.monotonic() + every_s / 2
    streams: list[threading.Thread] = []
    while next_s < deadline_s:
        time.sleep(max(0.0, next_s - time.monotonic()))
        next_s += every_s
        tally.add("bursts")

        def stream(disconnect: bool, stream_seed: int) -> None:
            with httpx.Client(base_url=base_url, timeout=timeout,
                              headers={"authorization": f"Bearer {API_KEY}"}) as client:
                try:
                    tally.add("burst_streams_sent")
                    one_speech(client, tally, random.Random(stream_seed), disconnect=disconnect,
                               text_override=long_text, burst=True)
                except httpx.HTTPError:
                    tally.add("connection_errors")
        burst = [threading.Thread(target=stream, args=(i % 4 == 0, rng.randrange(2**31)))
                 for i in range(size)]
        for thread in burst:  # on time, whether or not the last burst's streams have ended
            thread.start()
        streams += burst
    for thread in streams:
        thread.join(2 * READ_TIMEOUT_S)


CRASH_ATTEMPTS = 10  # the crash request, refused for load, is sent again this many times at most


def crasher(base_url: str, crash_at_s: float, tally: Tally) -> None:
    time.sleep(max(0.0, crash_at_s - tally.now()))
    with tally.lock:
        tally.crash_sent_at_s = tally.now()
    timeout = httpx.Timeout(10.0, read=READ_TIMEOUT_S)
    with httpx.Client(base_url=base_url, timeout=timeout,
                      headers={"authorization": f"Bearer {API_KEY}"}) as client:
        # refused for load, it is sent again after its Retry-After (one_speech waits), as a
        # client would: the crash must reach a replica
        for _ in range(CRASH_ATTEMPTS):
            if not one_speech(client, tally, random.Random(0), disconnect=False,
                              text_override=f"{CRASH_TEXT} " + " ".join(SENTENCES)):
                break


def run_load(base_url: str, duration_s: float, concurrency: int, crash_at_s: float | None,
             seed: int = 1, memory_every_s: float = 30.0, memory_warmup_s: float = 300.0,
             burst_every_s: float = 0.0, burst_size: int = 0) -> dict[str, Any]:
    """Drive the app at ``base_url`` (already deployed as ``APP``) and return the report."""
    pids_before = synthesizer_pids()
    tally = Tally()
    memory = MemorySampler(APP, tally.now, memory_every_s, memory_warmup_s)
    memory_start = memory.by_deployment(record=False)
    deadline_s = tally.started_s + duration_s
    threads = [threading.Thread(target=worker, args=(base_url, deadline_s, tally, seed + i))
               for i in range(concurrency)]
    if crash_at_s is not None:
        threads.append(threading.Thread(target=crasher, args=(base_url, crash_at_s, tally)))
    if burst_every_s > 0 and burst_size > 0:
        threads.append(threading.Thread(target=burster, args=(
            base_url, deadline_s, tally, burst_every_s, burst_size, seed + 10_000)))
    memory.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(duration_s + 3 * READ_TIMEOUT_S + 60)
    still_running = sum(thread.is_alive() for thread in threads)
    elapsed_s = tally.now()
    memory.stop()
    memory_end = memory.by_deployment()
    trend = memory.report()
    counts = tally.counts
    window = None
    if tally.crash_sent_at_s is not None:
        end = (tally.recovered_at_s if tally.recovered_at_s is not None else elapsed_s)
        window = [round(tally.crash_sent_at_s, 1), round(end + RECOVERY_GRACE_S, 1)]
    outside = [t for t in tally.server_errors_at_s
               if window is None or not window[0] <= t <= window[1]]
    ttfb = sorted(tally.ttfb_s)
    return {
        "profile": "cpu (serve_config.cpu.yaml, piper)", "git_commit": git_commit(),
        "duration_s": round(elapsed_s, 1),
        "concurrency": concurrency,
        "requests_sent": counts["requests_sent"],
        "accepted": counts["accepted"],
        "completed": counts["completed"],
        "errored": counts["errored"],
        "client_disconnects": counts["client_disconnects"],
        "lost": counts["lost"] + still_running,
        "ingress_rss_slope_mb_per_min": trend["ingress_rss_slope_mb_per_min"],
        "refused": counts["refused"],
        "bursts": {"every_s": burst_every_s, "size": burst_size, "count": counts["bursts"],
                   "streams_sent": counts["burst_streams_sent"],
                   "accepted": counts["burst_accepted"], "refused": counts["burst_refused"],
                   "rejected_5xx": counts["burst_rejected_5xx"]},
        "lost_examples": tally.lost_examples[:10],
        "errored_at": tally.errored_at[:20],  # when a stream was cut short, by which route
        "rejected_4xx": counts["rejected_4xx"],
        "rejected_5xx": counts["rejected_5xx"],
        "bad_requests_refused_for_load": counts["bad_request_refused"],
        "bad_requests_sent": counts["bad_requests_sent"],
        "bad_request_accepted": counts["bad_request_accepted"],
        "non_json_errors": counts["non_json_errors"],
        "timeouts_before_headers": counts["timeouts_before_headers"],
        "connection_errors": counts["connection_errors"],
        "status_codes": dict(sorted(tally.statuses.items())),
        "5xx_total": len(tally.server_errors_at_s),
        "5xx_outside_crash_window": len(outside),
        "crash": {"sent_at_s": tally.crash_sent_at_s and round(tally.crash_sent_at_s, 1),
                  "recovered_at_s": tally.recovered_at_s and round(tally.recovered_at_s, 1),
                  "window_s": window, "synthesizer_pids_before": pids_before,
                  "synthesizer_pids_after": synthesizer_pids()},
        "ttfb_ms": {"p50": round(1000 * statistics.median(ttfb), 1) if ttfb else None,
                    "p95": round(1000 * ttfb[int(0.95 * (len(ttfb) - 1))], 1) if ttfb else None},
        "memory_rss_mb": {"start": memory_start, "end": memory_end,
                          "timeline": memory.timeline, "trend": trend},
    }


def service_engine(config_path: Path) -> str:
    [app] = yaml.safe_load(config_path.read_text(encoding="utf-8"))["applications"]
    return app["args"].get("engine", "piper")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=600.0,
                        help="the load runs this long, and on until a request started after "
                             "the crash has completed (at most 90 s more)")
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--crash-at-s", type=float, default=None,
                        help="when to crash the synthesizer (default: a third of the way in)")
    parser.add_argument("--no-crash", action="store_true")
    parser.add_argument("--memory-every-s", type=float, default=30.0,
                        help="sample the replicas' resident memory this often")
    parser.add_argument("--memory-warmup-s", type=float, default=300.0,
                        help="each replica's RSS slope is fitted to the samples after this")
    parser.add_argument("--burst-every-s", type=float, default=0.0,
                        help="a burst of --burst-size long streams this often (0: none)")
    parser.add_argument("--burst-size", type=int, default=24)
    parser.add_argument("--port", type=int, default=8790)
    parser.add_argument("--config", type=Path, default=ROOT / "serve_config.cpu.yaml")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "soak-cpu.json")
    parser.add_argument("--log", type=Path, default=Path(tempfile.gettempdir()) / "soak-serve.log",
                        help="where the service's own output goes")
    options = parser.parse_args()

    base_url = f"http://127.0.0.1:{options.port}"
    service = start_service(soak_config(options.config, options.port), base_url, options.log)
    try:
        crash_at_s = None if options.no_crash else (
            options.crash_at_s if options.crash_at_s is not None else options.duration_s / 3)
        report = run_load(base_url, options.duration_s, options.concurrency, crash_at_s,
                          memory_every_s=options.memory_every_s,
                          memory_warmup_s=options.memory_warmup_s,
                          burst_every_s=options.burst_every_s, burst_size=options.burst_size)
        report["command"] = "scripts/soak " + " ".join(sys.argv[1:])
        report["profile"] = f"{options.config.name} (engine: {service_engine(options.config)})"
        report["config"] = str(options.config.relative_to(ROOT)
                               if options.config.is_relative_to(ROOT) else options.config)
    finally:
        stop_service(service)
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(report, indent=2))
    print(f"soak: report written to {options.out}")
    if report["lost"] or report["5xx_outside_crash_window"]:
        raise SystemExit("soak: FAILED (lost streams or 5xx outside the crash window)")


if __name__ == "__main__":
    main()
