"""One level on the engine, measured: its streams submitted at their arrival times, every
chunk's arrival and emission timed, the engine's counters and step log read around the level
(optionally a window of it under ``torch.profiler``); single-stream runs, the sweep over levels,
and cloned voices registered and timed."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import time
from typing import Callable

import torch

from bench.engine.arrivals import arrival_delays, make_request, voice_id
from bench.engine.report import (
    SAMPLE_RATE,
    first_dry_at,
    longest_stall_s,
    percentile,
    slow_step,
    step_phase_percentiles,
    stream_is_realtime,
)
from serve_app.engines.base import SpeechRequest, StreamQueues
from serve_app.engines.minicpmo.engine import EngineOptions, MiniCPMOEngine
from serve_app.engines.minicpmo.model.synthetic import synthetic_voice_clip
# Single-stream TTFB: the median of this many one-stream runs (after one warm-up).
SINGLE_STREAM_RUNS = 7


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
            # when it was submitted and first ran dry (perf_counter): a late stream's moment
            "submitted_s": submitted, "dry_at_s": first_dry_at(arrivals),
            "chunk_times_ms": [round((t - submitted) * 1000, 1) for t, _ in arrivals]}


async def profile_kernels(engine: MiniCPMOEngine, delay_s: float, seconds: float,
                          trace_path: str | None = None) -> dict:
    """``seconds`` of the running level under ``torch.profiler``, from ``delay_s`` after its
    start (the steady state): how busy the GPU was over the window (the kernels' summed time;
    two streams that overlap can make it exceed the window) and the kernels that took the most
    GPU time, with the engine steps the window held. Whether a step is bound by the device or
    by the host that feeds it is this number. ``trace_path``: the window's timeline (kernels
    by CUDA stream, the CUDA runtime calls by host thread) as a gzipped Chrome trace."""
    from torch.profiler import ProfilerActivity, profile

    await asyncio.sleep(delay_s)
    steps_before = engine.stats().steps
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        await asyncio.sleep(seconds)
        torch.cuda.synchronize()
    window_s = time.perf_counter() - started
    steps = engine.stats().steps - steps_before
    if trace_path:
        prof.export_chrome_trace(trace_path + ".gz")  # torch.profiler gzips a .gz path itself
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
    delays = arrival_delays(concurrency, arrival, args.audio_seconds)
    planned = [(make_request(i, mode, args), delay) for i, delay in enumerate(delays)]
    return await measure_level(engine, planned, {"mode": mode, "arrival": arrival,
                                                 "concurrency": concurrency}, args)


async def run_mixed_level(engine: MiniCPMOEngine, read: int, chat: int,
                          args: argparse.Namespace) -> dict:
    """Read and chat streams arriving together: Poisson arrivals of each kind at the rate that
    holds ``read`` read and ``chat`` chat streams, in one level; each kind's real-time share
    and TTFB in ``by_kind``, and ``ok`` only when both kinds hold."""
    planned = [(make_request(i, kind, args), delay)
               for kind, count in (("read", read), ("chat", chat))
               for i, delay in enumerate(arrival_delays(count, "poisson", args.audio_seconds))]
    planned.sort(key=lambda item: item[1])
    return await measure_level(engine, planned, {"mode": "mixed", "arrival": "poisson",
                                                 "concurrency": read + chat, "read": read,
                                                 "chat": chat}, args)


def late_streams(planned: list[tuple[SpeechRequest, float]], results: list[dict],
                 started: float) -> list[dict]:
    """The streams that ran dry: their kind, and when (seconds into the level) each was
    submitted and first ran dry; the first 40 by submission."""
    late = sorted((r["submitted_s"], r["dry_at_s"], request.mode)
                  for (request, _), r in zip(planned, results) if r["dry_at_s"] is not None)
    return [{"kind": kind, "submitted_s": round(at - started, 3), "dry_s": round(dry - started, 3)}
            for at, dry, kind in late[:40]]


def by_kind(planned: list[tuple[SpeechRequest, float]], results: list[dict]) -> dict:
    """Each kind's streams, real-time share and TTFB p50 / p99 (a mixed level's)."""
    kinds: dict[str, list[dict]] = {}
    for (request, _), result in zip(planned, results):
        kinds.setdefault(request.mode, []).append(result)
    return {kind: {"streams": len(rows),
                   "realtime_share": sum(r["realtime"] for r in rows) / len(rows),
                   "ttfb_ms_p50": percentile([r["ttfb_ms"] for r in rows if r["ttfb_ms"]], 50),
                   "ttfb_ms_p99": percentile([r["ttfb_ms"] for r in rows if r["ttfb_ms"]], 99)}
            for kind, rows in kinds.items()}


async def measure_level(engine: MiniCPMOEngine, planned: list[tuple[SpeechRequest, float]],
                        level: dict, args: argparse.Namespace) -> dict:
    """Submit each planned request at its delay and measure the level (``level``: its mode,
    arrival and counts, written first in the summary)."""
    mode, concurrency = level["mode"], level["concurrency"]
    total = len(planned)
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
        profiled = asyncio.ensure_future(profile_kernels(
            engine, args.audio_seconds * 0.8, args.kernel_profile_s,
            getattr(args, "kernel_trace_out", None)))
    results = await asyncio.gather(*(run_one(engine, request, delay)
                                     for request, delay in planned))
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
        **level, "requests": total,
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
        "slowest_steps": [slow_step(r, started)
                          for r in sorted(steps_run, key=lambda r: -r.seconds)[:8]],
        # The late streams (at most 40, by arrival): seconds into the level when each was
        # submitted and when it first ran dry; late streams drying at one moment point at a stall
        # there, drying at their own pace at a load the engine could not carry
        "late_streams": late_streams(planned, results, started),
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
    if mode == "mixed":  # each kind holds on its own
        summary["by_kind"] = by_kind(planned, results)
        held = [(kind["realtime_share"], kind["ttfb_ms_p99"])
                for kind in summary["by_kind"].values()]
    else:
        held = [(realtime_share, summary["ttfb_ms_p99"])]
    summary["ok"] = all(share >= 0.99 and (p99 or 1e9) <= 500 for share, p99 in held)
    summary["sample_request"] = results[0]
    print(json.dumps({k: v for k, v in summary.items() if k != "sample_request"}), flush=True)
    return summary


def build_engine(model, args, max_slots: int) -> MiniCPMOEngine:
    # admission by slots: a level measures what the engine holds with every stream admitted
    # (its capacity); admitting by work is the overload benchmark's (bench/overload/engine.py)
    options = EngineOptions(device=args.device, dtype=args.dtype, max_slots=max_slots,
                            admission="slots",
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
                            prefill_beside_window=getattr(args, "prefill_beside_window",
                                                          False),
                            prefill_stream_of_its_own=getattr(
                                args, "prefill_stream_of_its_own", False),
                            packed_prefill=getattr(args, "packed_prefill", False),
                            first_text_beside_window=getattr(args, "first_text_beside_window",
                                                             False),
                            first_chunk_frames=getattr(args, "first_chunk_frames", None),
                            audio_cuts=getattr(args, "audio_cuts", "planned"),
                            thin_cuts_per_step=getattr(args, "thin_cuts_per_step",
                                                       EngineOptions.thin_cuts_per_step),
                            audio_window_rows=getattr(args, "audio_window_rows",
                                                      EngineOptions.audio_window_rows),
                            llm_step_rows=getattr(args, "llm_step_rows",
                                                  EngineOptions.llm_step_rows),
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


async def measure_mixed(engine: MiniCPMOEngine, args, levels: list[tuple[int, int]]) -> list:
    """The mixed levels (read, chat), in order, after a warm-up of each kind."""
    for mode in ("read", "chat"):
        await run_level(engine, mode, 1, "burst", args)
    return [await run_mixed_level(engine, read, chat, args) for read, chat in levels]
