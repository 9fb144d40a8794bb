"""Ray's own autoscaler launches a GPU-like worker node under load and terminates it after.

A short run of scripts/autoscaler_nodes: a head running Ray's autoscaler (v2) over Ray's fake
multi-node provider, nothing else started by hand; the Synthesizer's own policy asks for a second
replica that no node can place, the autoscaler adds a node, and removes one once Serve gave the
replica back. No stream may fail or be cut.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet.autoscaling_cluster import AutoscalingLocalCluster, GPU_WORKER_TYPE
from tests.fleet.fleet_runs import run_fleet_script


def test_autoscaling_config_is_valid_for_rays_autoscaler() -> None:
    """The config the head's autoscaler reads passes Ray's own checks (schema and defaults)."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    cluster = AutoscalingLocalCluster(min_workers=1, max_workers=2)
    try:
        config = prepare_config(cluster.autoscaling_config())
        validate_config(config)
    finally:
        cluster.stop()
    worker = config["available_node_types"][GPU_WORKER_TYPE]
    assert (worker["min_workers"], worker["max_workers"]) == (1, 2)
    assert worker["resources"]["gpu_like"] == 1
    assert config["provider"]["module"].endswith("FakeMultiNodeProvider")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_autoscaler_adds_and_removes_a_gpu_like_node_without_failed_streams(tmp_path: Path
                                                                            ) -> None:
    done, report, leftovers = run_fleet_script(
        "autoscaler_nodes", tmp_path / "autoscaler-nodes.json",
        ["--peak-streams", "12", "--ramp-up-s", "5", "--hold-s", "15", "--ramp-down-s", "2",
         "--low-s", "10", "--downscale-delay-s", "5", "--idle-timeout-s", "5",
         "--settle-timeout-s", "240"], timeout_s=840)
    assert done.returncode == 0, (report.get("error"), done.stdout[-3000:])
    assert leftovers == [], "the run left Ray processes behind"
    assert report["launched_by"] == "ray-autoscaler"
    # Up to two GPU-like nodes and back to one, each change the autoscaler's own decision.
    assert max(report["nodes_went"]) == 2 and report["nodes_went"][-1] == 1
    assert report["replicas_went"][:2] == [1, 2] and report["replicas_went"][-1] == 1
    assert report["node_terminated"] is True
    launches = report["node_launches"]
    assert len(launches) >= 2 and all(launch["node_up_s"] is not None for launch in launches)
    assert any(e["event"] == "terminate" for e in report["autoscaler_events"])
    assert report["streams"] > 0
    assert (report["failed_streams"], report["cut_streams"]) == (0, 0), report["errors"]
