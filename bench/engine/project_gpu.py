"""Project a measured engine run onto another GPU, on paper (a projection, not a measurement).

Takes a ``python -m bench.engine.run --profile-phases`` JSON (each level's work per step and phase
times) and, per level, carries the step to ``--target`` (see ``bench/engine/roofline.py``,
:func:`project`): each device phase keeps the efficiency it reached on the measured GPU, host
work stays as it was. ``--int4-llm`` swaps the LLM's decoder weights for int4 (what the A10G
profile runs). Two step times per level:

- ``projected_ms_per_step``: every phase as efficient as measured (conservative: phases bound
  by launches or the host, such as DVAE + Vocos, scale less than this in truth);
- ``floor_ms_per_step``: every phase at the target's roofline plus the measured host work (a
  bound no engine beats).

A stream needs ``frames_per_s`` (46.875) frames a second, so a step of ``steps_per_sync`` (5)
frames keeps it real-time while it takes at most 5 / 46.875 = 106.7 ms. Time to first audio
grows with the step: the measured run's p99 TTFB over its step time at the level gives the
projected p99 TTFB. ``max_realtime_streams`` interpolates (and below the lowest level,
extrapolates) the step time linearly in the streams held.

Example: python -m bench.engine.project_gpu docs/benchmarks/history/engine-h100-roofline.json --target a10g \\
    --int4-llm --out docs/benchmarks/a10g-projection.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from bench.engine.roofline import GPUS, ModelSizes, decoder_flops_per_frame, project

ROOT = Path(__file__).resolve().parents[2]

FRAMES_PER_S = 46.875  # 24 kHz audio, 512 samples per code frame
STEPS_PER_SYNC = 5
WINDOW_BUDGET_MS = STEPS_PER_SYNC / FRAMES_PER_S * 1000
TTFB_P99_LIMIT_MS = 500.0


def full_size_sizes(tts_tokenizer: Path) -> ModelSizes:
    """The benchmark model's sizes (full-size random weights), built on the meta device; the
    DVAE + Vocos FLOPs are counted on a CPU copy."""
    from serve_app.engines.minicpmo.model.codec import SpeechDecoder
    from serve_app.engines.minicpmo.model.synthetic import random_speech_model

    model = random_speech_model(tts_tokenizer, "meta", torch.bfloat16)
    return ModelSizes.of(model, decoder_flops=decoder_flops_per_frame(SpeechDecoder().eval()))


def solve_streams(points: list[tuple[int, float]], limit_ms: float) -> float | None:
    """Streams at which the straight line through two (streams, ms) points reaches
    ``limit_ms``: the two around it, or the two nearest when every point is on one side.
    None when the time does not grow with streams."""
    points = sorted(points)
    if len(points) < 2:
        return None
    above = [i for i, (_, ms) in enumerate(points) if ms > limit_ms]
    first = min(max(above[0] - 1, 0), len(points) - 2) if above else len(points) - 2
    (n1, t1), (n2, t2) = points[first], points[first + 1]
    if t2 <= t1:
        return None
    return n1 + (limit_ms - t1) * (n2 - n1) / (t2 - t1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="bench.engine.run --profile-phases JSON")
    parser.add_argument("--target", choices=sorted(GPUS), default="a10g")
    parser.add_argument("--int4-llm", action="store_true", help="the target runs the int4 LLM")
    parser.add_argument("--tts-tokenizer", type=Path, default=ROOT / "tests" / "golden" / "chattts_tokenizer")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    measured = json.loads(args.results.read_text())
    source = next(key for key, gpu in GPUS.items() if key in measured["gpu"].lower())
    sizes = (ModelSizes(**measured["model_sizes"]) if "model_sizes" in measured
             else full_size_sizes(args.tts_tokenizer))
    target_sizes = sizes.with_int4_llm() if args.int4_llm else sizes
    gpu, target = GPUS[source], GPUS[args.target]
    levels = []
    for row in measured["sweep"]:
        roof = row.get("roofline") or {}
        if not roof.get("work_per_step") or not row.get("phase_ms_per_step"):
            continue
        step = project(roof["work_per_step"], row["phase_ms_per_step"], sizes, gpu, target_sizes, target)
        floor_ms = (sum(p["roofline_ms_there"] for p in step["phases"].values())
                    + sum(step["host_ms"].values()))
        ttfb_per_step = row["ttfb_ms_p99"] / row["ms_per_step"] if row.get("ttfb_ms_p99") else None
        levels.append({
            "mode": row["mode"], "arrival": row["arrival"], "concurrency": row["concurrency"],
            "measured_ms_per_step": round(row["ms_per_step"], 2),
            "measured_ttfb_ms_p99": row.get("ttfb_ms_p99"),
            "projected_ms_per_step": step["projected_ms_per_step"],
            "floor_ms_per_step": round(floor_ms, 2),
            "projected_ttfb_ms_p99": (round(ttfb_per_step * step["projected_ms_per_step"], 1)
                                      if ttfb_per_step else None),
            "phases": step["phases"], "host_ms": step["host_ms"]})
    headline = {}
    for mode in sorted({level["mode"] for level in levels}):
        rows = [r for r in levels if r["mode"] == mode]
        step_points = [(r["concurrency"], r["projected_ms_per_step"]) for r in rows]
        ttfb_points = [(r["concurrency"], r["projected_ttfb_ms_p99"]) for r in rows
                       if r["projected_ttfb_ms_p99"] is not None]
        by_window = solve_streams(step_points, WINDOW_BUDGET_MS)
        by_ttfb = solve_streams(ttfb_points, TTFB_P99_LIMIT_MS)
        bounds = [b for b in (by_window, by_ttfb) if b is not None]
        headline[mode] = {"streams_within_window_budget": round(by_window, 1) if by_window else None,
                          "streams_within_ttfb_p99": round(by_ttfb, 1) if by_ttfb else None,
                          "max_realtime_streams": int(min(bounds)) if bounds else None}
    result = {"projection": True,
              "what": f"{measured['gpu']} run projected onto {target.name} "
                      f"({target.bandwidth / 1e9:.0f} GB/s, {target.bf16_flops / 1e12:.0f} TFLOP/s "
                      f"bf16){' with the int4 LLM' if args.int4_llm else ''}; not measured",
              "source": str(args.results), "source_git_commit": measured.get("git_commit"),
              "command": " ".join(["python -m bench.engine.project_gpu"] + sys.argv[1:]),
              "window_budget_ms": round(WINDOW_BUDGET_MS, 1), "ttfb_p99_limit_ms": TTFB_P99_LIMIT_MS,
              "model_sizes": sizes.as_dict(), "target_model_sizes": target_sizes.as_dict(),
              "headline": headline, "levels": levels}
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(json.dumps({"headline": headline, "levels": [
        {k: v for k, v in r.items() if k not in ("phases", "host_ms")} for r in levels]}, indent=1))


if __name__ == "__main__":
    main()
