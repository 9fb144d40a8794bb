"""Joining bench_serve runs at one and two Synthesizer replicas into the capacity file."""

from __future__ import annotations

import pytest

from bench.served.replica_capacity import join


def run(replicas: int, levels: dict[int, bool], cpu: dict[str, float]) -> dict:
    """A bench_serve result of ``replicas`` fixed replicas whose Poisson read levels passed or
    failed as ``levels`` says."""
    sweep = [{"mode": "read", "arrival": "poisson", "concurrency": level, "ok": ok,
              "cpu_percent_of_a_core": cpu, "cpu_percent_of_a_core_busiest_process": cpu}
             for level, ok in levels.items()]
    best = max((level for level, ok in levels.items() if ok), default=0)
    return {"gpu": "NVIDIA H100 80GB HBM3", "git_commit": "abc", "command": f"run {replicas}",
            "rule": "rule", "served": {"max_realtime_streams": {"read": best}, "sweep": sweep},
            "served_config": {"applications": [{"deployments": [
                {"name": "Synthesizer", "num_replicas": replicas}, {"name": "Ingress"}]}]}}


def test_capacity_per_replica_count_and_front_size() -> None:
    one = run(1, {704: True, 736: False}, {"Ingress": 100.0, "HAProxy": 40.0})
    two = run(2, {1408: True, 1472: False}, {"Ingress": 200.0, "HAProxy": 80.0})
    result = join([two, one], gpus=2)
    assert result["max_realtime_streams"] == {"one_replica": 704, "two_replicas": 1408}
    assert result["two_replicas_over_one_replica"] == 2.0
    assert {row["replicas"] for row in result["sweep"]} == {1, 2}
    front = result["front_sizing"]["two_replicas"]
    assert front["front_cores"] == 2.8 and front["streams"] == 1408
    assert front["front_cores_per_1000_streams"] == round(2.8 * 1000 / 1408, 2)
    assert front["ingress_replicas_per_1000_streams"] == 3  # 1.99 cores at 0.8 a replica


def test_runs_of_different_commits_are_refused() -> None:
    other = run(2, {1408: True}, {})
    other["git_commit"] = "def"
    with pytest.raises(SystemExit):
        join([run(1, {704: True}, {}), other], gpus=2)
