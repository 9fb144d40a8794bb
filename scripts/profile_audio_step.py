#!/usr/bin/env python3
"""Time the TTS audio window alone on a GPU (no engine loop, no Ray) and profile its kernels.

For each batch size it replays :func:`audio_window` as a CUDA graph (``--steps`` frames per
replay, every row active at position ``--position``) and as eager code, and reports milliseconds
per frame; then it profiles one eager window at the largest batch with ``torch.profiler`` and
lists the kernels that take the most GPU time. The difference between these numbers and the
engine's milliseconds per step (``scripts/bench_engine.py``) is what the step loop adds.

Example: python scripts/profile_audio_step.py --batches 1 64 128 256 512 --steps 5
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from serve_app.engines.minicpmo.audio_step import (  # noqa: E402
    ACTIVE, CALL_FRAMES, COUNTER, EOS_AFTER, FRAME0, PACKED_COLUMNS, POSITION, SEED, STEPS_LEFT,
    TEXT_LEN, WARP, audio_window)
from serve_app.engines.minicpmo.graphs import capture_per_bucket  # noqa: E402
from serve_app.engines.minicpmo.layers import SlotKVCache  # noqa: E402
from serve_app.engines.minicpmo.schedule import NEVER  # noqa: E402
from serve_app.engines.minicpmo.synthetic import random_speech_model  # noqa: E402


def packed_rows(batch: int, args, num_vq: int, device) -> torch.Tensor:
    packed = torch.zeros(batch, PACKED_COLUMNS, dtype=torch.long)
    packed[:, ACTIVE] = 1
    packed[:, FRAME0:FRAME0 + num_vq] = torch.randint(0, 600, (batch, num_vq))
    packed[:, POSITION] = args.position
    packed[:, TEXT_LEN] = 100
    packed[:, CALL_FRAMES] = 10
    packed[:, EOS_AFTER] = NEVER
    packed[:, STEPS_LEFT] = args.steps
    packed[:, WARP] = 1
    packed[:, SEED] = torch.arange(batch)
    packed[:, COUNTER] = 7
    return packed.to(device)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 64, 128, 256, 512])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--positions", type=int, default=1024, help="cache positions per slot")
    parser.add_argument("--position", type=int, default=600, help="where every row is")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tts-tokenizer", default=str(ROOT / "tests" / "golden" / "chattts_tokenizer"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    device = torch.device("cuda")
    model = random_speech_model(args.tts_tokenizer, device, torch.bfloat16)
    tts = model.tts
    cache = SlotKVCache(model.config.tts_shape(), max(args.batches), args.positions, device,
                        torch.bfloat16)
    rows = torch.arange(max(args.batches), device=device)
    gpu = torch.cuda.get_device_name()
    result = {"gpu": gpu, "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
              "steps_per_window": args.steps, "cache_positions": args.positions,
              "row_position": args.position, "batches": []}
    torch.set_grad_enabled(False)
    with torch.inference_mode():
        for batch in args.batches:
            packed = packed_rows(batch, args, tts.config.num_vq, device)
            forward = lambda b, p=packed: audio_window(tts, cache, p, rows[:b], True, args.steps)  # noqa: E731
            graphs = capture_per_bucket([batch], forward)
            graph, _ = graphs[batch]
            graph_ms = elapsed_ms(graph.replay, args.repeats)
            eager_ms = elapsed_ms(lambda: forward(batch), max(args.repeats // 4, 3))
            started = time.perf_counter()
            for _ in range(args.repeats):
                graph.replay()
                torch.cuda.synchronize()
            synced_ms = (time.perf_counter() - started) * 1000 / args.repeats
            row = {"batch": batch, "graph_ms_per_frame": graph_ms / args.steps,
                   "graph_ms_per_window_with_sync": synced_ms,
                   "eager_ms_per_frame": eager_ms / args.steps}
            kv_bytes = cache.bytes_per_slot * batch
            row["kv_bytes_per_frame"] = kv_bytes
            row["kv_read_ms_at_peak_est"] = kv_bytes / {"H100": 3.35e12, "H200": 4.8e12}.get(
                next((k for k in ("H100", "H200") if k in gpu), "H200"), 4.8e12) * 1000
            result["batches"].append(row)
            print(json.dumps(row), flush=True)
            del graphs, graph

        batch = max(args.batches)
        packed = packed_rows(batch, args, tts.config.num_vq, device)
        audio_window(tts, cache, packed, rows[:batch], True, 1)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            audio_window(tts, cache, packed, rows[:batch], True, 1)
            torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events)
    kernels = [{"name": e.key[:120], "calls": e.count, "gpu_us": round(e.self_device_time_total, 1)}
               for e in events[:25]]
    result["profile_one_frame"] = {"batch": batch, "gpu_us_total": round(total, 1), "top_kernels": kernels}
    for k in kernels:
        print(f"{k['gpu_us']:>10.1f} us  {k['calls']:>5}  {k['name']}")
    print(f"total GPU time of one frame at batch {batch}: {total / 1000:.2f} ms")
    tag = gpu.split()[1].lower() if len(gpu.split()) > 1 else "gpu"
    out = Path(args.out) if args.out else ROOT / "docs" / "benchmarks" / f"audio-step-{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
