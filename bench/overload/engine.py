"""Overload, the engine alone: the same levels as ``scripts/bench_overload`` (the served run),
offered to the MiniCPM-o engine in this process, with no Ray and no HTTP between.

    python -m bench.overload.engine --out /tmp/engine-overload.json

The engine is built from ``--config``'s engine options (the shipped ones) with the benchmark
setting (full-size random weights, every stream ``--audio-seconds`` long), once per admission
rule. Each stream's fate and each level's figures are counted as the served run counts them
(``bench/overload/levels.py``); a refusal here is the engine's ``EngineOverloadedError``, at
submission or (a queued stream) before its first audio, so it has no HTTP status beyond the
503 it becomes and no ``Retry-After``.

On the CPU with the tests' tiny checkpoint (a smoke run, not a measurement):

    python -m bench.overload.engine --checkpoint /tmp/tiny --device cpu \\
        --capacity-read 4 --capacity-chat 2 --capacity-mixed 3 1 --levels 1 3 --out /tmp/o.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from bench.overload.levels import LEVELS_X, MIXES, StreamFate, level_schedules, percentile, summarize
from bench.overload.run import acceptance
from bench.served.arrivals import CHAT_TEXT, READ_TEXT
from bench.served.config import key_values
from bench.served.report import gpu_name
from harness.service import ROOT, git_commit
from serve_app.engines.base import EngineOverloadedError, SpeechRequest
from serve_app.engines.minicpmo.engine import MiniCPMOEngine
from serve_app.engines.work_admission import REFUSAL_REASONS

SAMPLE_RATE_HZ = 24000
_ids = itertools.count()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "serve_config.yaml")
    parser.add_argument("--admissions", nargs="+", default=["work", "slots"],
                        help="work, slots, or work:MARGIN[:HOLD] (admission by work at that "
                             "margin, and behind_hold_s HOLD, instead of the config's: written "
                             "under variants)")
    parser.add_argument("--mixes", nargs="+", default=list(MIXES), choices=list(MIXES))
    parser.add_argument("--levels", nargs="+", type=float, default=list(LEVELS_X))
    parser.add_argument("--capacity-read", type=int, default=1024)
    parser.add_argument("--capacity-chat", type=int, default=256)
    parser.add_argument("--capacity-mixed", nargs=2, type=int, default=[384, 96])
    parser.add_argument("--window-s", type=float, default=8.0)
    parser.add_argument("--audio-seconds", type=float, default=10.0)
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="real weights (the tests' tiny checkpoint) instead of random ones")
    parser.add_argument("--device", default=None, help="override the config's device")
    parser.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                        help="an engine option over the config's (as scripts/bench_overload's)")
    parser.add_argument("--ttfb-p99-ms", type=float, default=500.0)
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args(argv)


def engine_options(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    config = yaml.safe_load(args.config.read_text(encoding="utf-8"))
    [app] = config["applications"]
    options = {**app["args"]["engine_options"], **key_values(args.engine_option)}
    admission, _, rest = variant.partition(":")
    margin, _, hold = rest.partition(":")
    options["admission"] = admission
    if margin:
        options["admission_margin"] = float(margin)
    if hold:
        options["behind_hold_s"] = float(hold)
    options["max_queued"] = max(options.get("max_queued", 256), 4096)
    options["benchmark"] = {"random_weights": args.checkpoint is None,
                            "tts_tokenizer": str(ROOT / "tests" / "golden" / "chattts_tokenizer"),
                            "audio_seconds": args.audio_seconds, "chat_tokens": 40}
    if args.checkpoint is not None:
        options["model"] = str(args.checkpoint.resolve())
        options.update(cuda_graphs=False, dtype="float32")
    if args.device:
        options["device"] = args.device
    return options


async def one_stream(engine: MiniCPMOEngine, kind: str, at_s: float, t0: float) -> StreamFate:
    await asyncio.sleep(max(0.0, t0 + at_s - time.perf_counter()))
    fate = StreamFate(kind=kind, at_s=at_s)
    request = SpeechRequest(request_id=f"overload-{next(_ids)}", mode=kind,
                            text=CHAT_TEXT if kind == "chat" else READ_TEXT)
    started = time.perf_counter()
    try:
        (stream,) = engine.iterators([request.request_id],
                                     lambda queues: engine.submit_to([request], queues))
    except EngineOverloadedError:
        fate.status, fate.answered_s = 503, time.perf_counter() - started
        return fate
    try:
        async for chunk in stream:
            if fate.status is None:
                fate.status, fate.answered_s = 200, time.perf_counter() - started
            fate.audio(time.perf_counter() - started, len(chunk.samples) / SAMPLE_RATE_HZ)
        fate.whole = True
    except EngineOverloadedError:  # refused while queued: before any audio
        fate.status, fate.answered_s = 503, time.perf_counter() - started
    except Exception as exc:
        fate.error = f"{type(exc).__name__}: {str(exc)[:100]}"
    return fate


async def sample_projection(engine: MiniCPMOEngine, into: list[float]) -> None:
    """The load admission projects for its committed streams, twice a second."""
    while True:
        into.append(engine.stats().work_load)
        await asyncio.sleep(0.5)


def engine_figures(engine: MiniCPMOEngine, before: Any, since_s: float,
                   projected: list[float]) -> dict[str, Any]:
    """What the engine measured over a level beside what its admission projected: each step's
    load (its time over the real-time budget), the committed load, the fitted costs, and the
    refusals by reason."""
    stats = engine.stats()
    budget = stats.step_budget_s or 1.0
    loads = [record.seconds / budget for record in engine.step_log(since_s)]
    return {"step_load_mean": sum(loads) / len(loads) if loads else None,
            "step_load_p50": percentile(loads, 50), "step_load_p99": percentile(loads, 99),
            "steps_over_budget": sum(load > 1.0 for load in loads),
            "projected_load_mean": sum(projected) / len(projected) if projected else None,
            "projected_load_max": max(projected, default=None),
            "work_limit": stats.work_limit, "read_stream_load": stats.read_stream_load,
            "chat_stream_load": stats.chat_stream_load,
            **{f"refused_{reason}": getattr(stats, f"refused_{reason}")
               - getattr(before, f"refused_{reason}") for reason in REFUSAL_REASONS},
            "ran_dry_chunks": stats.ran_dry_chunks - before.ran_dry_chunks}


async def run_levels(engine: MiniCPMOEngine, args: argparse.Namespace) -> list[dict[str, Any]]:
    levels = []
    for mix, capacity, offered_x, schedule in level_schedules(args):
        t0 = time.perf_counter() + 0.5
        projected: list[float] = []
        sampling = asyncio.ensure_future(sample_projection(engine, projected))
        before = engine.stats()
        fates = await asyncio.gather(*(one_stream(engine, kind, at, t0) for at, kind in schedule))
        sampling.cancel()
        level = summarize(list(fates), mix, offered_x, args.window_s)
        level["capacity"] = capacity
        level["engine"] = engine_figures(engine, before, t0, projected)
        print(json.dumps({k: v for k, v in level.items() if k != "by_kind"}), flush=True)
        levels.append(level)
        await asyncio.sleep(1.0)
    return levels


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result: dict[str, Any] = {
        "gpu": gpu_name(), "command": "python -m bench.overload.engine "
        + " ".join(sys.argv[1:]), "git_commit": git_commit(), "config": str(args.config),
        "audio_seconds_per_stream": args.audio_seconds, "window_s": args.window_s,
        "levels": [], "slots_levels": [], "variants": {}}
    for admission in args.admissions:
        engine = MiniCPMOEngine.from_options(**engine_options(args, admission))
        try:
            print(f"admission by {admission}", flush=True)
            levels = asyncio.run(run_levels(engine, args))
        finally:
            engine.close()
            del engine
            gc.collect()
            try:
                import torch

                torch.cuda.empty_cache()
            except Exception:
                pass
        if admission in ("work", "slots"):
            result["levels" if admission == "work" else "slots_levels"] = levels
        else:
            result["variants"][admission] = levels
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    result["acceptance"] = acceptance(result["levels"], result["slots_levels"], args.ttfb_p99_ms)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["acceptance"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
