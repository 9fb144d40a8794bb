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
import json
import sys
import time
from pathlib import Path

import torch

from bench.engine.compare_quantization import compare_quantization
from bench.engine.measure import build_engine, measure_engine, register_voices, single_stream
from bench.engine.measure import measure_mixed, single_stream_in_voices
from bench.engine.report import ROOT, headline, largest_mixed_held, merge_results, plot
from harness.service import git_commit
from bench.engine.roofline import GPUS, ModelSizes, roofline
from serve_app.engines.minicpmo.engine import EngineOptions
from serve_app.engines.minicpmo.model.layers import ONE_QUERY_KERNELS
from serve_app.engines.minicpmo.model.names import KV_CACHE_DTYPES
from serve_app.engines.minicpmo.model.quantization import QUANTIZATION_MODES, quantize_llm
from serve_app.engines.minicpmo.model.synthetic import random_speech_model


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--modes", nargs="*", default=["read", "chat"])
    parser.add_argument("--mixed", nargs="+", default=[], metavar="READ:CHAT",
                        help="mixed levels: READ read and CHAT chat streams arriving together "
                             "(Poisson each), e.g. 576:192 768:256; max_realtime_streams.mixed "
                             "is the largest where both kinds hold")
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
    parser.add_argument("--llm-step-rows", choices=["streams", "slot_range"],
                        default=EngineOptions.llm_step_rows,
                        help="the chat LLM step's rows (EngineOptions; the A/B)")
    parser.add_argument("--audio-window-rows", choices=["generating", "slot_range"],
                        default=EngineOptions.audio_window_rows,
                        help="the audio window's rows: the generating streams, or every slot "
                             "below the highest (EngineOptions; the A/B)")
    parser.add_argument("--overlap-llm-step", action="store_true",
                        help="chat: launch the LLM step beside the audio window (EngineOptions)")
    parser.add_argument("--thin-cuts-per-step", type=int, default=EngineOptions.thin_cuts_per_step,
                        help="audio cut on demand: streams cut a step at most (EngineOptions)")
    parser.add_argument("--packed-prefill", action="store_true",
                        help="admission prompts packed into one row (EngineOptions.packed_prefill)")
    parser.add_argument("--prefill-stream-of-its-own", action="store_true",
                        help="with --prefill-beside-window: the prefill on a stream of its own")
    parser.add_argument("--first-text-beside-window", action="store_true",
                        help="with --prefill-beside-window: new chat streams' first text in "
                             "their admission step (EngineOptions.first_text_beside_window)")
    parser.add_argument("--prefill-beside-window", action="store_true",
                        help="a busy engine's admission prefill beside the audio window, on the "
                             "LLM step's stream (EngineOptions.prefill_beside_window)")
    parser.add_argument("--gil-switch-intervals-ms", type=float, nargs="+", default=None,
                        help="run each level once per GIL switch interval, in this order (an "
                             "A/B of the engine's 1 ms against Python's default 5 ms)")
    parser.add_argument("--torch-threads", type=int, nargs="+", default=None,
                        help="run each level once per PyTorch CPU thread count, in this order "
                             "(served, Ray sets OMP_NUM_THREADS to the replica's num_cpus)")
    parser.add_argument("--profile-phases", action="store_true",
                        help="time each phase of the engine step (syncs the GPU between phases, "
                             "so it slows the engine down; off for headline numbers)")
    parser.add_argument("--kernel-trace-out", default=None,
                        help="with --kernel-profile-s: the window's timeline as a Chrome trace "
                             "(this path + .gz; the last level profiled writes it)")
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
    result = {"gpu": gpu, "command": " ".join(["python -m bench.engine.run"] + sys.argv[1:]),
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

    mixed = [tuple(int(n) for n in level.split(":")) for level in args.mixed]
    max_slots = max([max(levels[m]) for m in args.modes] + [r + c for r, c in mixed])
    engine = build_engine(model, args, max_slots)
    if args.voices:
        result["voice_registration"] = register_voices(engine, args.voices)
        print(json.dumps(result["voice_registration"]), flush=True)
        result["single_stream_voices"] = asyncio.run(single_stream_in_voices(engine, args))
    measured = asyncio.run(measure_engine(engine, args, args.modes, levels))
    if mixed:
        result["mixed"] = asyncio.run(measure_mixed(engine, args, mixed))
    engine.close()
    sweep = measured["sweep"]
    result["sweep"] = sweep
    result["single_stream"] = {}
    result["max_realtime_streams"] = {}
    for mode in args.modes:
        result["single_stream"][mode], result["max_realtime_streams"][mode] = headline(sweep, mode)
    if mixed:
        result["max_realtime_streams"]["mixed"] = largest_mixed_held(result["mixed"])
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
if __name__ == "__main__":
    main()
