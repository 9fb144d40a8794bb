"""Running a fleet script (scripts/autoscaler_nodes, node_loss, upgrade_drain) from a test: in
its own process, with a marker in its environment, so that every Ray process it started is
ended afterwards even if it was killed on timeout."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

from fleet.local_cluster import MARKER_ENV
from harness.local_ray import end_marked_processes, pids_with_env

ROOT = Path(__file__).resolve().parents[2]


def run_fleet_script(name: str, out: Path, args: list[str], timeout_s: int
                     ) -> tuple[subprocess.CompletedProcess, dict[str, Any], list[int]]:
    """``scripts/<name> --out <out> <args>``; its exit, its JSON and the processes it left
    (ended here)."""
    marker = uuid.uuid4().hex
    env = {**os.environ, MARKER_ENV: marker}
    env.pop("RAY_ADDRESS", None)
    try:
        done = subprocess.run([str(ROOT / "scripts" / name), "--out", str(out),
                               "--logs", str(out.parent / "logs"), *args],
                              cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    finally:
        leftovers = end_marked_processes(MARKER_ENV, marker)
    assert pids_with_env(MARKER_ENV, marker) == []
    return done, json.loads(out.read_text()), leftovers
