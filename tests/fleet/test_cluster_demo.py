"""Multi-node autoscaling: head + 2 worker `ray start` nodes, Synthesizer 1 -> >= 2 -> 1, no failure

Runs scripts/cluster_demo in its own process (its own Ray cluster, ports and temp dir, so the
session's other Ray instances are untouched) and ends every process it started, even if the
demo is killed on timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from fleet.local_cluster import MARKER_ENV
from harness.local_ray import end_marked_processes, pids_with_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_synthesizer_scales_1_to_2_to_1_across_nodes_without_failures(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    env = {**os.environ, MARKER_ENV: marker}
    env.pop("RAY_ADDRESS", None)
    timeline = tmp_path / "timeline.json"
    try:
        result = subprocess.run(
            [str(ROOT / "scripts" / "cluster_demo"), "--out", str(timeline),
             "--logs", str(tmp_path / "logs"),
             # two replicas running is the event; the heavy load need not hold them 8 s more
             "--hold-s", "2"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=540, check=False)
    finally:
        leftovers = end_marked_processes(MARKER_ENV, marker)
    report = json.loads(timeline.read_text())
    assert result.returncode == 0, (report.get("error"), result.stdout[-3000:])
    assert leftovers == [], "the demo left Ray processes behind"
    assert pids_with_env(MARKER_ENV, marker) == []
    assert report["nodes"] == ["head", "worker1", "worker2"]
    assert report["checks"] == {"started_with_1_replica": True, "scaled_up_to_at_least_2": True,
                                "scaled_back_to_1": True, "no_failed_streams": True}
    running = [sample["running"] for sample in report["timeline"]]
    peak = running.index(max(running))
    assert running[0] == 1 and max(running) >= 2 and 1 in running[peak:]
    # Two replicas ran on two different worker nodes at once.
    assert any(len(set(s["replica_nodes"])) >= 2 for s in report["timeline"])
    # Streams were in flight while the second replica was removed, and none failed.
    assert report["phase_stats"]["trickle"]["streams"] >= 1
    assert report["failures"] == []
