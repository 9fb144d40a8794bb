"""The head node lost mid-stream on a cluster with GCS fault tolerance in a real redis-server:
the streams in flight finish, requests while it is down are served, and the cluster recovers
once a new head starts.

A short run of scripts/head_loss: a head with no replica, a CPU node with the Ingress and its
HAProxy (the clients' only way in), a GPU-like node with the Synthesizer (Piper); every process
of the head SIGKILLed while long streams run, a new head on the same port, Redis and namespace.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.fleet.fleet_runs import run_fleet_script

pytestmark = pytest.mark.slow


@pytest.mark.skipif(shutil.which("redis-server") is None,
                    reason="needs Debian's redis-server (.ci/run installs it)")
@pytest.mark.timeout(900)
def test_a_lost_head_loses_no_stream_and_the_cluster_recovers(tmp_path: Path) -> None:
    done, report, leftovers = run_fleet_script(
        "head_loss", tmp_path / "head-loss.json",
        ["--streams-per-kind", "1", "--down-s", "12", "--interval-s", "4"], timeout_s=840)
    assert done.returncode == 0, (report.get("error"), done.stdout[-3000:])
    assert leftovers == [], "the run left processes behind"
    # The head went whole: GCS, raylet, the dashboard's processes and what ran on it.
    assert report["head_processes_killed"] >= 4
    assert report["redis_keys_before"] > 0   # the GCS wrote its tables to that Redis
    assert report["streams_in_flight"] == 3 and report["streams_lost"] == 0
    # the streams outlived the outage: they ended after the new head was up
    assert report["streams_ended_after_restart"] == 3
    assert report["requests_during_outage"] >= 3
    assert report["requests_failed_during_outage"] == 0
    assert report["gcs_down_s"] >= 12
    assert report["recovered"] is True
    assert all(r["outcome"] == "finished" for r in report["after_recovery"])
