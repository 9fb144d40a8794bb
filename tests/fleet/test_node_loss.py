"""A GPU-like worker node killed mid-stream: its streams end with a clear error, the others
finish, requests after the loss succeed, and the replica is replaced.

A short run of scripts/node_loss: two Synthesizer replicas on two worker nodes that Ray's
autoscaler launched, long streams over plain HTTP, SSE and the WebSocket on both, then every
process of one node SIGKILLed at once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fleet.fleet_runs import run_fleet_script

pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)
def test_a_lost_node_ends_its_streams_with_an_error_and_nothing_else(tmp_path: Path) -> None:
    done, report, leftovers = run_fleet_script(
        "node_loss", tmp_path / "node-loss.json",
        # Ray's GCS finds the dead node in ~3 s rather than ~10 s: the replacement comes sooner.
        ["--streams-per-kind", "1", "--after-s", "15", "--node-health-check-s", "1"],
        timeout_s=840)
    assert done.returncode == 0, (report.get("error"), done.stdout[-3000:])
    assert leftovers == [], "the run left Ray processes behind"
    # The whole node went: its raylet, its Synthesizer replica and that replica's engine.
    killed = " ".join(report["killed_processes"])
    assert "raylet" in killed and "ServeReplica:tts:Synthesizer" in killed
    assert "serve_app.gpu.engine_process" in killed
    assert report["streams_on_lost_node"] >= 1
    assert report["streams_in_flight_at_loss"] > report["streams_on_lost_node"]
    # Each stream on the lost node ended with a clear error, which the Ingress logged.
    assert report["ended_with_error_on_lost_node"] == report["streams_on_lost_node"]
    assert report["logged_on_lost_node"] == report["streams_on_lost_node"]
    lost = [s for s in report["streams"] if s["on_lost_node"] and s["began_before_loss"]]
    assert all(s["outcome"] == ("cut" if s["kind"] == "http" else "error_event") for s in lost)
    assert report["lost_silently"] == 0
    assert report["failed_elsewhere"] == 0 and report["finished_elsewhere"] >= 1
    assert report["requests_after_loss"] > 0 and report["failed_after_loss"] == 0
    # Serve replaced the replica on a node the autoscaler launched for it.
    assert report["replica_replaced_s"] is not None
    assert report["lost_node"] not in report["replicas_after"].values()
