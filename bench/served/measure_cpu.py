#!/usr/bin/env python3
"""Measure time to first byte (TTFB) and real-time factor (RTF) of the running service over HTTP.

Run the service first (scripts/serve), then: .venv/bin/python bench/served/measure_cpu.py
Each request asks /v1/audio/speech for 24 kHz 16-bit pcm, so the audio's duration is the byte
count / 48000. TTFB is from sending the request to the first body byte; RTF is the whole
response's wall time over the audio's duration (below 1 = faster than real time). Results are
printed and written to docs/benchmarks/cpu-profile.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
PCM_BYTES_PER_S = 24000 * 2
TEXTS = {
    "short": "Hello from the serving stack.",
    "long": ("Streaming speech synthesis lets a listener hear the first words while the rest of "
             "the answer is still being produced. This service splits the text into sentences, "
             "synthesizes them in batches that many listeners share, and encodes each piece as "
             "soon as it is ready. The time to the first byte therefore depends on the first "
             "sentence only, while the real-time factor tells whether the voice keeps ahead of "
             "a player. On a small CPU both numbers are modest, but they are honest ones."),
}


def one_request(base_url: str, text: str) -> dict[str, float]:
    body = {"model": "tts-1", "voice": "alloy", "input": text, "response_format": "pcm"}
    with httpx.Client(base_url=base_url, timeout=300) as client:
        started = time.perf_counter()
        ttfb_s = None
        size = 0
        with client.stream("POST", "/v1/audio/speech", json=body) as response:
            response.raise_for_status()
            for piece in response.iter_raw():
                if ttfb_s is None and piece:
                    ttfb_s = time.perf_counter() - started
                size += len(piece)
        total_s = time.perf_counter() - started
    audio_s = size / PCM_BYTES_PER_S
    return {"ttfb_s": ttfb_s or total_s, "total_s": total_s, "audio_s": audio_s,
            "rtf": total_s / audio_s if audio_s else float("inf")}


def summarize(runs: list[dict[str, float]]) -> dict[str, object]:
    def stat(key: str) -> dict[str, float]:
        values = [run[key] for run in runs]
        return {"median": round(statistics.median(values), 4), "min": round(min(values), 4),
                "max": round(max(values), 4)}

    return {"runs": len(runs), "ttfb_s": stat("ttfb_s"), "rtf": stat("rtf"),
            "audio_s": stat("audio_s"), "total_s": stat("total_s")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=4,
                        help="also run this many long requests at once (0: skip)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs/benchmarks/cpu-profile.json")
    args = parser.parse_args()

    one_request(args.url, TEXTS["short"])  # warm the path (connections, first shapes)
    results: dict[str, object] = {}
    for name, text in TEXTS.items():
        runs = [one_request(args.url, text) for _ in range(args.repeats)]
        results[f"{name}_sequential"] = {"chars": len(text), **summarize(runs)}
    if args.concurrency > 0:
        with ThreadPoolExecutor(args.concurrency) as pool:
            runs = list(pool.map(lambda _: one_request(args.url, TEXTS["long"]),
                                 range(args.concurrency)))
        results[f"long_concurrent_{args.concurrency}"] = {"chars": len(TEXTS["long"]),
                                                          **summarize(runs)}

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    report = {
        "what": "CPU profile (serve_config.cpu.yaml, piper en_US-joe-medium) over HTTP, "
                "/v1/audio/speech pcm 24 kHz",
        "url": args.url, "commit": commit, "machine": platform.machine(),
        "cpu_count": os.cpu_count(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, result in results.items():
        print(f"{name:>20}: TTFB median {result['ttfb_s']['median'] * 1000:7.0f} ms  "
              f"RTF median {result['rtf']['median']:.3f}  "
              f"(audio {result['audio_s']['median']:.2f} s, {result['runs']} runs)")
    print(f"wrote {args.out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
