#!/usr/bin/env python3
"""Benchmark the MiniCPM-o engine on a GPU with full-size random weights (no Ray).

Lengths are fixed by the engine's length controls (random weights never stop by themselves):
every request speaks ``--audio-seconds`` of audio; chat requests first decode ``--chat-tokens``
LLM tokens. For each mode and concurrency it measures per request the time to first audio
(TTFB), the real-time factor, every chunk's arrival, and whether a player that starts at the
first byte ever runs dry; as a burst and as Poisson arrivals that hold that many streams
active. ``--baseline sequential-eager`` adds the upstream way in the same run: one request at a
time, no batching. Results go to ``docs/benchmarks/engine-<gpu>.json`` and a PNG.

Example: python -m bench.engine.run --modes read chat --concurrency 1 8 32 64 128 256

``--quantization int4|int8`` quantizes the LLM (torchao, the ``quant`` extra) before measuring.
``--compare-quantization`` measures bf16 and then the quantized LLM on the same random weights
in one run: peak GPU memory with 32 concurrent streams, single-stream TTFB, real-time streams
over ``--concurrency`` (``--arrivals``), and the relative error of the quantized logits; it writes
``docs/benchmarks/<quantization>-<gpu>.json``.
Example: python -m bench.engine.run --compare-quantization --quantization int4 \
    --concurrency 1 8 16 32 64 --arrivals burst --audio-seconds 10

``--voices N`` registers N cloned voices from synthetic 5 s clips (``embed_voice`` +
``add_voice``, timed) and spreads every level's requests round-robin over them; the JSON then
has per level TTFB in cloned voices (``voices`` in each sweep row), the registration times, and
``single_stream_voices``: single-stream TTFB in the default voice next to a cloned one. On the
CPU with the tests' tiny voice checkpoint (a quick check of the path, not a measurement):
    python -c "from pathlib import Path; from tests.golden_voice.checkpoint import \
        build_voice_checkpoint as b; b(Path('/tmp/tiny-voice'))"
    python -m bench.engine.run --device cpu --dtype float32 --checkpoint /tmp/tiny-voice \
        --modes read chat --concurrency 1 4 --arrivals burst --audio-seconds 1 --chat-tokens 6 \
        --baseline none --voices 3 --out /tmp/bench-voices.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from bench.engine.roofline import GPUS, ModelSizes, roofline, tensor_bytes
from serve_app.engines.base import LengthControls, SamplingParams, SpeechRequest, StreamQueues
from serve_app.engines.minicpmo.engine import EngineOptions, MiniCPMOEngine
from serve_app.engines.minicpmo.model.layers import (
    ONE_QUERY_KERNELS,
    SlotKVCache,
    StepInputs,
    causal_attend,
)
from serve_app.engines.minicpmo.model.names import KV_CACHE_DTYPES
from serve_app.engines.minicpmo.model.quantization import QUANTIZATION_MODES, quantize_llm
from serve_app.engines.minicpmo.model.synthetic import (
    random_speech_model,
    synthetic_voice_clip,
)

ROOT = Path(__file__).resolve().parents[2]

SAMPLE_RATE = 24_000
FRAMES_PER_SECOND = 46.875
# Single-stream TTFB: the median of this many one-stream runs (after one warm-up).
SINGLE_STREAM_RUNS = 7
READ_TEXT = ("Streaming speech synthesis turns text into audio while the text is still arriving. "
             "The weather today is sunny and warm, and I hope you have a wonderful day ahead. ")
CHAT_TEXT = "Tell me something nice about the sea."


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def stream_is_realtime(arrivals: list[tuple[float, int]]) -> bool:
    """A player starting at the first byte never runs dry: each chunk arrives before the audio
    already received has played out."""
    return bool(arrivals) and longest_stall_s(arrivals) <= 1e-3


def longest_stall_s(arrivals: list[tuple[float, int]]) -> float:
    """How long a player starting at the first byte waits, at its worst, for a chunk after the
    audio it holds has played out (0: it never runs dry; a player that does not pause would
    fall behind by this much at that chunk)."""
    if not arrivals:
        return 0.0
    start = arrivals[0][0]
    buffered_s = worst = 0.0
    for at, samples in arrivals:
        worst = max(worst, at - start - buffered_s)
        buffered_s += samples / SAMPLE_RATE
    return worst


def voice_id(index: int) -> str:
    return f"bench-voice-{index}"


def make_request(index: int, mode: str, args: argparse.Namespace,
                 voice: str | None = None) -> SpeechRequest:
    """The index-th request of a level: in cloned voice ``index % --voices`` when there are
    voices (``voice`` overrides)."""
    frames = int(round(args.audio_seconds * FRAMES_PER_SECOND))
    lengths = LengthControls(ignore_eos=True, audio_frames=frames,
                             llm_tokens=args.chat_tokens if mode == "chat" else None)
    if voice is None:
        voice = voice_id(index % args.voices) if getattr(args, "voices", 0) else "default"
    return SpeechRequest(request_id=f"{mode}-{index}-{time.monotonic_ns()}",
                         text=READ_TEXT if mode == "read" else CHAT_TEXT, mode=mode, voice=voice,
                         seed=index, sampling=SamplingParams(temperature=0.7, max_new_tokens=4096),
                         lengths=lengths)


def register_voices(engine: MiniCPMOEngine, count: int) -> dict:
    """``count`` cloned voices from deterministic synthetic 5 s clips; the time each took."""
    embed_ms, add_ms = [], []
    for index in range(count):
        clip = synthetic_voice_clip(index, seconds=5.0)
        started = time.perf_counter()
        embeddings = engine.embed_voice(clip, 16_000)
        embedded = time.perf_counter()
        engine.add_voice(voice_id(index), embeddings)
        embed_ms.append((embedded - started) * 1000)
        add_ms.append((time.perf_counter() - embedded) * 1000)
    return {"voices": count, "clip_seconds": 5.0,
            "audio_tokens": int(embeddings.shape[0]) if count else None,
            "embed_voice_ms_p50": percentile(embed_ms, 50), "add_voice_ms_p50": percentile(add_ms, 50),
            "embed_voice_ms": [round(v, 1) for v in embed_ms],
            "add_voice_ms": [round(v, 1) for v in add_ms]}


async def single_stream_in_voices(engine: MiniCPMOEngine, args: argparse.Namespace) -> dict:
    """Single-stream TTFB (median of 3) in the default voice and in a cloned one, per mode."""
    out = {}
    for mode in args.modes:
        row = {}
        for label, voice in (("default_voice", "default"), ("cloned_voice", voice_id(0))):
            ttfbs = []
            for index in range(4):  # the first is a warm-up
                result = await run_one(engine, make_request(index, mode, args, voice=voice), 0.0)
                ttfbs.append(result["ttfb_ms"])
            row[f"ttfb_ms_{label}"] = statistics.median(ttfbs[1:])
        out[mode] = row
        print(json.dumps({"single_stream_voices": mode, **row}), flush=True)
    return out


class EmissionStamps:
    """When the engine's step thread handed out each chunk with audio of a stream (``sent``:
    per request, (time, samples)), noted by the sink :meth:`wrap` puts in front of the bench's
    readers. Those readers run on an event loop in the engine's own process, which must win the
    GIL from the step thread to take a chunk; the served engine hands its chunks to another
    process. The emission times say what the engine did, the arrival times what this loop saw."""

    def __init__(self) -> None:
        self.sent: dict[str, list[tuple[float, int]]] = {}

    def wrap(self, sink: StreamQueues) -> Callable[[list[tuple[str, object]]], None]:
        def stamped(items: list[tuple[str, object]]) -> None:
            now = time.perf_counter()
            for request_id, item in items:
                samples = getattr(item, "samples", None)
                if samples is not None and len(samples):
                    self.sent.setdefault(request_id, []).append((now, len(samples)))
            sink(items)

        stamped.per_item = sink.per_item  # type: ignore[attr-defined]  # as the Outbox reads it
        return stamped


EMISSIONS = EmissionStamps()


async def run_one(engine: MiniCPMOEngine, request: SpeechRequest, delay_s: float) -> dict:
    await asyncio.sleep(delay_s)
    submitted = time.perf_counter()
    (stream,) = engine.iterators([request.request_id], lambda queues: engine.submit_to(
        [request], EMISSIONS.wrap(queues)))
    arrivals: list[tuple[float, int]] = []
    async for chunk in stream:
        if len(chunk.samples):
            arrivals.append((time.perf_counter(), len(chunk.samples)))
    done = time.perf_counter()
    sent = EMISSIONS.sent.pop(request.request_id, [])
    audio_s = sum(n for _, n in arrivals) / SAMPLE_RATE
    return {"ttfb_ms": (arrivals[0][0] - submitted) * 1000 if arrivals else None,
            "total_s": done - submitted, "audio_s": audio_s,
            "rtf": (done - submitted) / audio_s if audio_s else None,
            "realtime": stream_is_realtime(arrivals), "chunks": len(arrivals),
            "stall_ms": longest_stall_s(arrivals) * 1000,
            # the same, with each chunk timed as the engine handed it out
            "sent_ttfb_ms": (sent[0][0] - submitted) * 1000 if sent else None,
            "sent_realtime": stream_is_realtime(sent), "sent_stall_ms": longest_stall_s(sent) * 1000,
            "chunk_times_ms": [round((t - submitted) * 1000, 1) for t, _ in arrivals]}


def slow_step(record) -> dict:
    """One step of the step log, for the JSON: its time, streams, phases and device work."""
    return {"ms": round(record.seconds * 1000, 1), "generating": record.generating,
            "admitted": len(record.queue_waits_s), "gc_ms": round(record.gc_s * 1000, 1),
            "phase_ms": {name: round(s * 1000, 1) for name, s in record.phases_s},
            "work": dict(record.work)}


def step_phase_percentiles(records) -> dict:
    """Per phase: mean, p50 and p99 over the steps of the time the phase took in a step."""
    phases = [dict(record.phases_s) for record in records]
    out = {}
    for name in sorted({name for step in phases for name in step}):
        values = [step.get(name, 0.0) * 1000 for step in phases]
        out[name] = {"mean": round(float(np.mean(values)), 3), "p50": round(percentile(values, 50), 2),
                     "p99": round(percentile(values, 99), 2)}
    return out


async def profile_kernels(engine: MiniCPMOEngine, delay_s: float, seconds: float) -> dict:
    """``seconds`` of the running level under ``torch.profiler``, from ``delay_s`` after its
    start (the steady state): how busy the GPU was over the window (the kernels' summed time;
    two streams that overlap can make it exceed the window) and the kernels that took the most
    GPU time, with the engine steps the window held. Whether a step is bound by the device or
    by the host that feeds it is this number."""
    from torch.profiler import ProfilerActivity, profile

    await asyncio.sleep(delay_s)
    steps_before = engine.stats().steps
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        await asyncio.sleep(seconds)
        torch.cuda.synchronize()
    window_s = time.perf_counter() - started
    steps = engine.stats().steps - steps_before
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    busy_us = sum(e.self_device_time_total for e in kernels)
    kernels.sort(key=lambda e: -e.self_device_time_total)
    return {"window_s": round(window_s, 3), "engine_steps": steps,
            "gpu_busy_fraction": round(busy_us / 1e6 / window_s, 3),
            "gpu_ms_per_step": round(busy_us / 1000 / max(steps, 1), 2),
            "top_kernels": [{"name": e.key[:120], "calls_per_step": round(e.count / max(steps, 1), 1),
                             "ms_per_step": round(e.self_device_time_total / 1000 / max(steps, 1), 3)}
                            for e in kernels[:25]]}


def single_stream(engine: MiniCPMOEngine, mode: str, args) -> tuple[dict, list[dict]]:
    """One stream at a time: TTFB p50 and RTF, the medians of :data:`SINGLE_STREAM_RUNS` runs
    after a warm-up; and those runs."""
    asyncio.run(run_level(engine, mode, 1, "burst", args))  # warm-up
    runs = [asyncio.run(run_level(engine, mode, 1, "burst", args))
            for _ in range(SINGLE_STREAM_RUNS)]
    return ({"ttfb_ms_p50": statistics.median(r["ttfb_ms_p50"] for r in runs),
             "rtf": statistics.median(r["rtf_p50"] for r in runs)}, runs)


async def run_level(engine: MiniCPMOEngine, mode: str, concurrency: int, arrival: str,
                    args: argparse.Namespace) -> dict:
    rng = random.Random(concurrency)
    if arrival == "burst":
        delays = [0.0] * concurrency
        total = concurrency
    else:  # Poisson arrivals whose rate keeps about `concurrency` streams active
        total = max(concurrency * 2, 4)
        mean_duration = args.audio_seconds * 1.05
        rate = concurrency / mean_duration
        t, delays = 0.0, []
        for _ in range(total):
            delays.append(t)
            t += rng.expovariate(rate)
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    steps_before = engine.stats().steps
    busy_before_s = engine.stats().step_seconds
    cpu_before_s = engine.stats().step_cpu_seconds
    llm_steps_before = engine.stats().llm_steps
    work_before = engine.device_work()
    phases_before = engine.phase_seconds()
    started = time.perf_counter()
    profiled = None
    if getattr(args, "kernel_profile_s", 0) and concurrency > 1 and torch.cuda.is_available():
        profiled = asyncio.ensure_future(profile_kernels(engine, args.audio_seconds * 0.8,
                                                         args.kernel_profile_s))
    results = await asyncio.gather(*(run_one(engine, make_request(i, mode, args), d)
                                     for i, d in enumerate(delays)))
    wall = time.perf_counter() - started
    steps = engine.stats().steps - steps_before
    busy_s = engine.stats().step_seconds - busy_before_s
    cpu_s = engine.stats().step_cpu_seconds - cpu_before_s
    llm_steps = engine.stats().llm_steps - llm_steps_before
    work = {key: value - work_before.get(key, 0) for key, value in engine.device_work().items()}
    phases = {k: round((v - phases_before.get(k, 0.0)) * 1000 / max(engine.stats().steps - steps_before, 1), 3)
              for k, v in engine.phase_seconds().items()}
    ttfbs = [r["ttfb_ms"] for r in results if r["ttfb_ms"] is not None]
    rtfs = [r["rtf"] for r in results if r["rtf"] is not None]
    # Spikes show as long waits between a stream's chunks, whatever the mean step time: each
    # stream's longest, over the streams (bench_serve measures the same at the client).
    gaps = [max(b - a for a, b in zip(r["chunk_times_ms"], r["chunk_times_ms"][1:]))
            for r in results if len(r["chunk_times_ms"]) > 1]
    realtime_share = sum(r["realtime"] for r in results) / len(results)
    sent_ttfbs = [r["sent_ttfb_ms"] for r in results if r["sent_ttfb_ms"] is not None]
    sent_stalls = [r["sent_stall_ms"] for r in results if r["sent_ttfb_ms"] is not None]
    stalls = [r["stall_ms"] for r in results if r["ttfb_ms"] is not None]
    steps_run = engine.step_log(started)
    step_ms = [record.seconds * 1000 for record in steps_run]
    queue_ms = [wait * 1000 for record in steps_run for wait in record.queue_waits_s]
    summary = {
        "mode": mode, "arrival": arrival, "concurrency": concurrency, "requests": total,
        "voices": getattr(args, "voices", 0),
        "ttfb_ms_p50": percentile(ttfbs, 50), "ttfb_ms_p90": percentile(ttfbs, 90),
        "ttfb_ms_p99": percentile(ttfbs, 99), "rtf_p50": percentile(rtfs, 50),
        "realtime_share": realtime_share,
        "longest_gap_ms_p50": percentile(gaps, 50), "longest_gap_ms_p99": percentile(gaps, 99),
        # What a tail is made of: the engine's step times (a spike delays every stream), each
        # stream's wait from submission to admission (its share of TTFB before any work), and
        # each stream's worst stall, where a player would run dry (0 for a real-time stream).
        "step_ms_p50": percentile(step_ms, 50), "step_ms_p99": percentile(step_ms, 99),
        "step_ms_max": max(step_ms, default=None),
        "queue_wait_ms_p50": percentile(queue_ms, 50), "queue_wait_ms_p99": percentile(queue_ms, 99),
        "stall_ms_p99": percentile(stalls, 99), "stall_ms_max": max(stalls, default=None),
        # The same figures with each chunk timed when the engine's step thread handed it out,
        # not when this process's event loop got it (EmissionStamps): what the engine
        # did, without the bench's own reader in its process
        "at_emission": {
            "ttfb_ms_p50": percentile(sent_ttfbs, 50), "ttfb_ms_p99": percentile(sent_ttfbs, 99),
            "realtime_share": sum(r["sent_realtime"] for r in results) / len(results),
            "stall_ms_p99": percentile(sent_stalls, 99),
            "stall_ms_max": max(sent_stalls, default=None)},
        "gc_ms_total": round(sum(r.gc_s for r in steps_run) * 1000, 1),
        # Each phase's share of the tail: its time per step, mean, median and 99th percentile
        # (host time; device time too with --profile-phases).
        "step_phase_ms": step_phase_percentiles(steps_run),
        "slowest_steps": [slow_step(r) for r in sorted(steps_run, key=lambda r: -r.seconds)[:8]],
        "audio_seconds_per_second": sum(r["audio_s"] for r in results) / wall,
        "wall_s": wall, "engine_steps": steps, "ms_per_step": wall * 1000 / max(steps, 1),
        # Time inside steps only (idle waits between arrivals left out): the figure
        # scripts/bench_serve reads from the served engine, to compare the two.
        "busy_ms_per_step": round(busy_s * 1000 / max(steps, 1), 3),
        # the step thread's CPU time per step; CUDA's default sync spin-waits, so time waiting
        # on the GPU counts too: an upper bound on the host work inside busy_ms_per_step
        "step_cpu_ms_per_step": round(cpu_s * 1000 / max(steps, 1), 3),
        # Chat: batched LLM decode steps per engine step (each reads all LLM weights once).
        "llm_steps_per_step": round(llm_steps / max(steps, 1), 3),
        "gpu_memory_gb": (torch.cuda.max_memory_allocated() / 1e9) if torch.cuda.is_available() else None,
        "phase_ms_per_step": phases,
        "device_work": work,
    }
    if profiled is not None:
        summary["kernel_profile"] = await profiled
    summary["ok"] = bool(realtime_share >= 0.99 and (summary["ttfb_ms_p99"] or 1e9) <= 500)
    summary["sample_request"] = results[0]
    print(json.dumps({k: v for k, v in summary.items() if k != "sample_request"}), flush=True)
    return summary


def git_commit() -> str:
    if os.environ.get("BENCH_GIT_COMMIT"):
        return os.environ["BENCH_GIT_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True).strip()
    except Exception:
        return "unknown"


def build_engine(model, args, max_slots: int) -> MiniCPMOEngine:
    options = EngineOptions(device=args.device, dtype=args.dtype, max_slots=max_slots,
                            max_chat_slots=min(max_slots, args.max_chat_slots),
                            quantization=args.quantization,
                            max_queued=4096, tts_max_positions=args.tts_positions,
                            llm_max_positions=args.llm_positions, tts_sampling="sample",
                            cuda_graphs=not args.no_graphs and max_slots > 1,
                            steps_per_sync=args.steps_per_sync,
                            one_query_attention=args.one_query_attention,
                            tts_kv_cache_dtype=getattr(args, "tts_kv_cache_dtype", "auto"),
                            decode_dtype=getattr(args, "decode_dtype", EngineOptions.decode_dtype),
                            overlap_llm_step=getattr(args, "overlap_llm_step", False),
                            first_chunk_frames=getattr(args, "first_chunk_frames", None),
                            audio_cuts=getattr(args, "audio_cuts", "planned"),
                            prefill_tokens=getattr(args, "prefill_tokens",
                                                   EngineOptions.prefill_tokens),
                            prefill_prompts=getattr(args, "prefill_prompts",
                                                    EngineOptions.prefill_prompts),
                            profile_phases=args.profile_phases,
                            voices=model.clip_encoder is not None,
                            max_voices=max(getattr(args, "voices", 0), 1))
    return MiniCPMOEngine(model, options)


async def measure_engine(engine: MiniCPMOEngine, args, modes, levels) -> dict:
    sweep = []
    for mode in modes:
        await run_level(engine, mode, 1, "burst", args)  # warm-up
        for concurrency in levels[mode]:
            for arrival in args.arrivals:
                for interval_ms, threads in itertools.product(
                        args.gil_switch_intervals_ms or [None], args.torch_threads or [None]):
                    if interval_ms is not None:  # an A/B of the step thread's GIL waits
                        sys.setswitchinterval(interval_ms / 1000)
                    if threads is not None:  # an A/B of PyTorch's CPU threads (Ray: num_cpus)
                        torch.set_num_threads(threads)
                    result = await run_level(engine, mode, concurrency, arrival, args)
                    result["gil_switch_interval_ms"] = sys.getswitchinterval() * 1000
                    result["torch_threads"] = torch.get_num_threads()
                    sweep.append(result)
                if result["ttfb_ms_p99"] and result["ttfb_ms_p99"] > args.stop_after_ttfb_ms:
                    break
            if sweep[-1]["ttfb_ms_p99"] and sweep[-1]["ttfb_ms_p99"] > args.stop_after_ttfb_ms:
                break
    return {"sweep": sweep}


def realtime_streams(rows: list[dict], floor: int = 0) -> int:
    """The largest concurrency at which every one of ``rows`` (one mode's levels, of one
    arrival or of several) is real-time (``ok``); ``floor`` when none is."""
    levels: dict[int, bool] = {}
    for row in rows:
        levels[row["concurrency"]] = levels.get(row["concurrency"], True) and row["ok"]
    return max([floor] + [concurrency for concurrency, ok in levels.items() if ok])


def headline(sweep: list[dict], mode: str) -> tuple[dict, int]:
    singles = [r for r in sweep if r["mode"] == mode and r["concurrency"] == 1]
    single = singles[0] if singles else {}
    poisson = [r for r in sweep if r["mode"] == mode and r["arrival"] == "poisson"]
    return ({"ttfb_ms_p50": single.get("ttfb_ms_p50"), "rtf": single.get("rtf_p50")},
            realtime_streams(poisson))


def prompt_logits(model, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Final hidden states and float logits of one prompt [1, S] (plain causal prefill)."""
    length = token_ids.shape[1]
    device = token_ids.device
    cache = SlotKVCache(model.config.llm, 1, length, device, next(model.tts.parameters()).dtype)
    positions = torch.arange(length, device=device)[None]
    valid = torch.ones_like(positions, dtype=torch.bool)
    step = StepInputs(torch.zeros(1, dtype=torch.long, device=device), positions, positions,
                      causal_attend(positions, valid, length + 1))
    with torch.inference_mode():
        hidden = model.llm.hidden_states(token_ids, cache, step)
        return hidden[0].float(), model.llm.logits(hidden)[0]


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value - reference).norm() / reference.norm())


