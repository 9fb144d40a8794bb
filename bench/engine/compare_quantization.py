"""``--compare-quantization``: bf16 and then the quantized LLM on the same random weights, in one
run: peak GPU memory with 32 concurrent streams, single-stream TTFB, real-time streams over the
levels, and the relative error of the quantized logits."""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import time
from pathlib import Path

import torch

from bench.engine.measure import build_engine, run_level, single_stream
from bench.engine.report import ROOT, realtime_streams
from harness.service import git_commit
from bench.engine.roofline import tensor_bytes
from serve_app.engines.minicpmo.model.layers import SlotKVCache, StepInputs, causal_attend
from serve_app.engines.minicpmo.model.quantization import quantize_llm
from serve_app.engines.minicpmo.model.synthetic import random_speech_model


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
    result = {"gpu": gpu, "command": " ".join(["python -m bench.engine.run"] + sys.argv[1:]),
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
