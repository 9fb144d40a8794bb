"""``serve deploy`` of a config that replaces the Synthesizer replicas while streams run: every
stream in flight finishes whole and every request made meanwhile is served.

A short run of scripts/upgrade_drain on a cluster whose GPU-like worker nodes Ray's autoscaler
launched: two Synthesizer replicas, long streams over plain HTTP, SSE and the WebSocket, new
requests all along, then ``serve deploy`` with the Synthesizer's ``ray_actor_options`` changed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fleet.fleet_runs import run_fleet_script

pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)
def test_a_rollout_drops_no_stream_and_fails_no_request(tmp_path: Path) -> None:
    done, report, leftovers = run_fleet_script(
        # Streams of one minute of speech (not three), each held as long as its audio plays
        # (fleet_app_config paces Piper), so the rollout, which waits out the first replica's
        # drain, ends sooner; the change deployed 2 s after each stream has its first audio
        # (not 10), sent as `serve deploy` sends it but from the driver (the first deploy runs
        # the command): the command's own start took up to 23 s on a busy machine. Serve then
        # stops the first replica within seconds, tens of seconds before its streams end (the
        # report's streams_in_flight_when_their_replica_stopped).
        "upgrade_drain", tmp_path / "upgrade.json",
        ["--long-repeats", "1", "--before-deploy-s", "2", "--deploy-in-process"],
        timeout_s=840)
    assert done.returncode == 0, (report.get("error"), done.stdout[-3000:])
    assert leftovers == [], "the run left Ray processes behind"
    assert report["streams_in_flight_at_upgrade"] >= 1
    assert report["dropped_streams"] == 0, report["errors"]
    assert report["failed_requests"] == 0, report["errors"]
    # Both replicas were replaced, and new requests reached the new ones.
    assert report["rollout_s"] is not None and report["new_version_serving_s"] is not None
    assert report["requests_by_version"]["new"] >= 1
    assert report["requests_during_rollout"] >= 1
    # capacity before, during and after: two replicas took new streams before the deploy and
    # after the rollout; during it, at least one (Serve replaces one replica at a time)
    capacity = report["capacity"]
    assert capacity["replicas_before"] == capacity["replicas_after"] == 2, capacity
    assert capacity["replicas_during_min"] >= 1, capacity
    # The streams in flight were served to their end by the old replicas, whole.
    in_flight = [s for s in report["streams"] if s["version"] == "old"]
    assert in_flight and all(s["outcome"] == "finished" for s in in_flight)


def test_capacity_through_a_rollout_counts_the_replicas_taking_new_streams() -> None:
    from fleet.upgrade_drain import capacity

    states = [{"t_s": 0.0, "states": {"RUNNING": 1, "STOPPING": 1, "STARTING": 1}},
              {"t_s": 40.0, "states": {"RUNNING": 2, "STOPPING": 1}},
              {"t_s": 90.0, "states": {"RUNNING": 2}}]
    held = capacity(2, states, slots_per_replica=4)
    assert (held["replicas_before"], held["replicas_during_min"], held["replicas_after"]) == (
        2, 1, 2)
    assert (held["streams_before"], held["streams_during_min"], held["streams_after"]) == (
        8, 4, 8)