def free_gpu() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def measure_variant(model, args, label: str) -> dict:
    """Peak memory with 32 concurrent streams, then single-stream TTFB and the sweep."""
    streams = 32
    free_gpu()
    weights_gb = torch.cuda.memory_allocated() / 1e9 if torch.cuda.is_available() else None
    torch.cuda.reset_peak_memory_stats() if torch.cuda.is_available() else None
    engine = build_engine(model, args, streams)
    asyncio.run(run_level(engine, "chat", 1, "burst", args))  # warm-up
    memory_row = asyncio.run(run_level(engine, "chat", streams, "burst", args))
    memory = {"streams": streams, "mode": "chat", "audio_seconds": args.audio_seconds,
              "max_slots": streams, "max_chat_slots": streams,
              "tts_max_positions": args.tts_positions, "llm_max_positions": args.llm_positions,
              "weights_gb": weights_gb}
    if torch.cuda.is_available():
        memory["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
        memory["peak_reserved_gb"] = torch.cuda.max_memory_reserved() / 1e9
    memory["realtime_share"] = memory_row["realtime_share"]
    engine.close()
    del engine
    free_gpu()
    print(f"[{label}] peak memory, {streams} streams: {json.dumps(memory)}", flush=True)

    levels = {"read": args.concurrency, "chat": args.chat_concurrency or args.concurrency}
    engine = build_engine(model, args, max(max(levels[m]) for m in args.modes))
    single, sweep, best, by_arrival = {}, [], {}, {}
    for mode in args.modes:
        single[mode], runs = single_stream(engine, mode, args)
        for concurrency in [c for c in levels[mode] if c > 1]:
            for arrival in args.arrivals:
                sweep.append(asyncio.run(run_level(engine, mode, concurrency, arrival, args)))
            if (sweep[-1]["ttfb_ms_p99"] or 0) > args.stop_after_ttfb_ms:
                break
        # A level counts once all its arrivals have run: every one of them must be real-time.
        single_ok = 1 if all(r["ok"] for r in runs) else 0
        rows = [r for r in sweep if r["mode"] == mode]
        best[mode] = realtime_streams(rows, single_ok)
        by_arrival[mode] = {arrival: realtime_streams([r for r in rows if r["arrival"] == arrival],
                                                      single_ok) for arrival in args.arrivals}
    engine.close()
    del engine
    free_gpu()
    return {"peak_memory_gb_32_streams": memory.get("peak_reserved_gb"),
            "peak_memory_32_streams": memory, "single_stream": single,
            "max_realtime_streams": best, "max_realtime_streams_by_arrival": by_arrival,
            "llm_weight_bytes": tensor_bytes(model.llm), "sweep": sweep}


# What compare_quantization keeps of each variant's measurement, beside its sweep.
VARIANT_HEADLINES = ("peak_memory_gb_32_streams", "single_stream", "max_realtime_streams",
                     "max_realtime_streams_by_arrival", "llm_weight_bytes")


def compare_quantization(args, gpu: str, gpu_tag: str) -> None:
    """bf16, then ``args.quantization`` on the same random weights, into one JSON."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(package: str) -> str | None:
        try:
            return version(package)
        except PackageNotFoundError:
            return None

    quantization = args.quantization
    out = Path(args.out) if args.out else ROOT / "docs" / "benchmarks" / f"{quantization}-{gpu_tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model = random_speech_model(args.tts_tokenizer, args.device, torch.bfloat16)
    result = {"gpu": gpu, "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
              "git_commit": git_commit(), "torch": torch.__version__, "torchao": installed("torchao"),
              "gemlite": installed("gemlite"),
              "weights": "random, full size (bf16 built on the GPU, then quantized in place)",
              "quantization": quantization, "quantized": "LLM decoder linears (q/k/v/o, gate/up/down); "
              "embeddings, lm_head, TTS, DVAE and Vocos stay bf16/fp32",
              "audio_seconds_per_request": args.audio_seconds, "chat_tokens": args.chat_tokens,
              "arrivals": args.arrivals, "concurrency": args.concurrency,
              "peak_memory_note": "torch.cuda.max_memory_reserved over building a 32-slot engine "
              "(32 TTS + 32 LLM slots, CUDA graphs) and 32 concurrent chat streams; the CUDA "
              "context (~0.5 GB) comes on top",
              "max_realtime_streams_rule": ">= 99% of streams never run dry and p99 TTFB <= 500 ms, "
              "at every arrival of the level (max_realtime_streams_by_arrival: per arrival)"}

    def save() -> None:
        out.write_text(json.dumps(result, indent=2))

    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(16, model.config.vocab_size, (1, args.logit_prompt_tokens),
                           generator=generator).to(args.device)
    reference_hidden, reference_logits = prompt_logits(model, prompt)
    bf16 = measure_variant(model, args, "bf16")
    result["bf16"] = {k: bf16[k] for k in VARIANT_HEADLINES}
    result["sweep"] = {"bf16": bf16["sweep"]}
    result["peak_memory_32_streams"] = {"bf16": bf16["peak_memory_32_streams"]}
    save()

    quantize_started = time.perf_counter()
    quantize_llm(model.llm, quantization)
    free_gpu()
    result["quantize_s"] = time.perf_counter() - quantize_started
    hidden, logits = prompt_logits(model, prompt)
    result["logits_error"] = {
        "prompt_tokens": args.logit_prompt_tokens,
        "relative_l2": relative_error(logits, reference_logits),
        "relative_l2_last_position": relative_error(logits[-1], reference_logits[-1]),
        "top1_agreement": float((logits.argmax(-1) == reference_logits.argmax(-1)).float().mean()),
        "final_hidden_relative_l2": relative_error(hidden, reference_hidden)}
    print(f"[{quantization}] logits error: {json.dumps(result['logits_error'])}", flush=True)
    save()
    quantized = measure_variant(model, args, quantization)
    for key in VARIANT_HEADLINES:
        result[key] = quantized[key]
    result["sweep"][quantization] = quantized["sweep"]
    result["peak_memory_32_streams"][quantization] = quantized["peak_memory_32_streams"]
    result["total_s"] = time.perf_counter() - started
    save()
    print(json.dumps({k: result[k] for k in VARIANT_HEADLINES + ("logits_error", "bf16")},
                     indent=2))
    print(f"wrote {out}")


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--modes", nargs="+", default=["read", "chat"])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32, 64, 128, 256, 512])
    parser.add_argument("--chat-concurrency", nargs="+", type=int, default=None)
    parser.add_argument("--arrivals", nargs="+", default=["burst", "poisson"])
    parser.add_argument("--audio-seconds", type=float, default=10.0)
    parser.add_argument("--chat-tokens", type=int, default=40)
    parser.add_argument("--tts-positions", type=int, default=1024)
    parser.add_argument("--llm-positions", type=int, default=512)
    parser.add_argument("--max-chat-slots", type=int, default=256)
    parser.add_argument("--stop-after-ttfb-ms", type=float, default=3000.0)
    parser.add_argument("--baseline", choices=["none", "sequential-eager"], default="sequential-eager")
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--steps-per-sync", type=int, default=EngineOptions.steps_per_sync,
                        help="audio frames chained on the device per host sync (the baseline uses 1)")
    parser.add_argument("--one-query-attention", choices=list(ONE_QUERY_KERNELS),
                        default=EngineOptions.one_query_attention)
    parser.add_argument("--tts-kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                        help="the TTS model's keys and values: auto (the model's dtype) or "
                             "fp8_e4m3 (EngineOptions.tts_kv_cache_dtype)")
    parser.add_argument("--decode-dtype", choices=["float32", "bfloat16"],
                        default=EngineOptions.decode_dtype,
                        help="DVAE + Vocos weights and activations (EngineOptions)")
    parser.add_argument("--prefill-tokens", type=int, default=EngineOptions.prefill_tokens,
                        help="padded prompt tokens admitted and prefilled per step (EngineOptions)")
    parser.add_argument("--prefill-prompts", type=int, default=EngineOptions.prefill_prompts,
                        help="prompts admitted and prefilled per step, at most (EngineOptions)")
    parser.add_argument("--first-chunk-frames", type=int, default=None,
                        help="code frames in a stream's first audio chunk (EngineOptions; "
                             "default: a whole call, chunk_frames)")
    parser.add_argument("--audio-cuts", choices=["planned", "on_demand"], default="planned",
                        help="the engine's audio_cuts: cuts after the first chunk planned at "
                             "admission, or made whenever a listener runs thin")
    parser.add_argument("--overlap-llm-step", action="store_true",
                        help="chat: launch the LLM step beside the audio window (EngineOptions)")
    parser.add_argument("--gil-switch-intervals-ms", type=float, nargs="+", default=None,
                        help="run each level once per GIL switch interval, in this order (an "
                             "A/B of the engine's 1 ms against Python's default 5 ms)")
    parser.add_argument("--torch-threads", type=int, nargs="+", default=None,
                        help="run each level once per PyTorch CPU thread count, in this order "
                             "(served, Ray sets OMP_NUM_THREADS to the replica's num_cpus)")
    parser.add_argument("--profile-phases", action="store_true",
                        help="time each phase of the engine step (syncs the GPU between phases, "
                             "so it slows the engine down; off for headline numbers)")
    parser.add_argument("--kernel-profile-s", type=float, default=0.0,
                        help="profile this many seconds of each level above one stream with "
                             "torch.profiler (GPU busy fraction, top kernels per step; slows "
                             "that window: a diagnosis, not a headline run)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--checkpoint", default=None,
                        help="load this checkpoint (official layout) instead of random weights")
    parser.add_argument("--tts-tokenizer", default=str(ROOT / "tests" / "golden" / "chattts_tokenizer"))
    parser.add_argument("--merge", nargs="+", default=None,
                        help="combine result JSONs of one GPU and commit (e.g. a read run and a chat "
                             "run, each within the device's per-command time) into --out, and exit")
    parser.add_argument("--plot-only", default=None, help="redraw the PNG of an existing JSON and exit")
    parser.add_argument("--quantization", choices=list(QUANTIZATION_MODES), default="none",
                        help="LLM weight-only quantization (int4: GemLite; int8, int4-tinygemm: torchao)")
    parser.add_argument("--compare-quantization", action="store_true",
                        help="measure bf16 and --quantization on the same random weights")
    parser.add_argument("--logit-prompt-tokens", type=int, default=128)
    parser.add_argument("--voices", type=int, default=0,
                        help="register this many cloned voices (synthetic 5 s clips) and spread "
                             "the requests round-robin over them")
    return parser


def main() -> None:
    parser = argument_parser()
    args = parser.parse_args()
    if args.voices and (args.compare_quantization or args.baseline != "none"):
        parser.error("--voices measures the batched engine: use it with --baseline none and "
                     "without --compare-quantization")
    if args.merge:
        merged = merge_results([json.loads(Path(p).read_text()) for p in args.merge])
        out = Path(args.out or ROOT / "docs" / "benchmarks" / "engine-merged.json")
        out.write_text(json.dumps(merged, indent=2))
        plot(merged, out.with_suffix(".png"))
        print(f"wrote {out}")
        return
    if args.plot_only:
        plot(json.loads(Path(args.plot_only).read_text()), Path(args.plot_only).with_suffix(".png"))
        return

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    gpu_tag = gpu.split()[1].lower() if torch.cuda.is_available() and len(gpu.split()) > 1 else "cpu"
    if args.compare_quantization:
        compare_quantization(args, gpu, gpu_tag)
        return
    dtype = getattr(torch, args.dtype)
    started = time.perf_counter()
    if args.checkpoint:
        from serve_app.engines.minicpmo.model.loader import load_speech_model
        model = load_speech_model(args.checkpoint, device=args.device, dtype=dtype,
                                  quantization=args.quantization, audio_encoder=args.voices > 0)
    else:
        model = random_speech_model(args.tts_tokenizer, args.device, dtype,
                                    clip_encoder=args.voices > 0)
        quantize_llm(model.llm, args.quantization)
    load_s = time.perf_counter() - started
    print(f"model built in {load_s:.1f} s on {gpu}", flush=True)
    levels = {"read": args.concurrency, "chat": args.chat_concurrency or args.concurrency}
    result = {"gpu": gpu, "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
              "git_commit": git_commit(), "dtype": args.dtype, "quantization": args.quantization,
              "tts_kv_cache_dtype": args.tts_kv_cache_dtype,
              "weights": args.checkpoint or "random, full size",
              "audio_seconds_per_request": args.audio_seconds, "chat_tokens": args.chat_tokens,
              "model_build_s": load_s}

    if args.baseline == "sequential-eager":
        upstream_way = {"no_graphs": True, "steps_per_sync": 1, "profile_phases": False,
                        "one_query_attention": "sdpa"}
        engine = build_engine(model, argparse.Namespace(**{**vars(args), **upstream_way}), 1)
        base = {}
        for mode in args.modes:
            single, runs = single_stream(engine, mode, args)
            single["max_realtime_streams"] = 1 if all(r["ok"] for r in runs) else 0
            base[mode] = single
        engine.close()
        result["baseline_sequential_eager"] = base

    max_slots = max(max(levels[m]) for m in args.modes)
    engine = build_engine(model, args, max_slots)
    if args.voices:
        result["voice_registration"] = register_voices(engine, args.voices)
        print(json.dumps(result["voice_registration"]), flush=True)
        result["single_stream_voices"] = asyncio.run(single_stream_in_voices(engine, args))
    measured = asyncio.run(measure_engine(engine, args, args.modes, levels))
    engine.close()
    sweep = measured["sweep"]
    result["sweep"] = sweep
    result["single_stream"] = {}
    result["max_realtime_streams"] = {}
    for mode in args.modes:
        result["single_stream"][mode], result["max_realtime_streams"][mode] = headline(sweep, mode)
    result["peak_gpu_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None
    sizes = ModelSizes.of(model, tts_kv_cache_dtype=args.tts_kv_cache_dtype)
    result["model_sizes"] = sizes.as_dict()
    for row in sweep:
        # Phase times: with --profile-phases the device's (a sync ends each phase); otherwise
        # the step log's host clock, where device work may count in the later phase that
        # waits for it (a copy to or from the device waits for all work queued before it).
        timed = row["phase_ms_per_step"] or {name: times["mean"]
                                             for name, times in row["step_phase_ms"].items()}
        row["roofline"] = roofline(sizes, row.pop("device_work"), row["engine_steps"], timed,
                                   row["busy_ms_per_step"], GPUS.get(gpu_tag))
        row["roofline"]["phase_clock"] = "device" if row["phase_ms_per_step"] else "host"
    if "baseline_sequential_eager" in result:
        ratios = {}
        for mode in args.modes:
            b = result["baseline_sequential_eager"][mode]
            s = result["single_stream"][mode]
            ratios[mode] = {"ttfb_speedup": (b["ttfb_ms_p50"] / s["ttfb_ms_p50"]) if s["ttfb_ms_p50"] else None,
                            "realtime_streams_ratio": (result["max_realtime_streams"][mode] / b["max_realtime_streams"])
                            if b["max_realtime_streams"] else None}
        result["versus_baseline"] = ratios
    out = Path(args.out) if args.out else ROOT / "docs" / "benchmarks" / f"engine-{gpu_tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("gpu", "single_stream", "max_realtime_streams")
                      if k in result}, indent=2))
    print(json.dumps(result.get("baseline_sequential_eager"), indent=2))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out}")


def merge_results(results: list[dict]) -> dict:
    """One result from runs of different modes: per-mode tables joined, sweeps concatenated."""
    gpus = {r["gpu"] for r in results}
    commits = {r["git_commit"] for r in results}
    if len(gpus) != 1 or len(commits) != 1:
        raise SystemExit(f"refusing to merge runs of different GPUs or commits: {gpus} {commits}")
    merged = dict(results[0])
    merged["command"] = [r["command"] for r in results]
    merged["sweep"] = [row for r in results for row in r["sweep"]]
    for key in ("single_stream", "baseline_sequential_eager", "versus_baseline"):
        # per mode, the first run that measured it (a run of other levels leaves it empty)
        merged[key] = {}
        for r in results:
            for mode, value in r.get(key, {}).items():
                measured = not isinstance(value, dict) or any(v is not None for v in value.values())
                if measured and mode not in merged[key]:
                    merged[key][mode] = value
    # each run counts the levels it ran; the merged count is the highest level any run held
    merged["max_realtime_streams"] = {
        mode: max(r.get("max_realtime_streams", {}).get(mode, 0) for r in results)
        for mode in {m for r in results for m in r.get("max_realtime_streams", {})}}
    peaks = [r["peak_gpu_memory_gb"] for r in results if r.get("peak_gpu_memory_gb") is not None]
    merged["peak_gpu_memory_gb"] = max(peaks) if peaks else None
    return merged


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed; no plot", flush=True)
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode in ("read", "chat"):
        rows = [r for r in result["sweep"] if r["mode"] == mode and r["arrival"] == "poisson"]
        if not rows:
            continue
        xs = [r["concurrency"] for r in rows]
        for q in ("p50", "p99"):
            left.plot(xs, [r[f"ttfb_ms_{q}"] for r in rows], marker="o", label=f"{mode} {q}")
        right.plot(xs, [r["realtime_share"] * r["concurrency"] for r in rows], marker="o", label=mode)
    left.set(xscale="log", yscale="log", xlabel="concurrent streams", ylabel="TTFB (ms)",
             title=f"TTFB, Poisson arrivals ({result['gpu']})")
    left.axhline(500, color="grey", linestyle="--")
    right.set(xscale="log", xlabel="concurrent streams", ylabel="real-time streams",
              title="streams that never ran dry")
    left.legend()
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
