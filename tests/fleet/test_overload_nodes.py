"""Two Synthesizer replicas admitting by work: more streams than one has room for are spread over
both and none is refused; a burst past both is refused cleanly while Ray's autoscaler adds a
node whose replica then serves.

A short run of scripts/overload_nodes: two replicas on GPU-like nodes that Ray's autoscaler
launched, six streams at once where each replica has room for four (the router must put the
fifth and the sixth where there is room), then three times what both have room for. Every
check is about what happened to the streams and the nodes; how many admitted streams kept real
time depends on what else this machine runs (the run records it, ``admitted_realtime``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fleet.fleet_runs import run_fleet_script

pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)
def test_streams_past_one_replicas_room_are_spread_and_a_burst_is_refused_while_a_node_is_added(
        tmp_path: Path) -> None:
    # The fill leaves two of the eight streams' room free (the router spreads them 3 and 3):
    # with one free (4 and 3), a fresh-clone run of the whole suite on a 2-core machine had the
    # full replica refuse its fourth ("work"): its engine had measured, while the fill arrived,
    # that this machine could not keep four streams real-time, though its idle report said 4.
    done, report, leftovers = run_fleet_script(
        "overload_nodes", tmp_path / "overload-nodes.json",
        ["--burst-s", "8", "--new-replica-timeout-s", "300", "--fill-spare", "2"], timeout_s=840)
    assert report["error"] is None, done.stdout[-3000:]
    assert done.returncode == (0 if report["passed"] else 1)
    assert leftovers == [], "the run left Ray processes behind"
    checks = report["acceptance"]
    # The fill: more streams than either replica had room for, fewer than both: none refused,
    # and both replicas ran some.
    assert checks["fill_more_than_one_replica_holds"]
    assert checks["fill_none_refused"], report["fill"]
    assert checks["fill_ran_on_both_replicas"], report["fill_by_replica"]
    assert sum(report["fill_by_replica"].values()) == report["fill_streams"]
    # The burst: the excess refused at once with 503 and Retry-After, nothing failed or cut.
    assert checks["burst_excess_refused"]
    assert checks["overload_none_failed"], report["overload"]["errors"]
    assert checks["refusals_with_retry_after"], report["overload"]["refusal_statuses"]
    assert set(report["overload"]["refusal_statuses"]) <= {"503", "429"}
    assert checks["no_cut_after_first_byte"]
    # Ray's autoscaler added the node during the burst, and its replica served streams.
    assert not report["third_replica_before_burst"]
    assert checks["node_launched_by_autoscaler"], report["autoscaler_events"]
    assert checks["new_node_replica_served"], report["overload_by_replica"]
