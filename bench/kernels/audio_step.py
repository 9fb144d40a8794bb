#!/usr/bin/env python3
"""Time the TTS audio window alone on a GPU (no engine loop, no Ray) and profile its kernels.

For each one-query attention kernel (``--attention``), attention span (the whole cache and
the shorter spans the engine captures) and batch size it replays :func:`audio_window` as a CUDA
graph (``--steps`` frames per replay, every row active at position ``--position``, or with
``--spread-positions`` at positions spread evenly up to it, where a kernel that reads only each
row's own keys can skip blocks) and reports milliseconds per frame; a shape that fails (a
compile error, say) is recorded with its error and the rest still run. Then it profiles one
eager frame at the smallest and largest batch with ``torch.profiler`` and lists the kernels
that take the most GPU time. The difference between these numbers and the engine's
milliseconds per step (``bench/engine/run.py``) is what the step loop adds.

Example: python -m bench.kernels.audio_step --batches 1 64 128 256 512 --steps 5
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from serve_app.engines.minicpmo.device.audio_step import (
    AudioStepInputs,
    audio_window,
    key_count_buckets,
)
from serve_app.engines.minicpmo.device.graphs import capture_per_bucket
from serve_app.engines.minicpmo.model import layers
from serve_app.engines.minicpmo.model.layers import SlotKVCache
from serve_app.engines.minicpmo.model.synthetic import random_speech_model
from serve_app.engines.minicpmo.speech_schedule import NEVER

ROOT = Path(__file__).resolve().parents[2]


def packed_rows(batch: int, args, num_vq: int, device) -> AudioStepInputs:
    def column(value) -> torch.Tensor:
        return torch.full((batch,), value, dtype=torch.long)

    if args.spread_positions:  # row i of B about (i + 1) / B of the way from --position-from
        position = args.position_from + (torch.arange(1, batch + 1)
                                          * (args.position - args.position_from)) // batch
    else:
        position = column(args.position)
    return AudioStepInputs(
        active=column(1), bos=column(0), frame=torch.randint(0, 600, (batch, num_vq)),
        position=position, text_len=column(args.text_len), call_frames=column(10),
        eos_after=column(NEVER), warp=column(1), seed=torch.arange(batch), counter=column(7),
        greedy=column(0), steps_left=column(args.steps)).to(device)


def check_ranges_kernel(tts, cache: SlotKVCache, rows: torch.Tensor, args) -> dict:
    """The first TTS layer's attention through the fused visible-ranges kernel against the same
    layer through SDPA over the ranges' mask (torch's rotary embedding and cache write), on
    random keys at the largest batch and the rows' positions: the largest difference of the
    outputs and of the keys each wrote."""
    from serve_app.engines.minicpmo.device.audio_step import audio_visible_ranges
    from serve_app.engines.minicpmo.model.layers import LayerKV, StepInputs, rotary_cos_sin
    from serve_app.engines.minicpmo.model.range_attention import ranges_mask

    cfg = tts.config
    batch = max(args.batches)
    device = cache.keys[0].device
    x = packed_rows(batch, args, cfg.num_vq, device)
    ranges = audio_visible_ranges(x.position, x.position, x.text_len, cfg)
    attention = tts.model.layers[0].self_attn
    keys, values = torch.randn_like(cache.keys[0]), torch.randn_like(cache.values[0])
    dtype = cache.layers[0].dtype
    hidden = torch.randn(batch, 1, cfg.hidden_size, device=device, dtype=dtype)
    cos, sin = rotary_cos_sin(x.position[:, None], attention.head_dim, cfg.rope_theta, dtype)
    step = StepInputs(rows[:batch], x.position[:, None], x.position[:, None],
                      ranges_mask(ranges, keys.shape[2]), ranges=ranges)
    results = {}
    for kernel in ("visible_ranges", "sdpa"):
        attention.one_query_kernel = kernel
        kv = LayerKV(keys.clone(), values.clone(), None, None, dtype)
        results[kernel] = (attention(hidden, cos, sin, kv, step).float(), kv.keys.float())
    attention.one_query_kernel = "visible_ranges"
    (got, got_keys), (want, want_keys) = results["visible_ranges"], results["sdpa"]
    return {"batch": batch, "max_abs_output_diff_vs_sdpa": float((got - want).abs().max()),
            "max_abs_output": float(want.abs().max()),
            "max_abs_written_key_diff": float((got_keys - want_keys).abs().max())}


def kernel_table(prof, attention: str, batch: int) -> dict:
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events)
    kernels = [{"name": e.key[:100], "calls": e.count, "gpu_us": round(e.self_device_time_total, 1)}
               for e in events[:12]]
    print(f"--- one eager frame, attention={attention}, batch {batch}: {total / 1000:.2f} ms of GPU time")
    for k in kernels:
        print(f"{k['gpu_us']:>10.1f} us  {k['calls']:>5}  {k['name']}")
    return {"attention": attention, "batch": batch, "gpu_us_total": round(total, 1), "top_kernels": kernels}


def elapsed_ms(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def time_window(tts, cache: SlotKVCache, rows: torch.Tensor, batch: int, span: int, args) -> float:
    """Milliseconds per frame of the audio window of ``batch`` rows over ``span`` keys, replayed
    as a CUDA graph."""
    packed = packed_rows(batch, args, tts.config.num_vq, cache.keys[0].device)
    forward = lambda b: audio_window(tts, cache, packed, rows[:b], True, args.steps, span)  # noqa: E731
    graph, _ = capture_per_bucket([batch], forward)[batch]
    return elapsed_ms(graph.replay, args.repeats) / args.steps


def time_decode(decoder, batches: list[int], frames: int, repeats: int) -> list[dict]:
    """The DVAE + Vocos decode of ``batch`` pieces of ``frames`` code frames, replayed as a CUDA
    graph, in IEEE fp32 (the engine's default), on TF32 tensor cores (``decode_tf32``) and in
    bf16; the error of each against IEEE fp32 as RMS relative to the signal."""
    import copy

    variants = {"fp32": decoder, "tf32": copy.deepcopy(decoder),
                "bf16": copy.deepcopy(decoder).to(torch.bfloat16)}
    variants["tf32"].allow_tf32 = True
    rows = []
    for batch in batches:
        generator = torch.Generator().manual_seed(batch)
        codes = torch.randint(0, 625, (batch, frames, 4), generator=generator).to(decoder.device)
        reference = None
        for name, variant in variants.items():
            forward = lambda b, v=variant: v.mel_to_audio(v.codes_to_mel(codes[:b]))  # noqa: E731
            row = {"decode": name, "batch": batch, "frames": frames}
            try:
                graph, out = capture_per_bucket([batch], forward)[batch]
                row["graph_ms"] = elapsed_ms(graph.replay, repeats)
            except Exception as error:  # noqa: BLE001 - recorded, and the next one runs
                row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
                continue
            wave = out.float()
            if reference is None:
                reference = wave.clone()
            row["rms_error_relative"] = float((wave - reference).pow(2).mean().sqrt()
                                              / reference.pow(2).mean().sqrt())
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 64, 128, 256, 512])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--positions", type=int, default=1024, help="cache positions per slot")
    parser.add_argument("--position", type=int, default=600, help="where every row is")
    parser.add_argument("--spread-positions", action="store_true",
                        help="rows at positions spread evenly from the start up to --position")
    parser.add_argument("--position-from", type=int, default=0,
                        help="with --spread-positions: the lowest position (303: the first frame)")
    parser.add_argument("--text-len", type=int, default=100, help="TTS text tokens of every row")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--attention", nargs="+", default=["sdpa", "matmul", "flex"],
                        help="one-query attention kernels to compare (layers.set_one_query_attention)")
    parser.add_argument("--tts-tokenizer", default=str(ROOT / "tests" / "golden" / "chattts_tokenizer"))
    parser.add_argument("--spans", nargs="+", type=int, default=None,
                        help="only these attention spans (default: every captured span that "
                             "holds the rows, and the whole cache)")
    parser.add_argument("--no-kernel-profile", action="store_true",
                        help="skip the eager one-frame profile at the smallest and largest batch")
    parser.add_argument("--decode-batches", nargs="*", type=int, default=[],
                        help="also time the DVAE + Vocos decode of this many pieces at once "
                             "(fp32, tf32, bf16), e.g. 16 64")
    parser.add_argument("--decode-frames", type=int, default=29,
                        help="code frames per decoded piece (25 new + 4 of context)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    device = torch.device("cuda")
    model = random_speech_model(args.tts_tokenizer, device, torch.bfloat16)
    tts = model.tts
    cache = SlotKVCache(model.config.tts_shape(), max(args.batches), args.positions, device,
                        torch.bfloat16)
    rows = torch.arange(max(args.batches), device=device)
    gpu = torch.cuda.get_device_name()
    peak = 3.35e12 if "H100" in gpu else 4.8e12
    result = {"gpu": gpu, "command": " ".join(["python -m bench.kernels.audio_step"] + sys.argv[1:]),
              "steps_per_window": args.steps, "cache_positions": args.positions,
              "row_position": args.position, "spread_positions": args.spread_positions,
              "position_from": args.position_from, "text_len": args.text_len,
              "batches": []}
    tag = gpu.split()[1].lower() if len(gpu.split()) > 1 else "gpu"
    out = Path(args.out) if args.out else ROOT / "docs" / "benchmarks" / f"audio-step-{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every row, so a run cut short keeps what it measured
        out.write_text(json.dumps(result, indent=2))

    torch.set_grad_enabled(False)
    spans = sorted({args.positions + 1} | {s for s in key_count_buckets(args.positions + 1)
                                            if s > args.position + args.steps})
    if args.spans:
        spans = [s for s in spans if s in args.spans]
    with torch.inference_mode():
        for attention in args.attention:
            layers.set_one_query_attention(tts, attention)
            for span in spans:
                for batch in args.batches:
                    row = {"attention": attention, "span": span, "batch": batch,
                           "kv_bytes_per_frame": cache.bytes_per_slot * batch * span / (args.positions + 1)}
                    row["kv_read_ms_at_peak_est"] = row["kv_bytes_per_frame"] / peak * 1000
                    try:
                        captured = time.perf_counter()
                        row["graph_ms_per_frame"] = time_window(tts, cache, rows, batch, span, args)
                        row["capture_and_time_s"] = round(time.perf_counter() - captured, 1)
                    except Exception as error:  # noqa: BLE001 - recorded, and the next shape runs
                        row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                    result["batches"].append(row)
                    save()
                    print(json.dumps(row), flush=True)

        if "visible_ranges" in args.attention:
            layers.set_one_query_attention(tts, "visible_ranges")
            result["visible_ranges_check"] = check_ranges_kernel(tts, cache, rows, args)
            print(json.dumps(result["visible_ranges_check"]), flush=True)
        result["profile_one_frame"] = []
        for attention in [] if args.no_kernel_profile else args.attention:
            layers.set_one_query_attention(tts, attention)
            for batch in (min(args.batches), max(args.batches)):
                packed = packed_rows(batch, args, tts.config.num_vq, device)
                try:
                    audio_window(tts, cache, packed, rows[:batch], True, 1)
                    torch.cuda.synchronize()
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                        audio_window(tts, cache, packed, rows[:batch], True, 1)
                        torch.cuda.synchronize()
                except Exception as error:  # noqa: BLE001 - recorded, and the next one runs
                    result["profile_one_frame"].append(
                        {"attention": attention, "batch": batch,
                         "error": f"{type(error).__name__}: {str(error)[:300]}"})
                    continue
                result["profile_one_frame"].append(kernel_table(prof, attention, batch))
        if args.decode_batches:
            result["decode"] = time_decode(model.decoder, args.decode_batches, args.decode_frames,
                                           args.repeats)
    save()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
