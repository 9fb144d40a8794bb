"""A rollout to a new version started at the running size keeps capacity: the replicas taking
new streams on the route the clients use never drop below the count before it, no stream in
flight is cut and no request fails.

A short run of scripts/rollout_new_cluster on a cluster whose GPU-like worker nodes Ray's
autoscaler launches: the old app at two Synthesizers with long streams over plain HTTP, SSE and
the WebSocket and new requests all along, the new version deployed beside it from the running
count, the clients switched once it runs, the old app deleted once its streams have ended.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fleet.fleet_runs import run_fleet_script


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_rollout_to_a_new_cluster_at_the_running_size_keeps_capacity(tmp_path: Path) -> None:
    done, written, leftovers = run_fleet_script(
        # Streams of two minutes of speech (not three), so that they still run on the old app
        # when the clients switch (22 s after the rollout began on a quiet machine) and the
        # run is short; each change sent from the driver (`serve deploy`'s own start took up to
        # 23 s on a busy machine).
        "rollout_new_cluster", tmp_path / "upgrade.json",
        ["--long-repeats", "2", "--before-rollout-s", "2", "--deploy-in-process"],
        timeout_s=840)
    report = written["new_cluster_rollout"]
    assert done.returncode == 0, (report.get("error"), done.stdout[-3000:])
    assert leftovers == [], "the run left Ray processes behind"
    # The new app started at the old one's running size, and the clients moved only once all
    # of it ran, while the old app still held streams.
    assert report["replicas_read"] == 2
    assert report["new_replicas_at_switch"] == {"RUNNING": 2}
    assert report["streams_on_old_at_switch"] >= 1
    # A second set of GPU-like nodes while both ran, given back after the old app went.
    assert report["worker_nodes"]["most"] == 4
    capacity = report["capacity"]
    assert capacity["replicas_before"] == 2, capacity
    assert capacity["replicas_during_min"] >= capacity["replicas_before"], capacity
    assert capacity["replicas_after"] >= capacity["replicas_before"], capacity
    assert report["dropped_streams"] == 0, report["errors"]
    assert report["failed_requests"] == 0, report["errors"]
    assert report["requests_by_route"]["old"] >= 1 and report["requests_by_route"]["new"] >= 1
    assert report["old_deleted_s"] is not None
    old_streams = [s for s in report["streams"] if s["route"] == "old"]
    assert old_streams and all(s["outcome"] == "finished" for s in old_streams)


def sample(t_s: float, route: str, old: dict[str, int], new: dict[str, int]) -> dict:
    return {"t_s": t_s, "route": route, "worker_nodes": 2,
            "apps": {"tts": {"status": "RUNNING", "synthesizer": old},
                     "tts-v2": {"status": "RUNNING", "synthesizer": new}}}


def test_capacity_counts_the_replicas_of_the_app_on_the_clients_route() -> None:
    from fleet.rollout_new_cluster import route_capacity

    # Switched once the new app ran both: capacity held.
    held = route_capacity([sample(0.0, "old", {"RUNNING": 2}, {}),
                           sample(12.0, "old", {"RUNNING": 2}, {"STARTING": 2}),
                           sample(30.0, "new", {"RUNNING": 2}, {"RUNNING": 2}),
                           sample(60.0, "new", {}, {"RUNNING": 2})], 10.0, 4)
    assert (held["replicas_before"], held["replicas_during_min"], held["replicas_after"]) == (
        2, 2, 2)
    # Switched to a new app started at its minimum, one replica: the drop shows.
    dropped = route_capacity([sample(0.0, "old", {"RUNNING": 2}, {}),
                              sample(30.0, "new", {"RUNNING": 2}, {"RUNNING": 1}),
                              sample(60.0, "new", {}, {"RUNNING": 2})], 10.0, 4)
    assert (dropped["replicas_before"], dropped["replicas_during_min"],
            dropped["streams_during_min"]) == (2, 1, 4)
