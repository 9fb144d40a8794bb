"""What the served benchmark reports: the rule a level passes, single-stream TTFB and the largest
real-time level, the served figures beside the engine alone's (``--engine-results``), the
machine and commit, parts of a sweep merged, and the PNG."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from harness.service import ROOT

REALTIME_SHARE = 0.99
TTFB_P99_LIMIT_MS = 500.0


def single_stream_voices(sweep: list[dict[str, Any]]) -> dict[str, Any]:
    """Single-stream TTFB p50 in the default voice and in the cloned ones, per mode."""
    out = {}
    for mode in sorted({r["mode"] for r in sweep}):
        ones = [r for r in sweep if r["mode"] == mode and r["concurrency"] == 1]
        default = [r["ttfb_ms_p50"] for r in ones if not r.get("voices")]
        cloned = [r["ttfb_ms_p50"] for r in ones if r.get("voices")]
        out[mode] = {"ttfb_ms_default_voice": default[0] if default else None,
                     "ttfb_ms_cloned_voice": cloned[0] if cloned else None}
    return out


def headline(sweep: list[dict[str, Any]]) -> dict[str, Any]:
    """What the engine benchmark reports: single-stream TTFB (default voice) and the largest
    real-time level."""
    single, best = {}, {}
    for mode in sorted({r["mode"] for r in sweep}):
        ones = [r for r in sweep if r["mode"] == mode and r["concurrency"] == 1
                and not r.get("voices")] or [r for r in sweep if r["mode"] == mode
                                             and r["concurrency"] == 1]
        single[mode] = {"ttfb_ms_p50": ones[0]["ttfb_ms_p50"] if ones else None,
                        "ttfb_ms_p90": ones[0].get("ttfb_ms_p90") if ones else None}
        # A level counts only if every run of it passed (repeats too), as in the engine benchmark.
        runs: dict[int, list[bool]] = {}
        for r in sweep:
            if r["mode"] == mode and r["arrival"] in ("poisson", "single"):
                runs.setdefault(r["concurrency"], []).append(bool(r["ok"]))
        ok = [level for level, passed in runs.items() if all(passed)]
        best[mode] = max(ok) if ok else 0
    return {"single_stream": single, "max_realtime_streams": best}


def compare(result: dict[str, Any]) -> None:
    """Served against engine, per mode, with the acceptance bars of the served-path issue."""
    engine, served = result.get("engine"), result["served"]
    if not engine:
        return
    comparison = {}
    for mode in served["single_stream"]:
        engine_ttfb = engine["single_stream"].get(mode, {}).get("ttfb_ms_p50")
        served_ttfb = served["single_stream"][mode]["ttfb_ms_p50"]
        engine_best = engine["max_realtime_streams"].get(mode, 0)
        served_best = served["max_realtime_streams"].get(mode, 0)
        delta = (served_ttfb - engine_ttfb) if engine_ttfb and served_ttfb else None
        ratio = served_best / engine_best if engine_best else None
        comparison[mode] = {
            "single_stream_ttfb_p50_ms": {"engine": engine_ttfb, "served": served_ttfb,
                                          "served_minus_engine": delta,
                                          "within_20_ms": delta is not None and delta <= 20},
            "max_realtime_streams": {"engine": engine_best, "served": served_best,
                                     "served_over_engine": ratio,
                                     "at_least_95_percent": ratio is not None and ratio >= 0.95}}
    result["comparison"] = comparison


def engine_part(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    data = json.loads(path.read_text())
    return {"single_stream": data["single_stream"],
            "max_realtime_streams": data["max_realtime_streams"], "sweep": data["sweep"],
            "command": data.get("command"), "git_commit": data.get("git_commit"),
            "gpu": data.get("gpu")}


def event_loop(env: dict[str, str]) -> str:
    """The event loop Ray gives the service's replicas here: ``uvloop <version>`` where it is
    installed and not switched off (``RAY_USE_UVLOOP=0`` here or in ``env``, the
    replicas' ``--env``), else ``asyncio``."""
    try:
        import uvloop
    except ImportError:
        return "asyncio"
    setting = env.get("RAY_USE_UVLOOP", os.environ.get("RAY_USE_UVLOOP", "1"))
    if setting.lower() in ("0", "false"):
        return "asyncio"
    return f"uvloop {uvloop.__version__}"


def gpu_name() -> str:
    try:
        return subprocess.check_output(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                       text=True).splitlines()[0].strip()
    except (OSError, subprocess.CalledProcessError):
        return "cpu"


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    if len({p["gpu"] for p in parts}) != 1 or len({p["git_commit"] for p in parts}) != 1:
        raise SystemExit("refusing to merge runs of different GPUs or commits")
    merged = dict(parts[0])
    merged["command"] = [p["command"] for p in parts]
    sweep = [row for p in parts for row in p["served"]["sweep"]]
    merged["served"] = {**headline(sweep), "sweep": sweep}
    engines = [p["engine"] for p in parts if p.get("engine")]
    merged["engine"] = engines[0] if engines else None
    compare(merged)
    return merged


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted(result["served"]["single_stream"])
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.5), squeeze=False)
    for axis, mode in zip(axes[0], modes):
        for label, part, style in (("engine", result.get("engine"), "--"),
                                   ("served", result["served"], "-")):
            rows = [r for r in (part or {}).get("sweep", [])
                    if r["mode"] == mode and r.get("ttfb_ms_p99")]
            for arrival in sorted({r["arrival"] for r in rows}):  # Poisson, burst: what ran
                level = [r for r in rows if r["arrival"] == arrival]
                for q in ("p50", "p99"):
                    axis.plot([r["concurrency"] for r in level],
                              [r[f"ttfb_ms_{q}"] for r in level], style, marker="o",
                              label=f"{label} {arrival} TTFB {q}")
        axis.axhline(TTFB_P99_LIMIT_MS, color="grey", linestyle=":")
        axis.set(xscale="log", yscale="log", xlabel="concurrent streams",
                 ylabel="TTFB (ms)", title=f"{mode}: engine alone vs Serve + HTTP ({result['gpu']})")
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
