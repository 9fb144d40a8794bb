#!/usr/bin/env python3
"""Benchmark the engine -> replica hop on the CPU: a realistic engine step's outputs sent over
the real socket pair and relayed to per-stream readers, with no GPU and no Ray.

Two processes, as served: this one is the Synthesizer replica (the real
:class:`~serve_app.gpu.engine_client.EngineClient`: its reader thread, its dispatch into
per-stream inboxes, each stream read by a task of its own that relays it as the Synthesizer
does, within its timeouts (``serve_app.hops.within``), and "ships" every chunk onward as Serve
would, ``cloudpickle.dumps``); the child is the engine process (the real
:class:`~serve_app.gpu.engine_process.EngineServer`, serving a stand-in engine whose step thread
hands the sink one step's outputs every ``--step-period-s``: ``--chunks`` chunks of about
``--samples`` float32 samples for as many of ``--streams`` streams, with some first chunks,
finals with usage and errors among them, as at read 704 on an H100).

Per step it reports the CPU each side spent (the engine's step thread in the sink, its sender
thread, the replica's reader thread and event loop; both processes in all) and the wall time
from the engine's sink to the replica's reader, its dispatch and the stream's reader, for the
step's first and last chunk.

It measures whatever ``serve_app`` is importable, so the same script measures an older tree:
``--baseline-tree DIR`` (a checkout of the commit before, e.g. ``git worktree add /tmp/base
<commit>``) runs it there too, alternating with this tree ``--repeats`` times, and writes both:

    python -m bench.engine.wire --baseline-tree /tmp/base --repeats 3 \
        --out docs/benchmarks/history/engine-wire-<commit>.json

Each measurement runs in a fresh process that runs ``wire_hop.py`` (both sides of the hop) by
path with the measured tree first on its ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.engine import wire_hop
from bench.engine.wire_hop import onward


def int16_cost_ms(settings: dict[str, Any], repeats: int = 20) -> float:
    """What converting a step's audio to int16 would cost the engine's step thread (the front's
    own conversion: clip, scale, round, cast), per step."""
    rng = np.random.default_rng(1)
    chunks = [rng.uniform(-1, 1, settings["samples"]).astype(np.float32)
              for _ in range(settings["chunks"])]
    started = time.thread_time()
    for _ in range(repeats):
        for chunk in chunks:
            np.rint(np.clip(chunk, -1.0, 1.0) * 32767.0).astype("<i2")
    return round((time.thread_time() - started) * 1000 / repeats, 3)


def run_in(tree: str | None, settings: dict[str, Any]) -> dict[str, Any]:
    """:func:`wire_hop.measure` in a fresh process importing serve_app from ``tree`` (None:
    this one's)."""
    env = dict(os.environ)
    root = tree or str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p and Path(p).resolve() != Path(root).resolve()])
    out = subprocess.run([sys.executable, wire_hop.__file__, "--measure-once",
                          json.dumps(settings)], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def git_commit(tree: str) -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=tree,
                                       text=True).strip()
    except Exception:
        return "unknown"


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repeated runs of the figures that matter."""
    med = lambda path: round(statistics.median(  # noqa: E731
        _get(run, path) for run in runs), 3)
    return {
        "cpu_ms_per_step": {key: med(("cpu_ms_per_step", key))
                            for key in runs[0]["cpu_ms_per_step"]},
        "replica_process_core_share": med(("replica_process_core_share",)),
        "minor_page_faults_per_step": {key: med(("minor_page_faults_per_step", key))
                                       for key in runs[0]["minor_page_faults_per_step"]},
        "wall_ms_p50": {key: med(("wall_ms", key, "p50")) for key in runs[0]["wall_ms"]},
        "wall_ms_p99": {key: med(("wall_ms", key, "p99")) for key in runs[0]["wall_ms"]},
    }


def _get(run: dict[str, Any], path: tuple[str, ...]) -> float:
    for key in path:
        run = run[key]
    return run  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=704)
    parser.add_argument("--chunks", type=int, default=150, help="audio chunks per step")
    parser.add_argument("--samples", type=int, default=10_000, help="about this many per chunk")
    parser.add_argument("--finals-per-step", type=int, default=2)
    parser.add_argument("--errors-per-step", type=int, default=1)
    parser.add_argument("--steps", type=int, default=100, help="measured steps")
    parser.add_argument("--warmup-steps", type=int, default=5, help="steps before measuring")
    parser.add_argument("--step-period-s", type=float, default=0.08)
    parser.add_argument("--onward", choices=("serve", "none"), default="serve",
                        help="per chunk read: serialize it as Serve would, or nothing")
    parser.add_argument("--busy-step", action="store_true",
                        help="the step thread works (holding the GIL but for a moment at each "
                             "device call) between its hand-offs instead of sleeping, as a GPU "
                             "engine's does")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--baseline-tree", help="a checkout of the commit to compare against")
    parser.add_argument("--out", help="JSON file (default: print only)")
    args = parser.parse_args()
    settings = {key: getattr(args, key) for key in (
        "streams", "chunks", "samples", "finals_per_step", "errors_per_step", "steps",
        "warmup_steps", "step_period_s", "onward", "busy_step")}
    this_tree = str(Path(__file__).resolve().parents[2])
    trees = {"this": this_tree}
    if args.baseline_tree:
        trees = {"baseline": str(Path(args.baseline_tree).resolve()), **trees}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for repeat in range(args.repeats):
        order = list(trees) if repeat % 2 == 0 else list(reversed(trees))
        for name in order:
            run = run_in(trees[name], settings)
            runs[name].append(run)
            print(f"{name} ({git_commit(trees[name])}) run {repeat + 1}: "
                  f"{json.dumps({k: run[k] for k in ('cpu_ms_per_step', 'minor_page_faults_per_step', 'wall_ms')})}",
                  flush=True)
    result = {
        "what": "engine -> replica hop on the CPU (bench/engine/wire.py)",
        "command": "python -m bench.engine.wire " + " ".join(sys.argv[1:]),
        "settings": settings,
        "cpu": os.cpu_count(), "python": sys.version.split()[0], "numpy": np.__version__,
        "onward": onward(args.onward)[1],
        "int16_conversion_ms_per_step": int16_cost_ms(settings),
        "trees": {name: {"commit": git_commit(tree), "summary": summary(runs[name]),
                         "runs": runs[name]} for name, tree in trees.items()},
    }
    for name in trees:
        print(f"{name} ({result['trees'][name]['commit']}) median of {args.repeats}: "
              f"{json.dumps(result['trees'][name]['summary'])}")
    print(f"int16 conversion of a step's audio: {result['int16_conversion_ms_per_step']} ms "
          "of the step thread")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
if __name__ == "__main__":
    main()
