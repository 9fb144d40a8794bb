"""A Ray cluster on one machine whose worker nodes Ray's own autoscaler launches and terminates.

The head is one ``ray start --head --autoscaling-config=...`` (own ports, private temp dir and
auth token, as :class:`~fleet.local_cluster.LocalCluster`); nothing else is started by hand.
The head runs Ray's autoscaler (v2, as KubeRay's in-tree autoscaler) over Ray's fake multi-node
provider (``ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider``, what
``ray.cluster_utils.AutoscalingCluster`` drives): when a task or actor asks for resources no
node has, the autoscaler picks a node type from ``available_node_types`` and the provider starts
a real raylet for it on this machine; an idle node past ``idle_timeout_minutes`` is terminated.

``AutoscalingCluster`` itself is not used: it runs ``ray stop --force`` (which would end every
Ray on this shared machine) and reads an ``example.yaml`` the Ray wheel does not ship. The
provider is named as an ``external`` module instead, whose defaults are built into Ray.

Every process of the cluster carries :data:`~fleet.local_cluster.MARKER_ENV`, so stopping it
ends the nodes the autoscaler started too. A worker node's raylet and agents also carry the
node's id (``RAY_OVERRIDE_NODE_ID_FOR_TESTING``, set by the provider; Ray strips it from the
workers they start): they and their descendants are the node, which
:meth:`AutoscalingLocalCluster.kill_node` ends at once, as a dead machine would.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet.local_cluster import MARKER_ENV, LocalCluster
from harness.service import haproxy_files_in

logger = logging.getLogger(__name__)

HEAD_NODE_ID = "fffffffffffffffffffffffffffffffffffffffffffffffffff00000"  # the provider's own
NODE_ID_ENV = "RAY_OVERRIDE_NODE_ID_FOR_TESTING"
PROVIDER = "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider"
GPU_LIKE = "gpu_like"  # the custom resource that stands in for a GPU
FRONT = "front"  # a custom resource only the head has: the Ingress asks for it, so it stays there
GPU_WORKER_TYPE = "gpu_like_worker"


@dataclass
class AutoscalingLocalCluster(LocalCluster):
    """A head running Ray's autoscaler; GPU-like worker nodes come and go as it decides."""

    head_cpus: int = 2
    worker_cpus: int = 1
    min_workers: int = 1
    max_workers: int = 2
    idle_timeout_s: float = 15.0
    worker_resources: list[dict[str, float]] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)  # e.g. HAProxy's flag and ports

    def autoscaling_config(self) -> dict[str, Any]:
        """The cluster config the head's autoscaler reads: a head type and one GPU-like type."""
        return {
            "cluster_name": f"fake-{self.cluster_id}",
            "max_workers": self.max_workers,
            "upscaling_speed": 1.0,
            "idle_timeout_minutes": self.idle_timeout_s / 60,
            "provider": {"type": "external", "module": PROVIDER,
                         "gcs_address": self.address, "head_node_id": HEAD_NODE_ID,
                         "launch_multiple": True},  # what AutoscalingCluster sets for v2
            "auth": {"ssh_user": "ray"},  # unused by this provider; the schema wants it
            "head_node_type": "ray.head.default",
            "available_node_types": {
                "ray.head.default": {"resources": {"CPU": self.head_cpus, FRONT: 1000},
                                     "node_config": {}, "max_workers": 0},
                GPU_WORKER_TYPE: {
                    "resources": {"CPU": self.worker_cpus, GPU_LIKE: 1,
                                  "object_store_memory": self.object_store_bytes},
                    "node_config": {}, "min_workers": self.min_workers,
                    "max_workers": self.max_workers},
            },
            "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
            "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [],
            "setup_commands": [], "head_setup_commands": [], "worker_setup_commands": [],
            "head_start_ray_commands": [], "worker_start_ray_commands": [],
        }

    @property
    def env(self) -> dict[str, str]:
        return {**super().env, **self.extra_env,
                # The provider's head id is the same in every such cluster on the machine.
                **haproxy_files_in(self.temp_dir / "haproxy"),
                "RAY_FAKE_CLUSTER": "1",  # the provider refuses to run without it
                "RAY_enable_autoscaler_v2": "1",
                "RAY_CLOUD_INSTANCE_ID": HEAD_NODE_ID,  # v2 matches the head to its instance
                "AUTOSCALER_UPDATE_INTERVAL_S": "1"}  # decide every second, not every 5

    def _head_extra_args(self) -> list[str]:
        config_path = self.temp_dir / "autoscaling.json"
        config_path.write_text(json.dumps(self.autoscaling_config(), indent=1))
        return ["--autoscaling-config", str(config_path), "--resources", json.dumps({FRONT: 1000})]

    @property
    def logs_dir(self) -> Path:
        return self.temp_dir / "session_latest" / "logs"

    def autoscaler_events(self) -> list[dict[str, Any]]:
        """The autoscaler's decisions so far, read from its log (:func:`autoscaler_events`)."""
        path = self.logs_dir / "monitor.log"
        return autoscaler_events(path.read_text(errors="replace") if path.exists() else "")

    def node_pids(self, node_id: str) -> list[int]:
        """Every live process of the node ``node_id``: those started with its id (its raylet
        and agents) and all their descendants (the workers its raylet started, which Ray
        starts without that variable, and their children: a replica's engine process)."""
        import psutil

        pids = set(_pids_with_all({MARKER_ENV: self.cluster_id, NODE_ID_ENV: node_id}))
        for pid in list(pids):
            try:
                pids.update(child.pid for child in psutil.Process(pid).children(recursive=True))
            except psutil.NoSuchProcess:
                pass
        return sorted(pids)

    def kill_node(self, node_id: str) -> list[int]:
        """SIGKILL every process of the node, as when its machine dies (all found first, then
        killed together, so none sees another go and reacts)."""
        pids = self.node_pids(node_id)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        logger.info("killed node %s: %d processes", node_id[-5:], len(pids))
        return pids


def _pids_with_all(wanted: dict[str, str]) -> list[int]:
    needles = {f"{k}={v}".encode() for k, v in wanted.items()}
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = set((entry / "environ").read_bytes().split(b"\0"))
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if needles <= environ and state != "Z":
            pids.append(int(entry.name))
    return pids


def worker_nodes() -> list[dict[str, Any]]:
    """The GPU-like worker nodes Ray's GCS knows, alive and dead (short id: the provider's
    count, ``00001`` for the first worker it launched)."""
    import ray

    return [{"node_id": node["NodeID"], "short_id": node["NodeID"][-5:],
             "alive": bool(node["Alive"])}
            for node in ray.nodes() if node["NodeID"] != HEAD_NODE_ID]


def autoscaler_view(gcs_address: str) -> dict[str, Any]:
    """What Ray's autoscaler reports now (``ray status``'s source): nodes by type and state
    (``RUNNING``/``IDLE`` as it counts them, ``pending`` while being launched, ``failed``),
    launches it has asked the provider for, and the resource demand nothing can place yet."""
    from ray.autoscaler.v2.sdk import get_cluster_status

    status = get_cluster_status(gcs_address)
    nodes: dict[str, dict[str, int]] = {}

    def count(node_type: str, state: str, how_many: int = 1) -> None:
        by_state = nodes.setdefault(node_type or "?", {})
        by_state[state] = by_state.get(state, 0) + how_many

    for node in status.active_nodes + status.idle_nodes:
        count(node.ray_node_type_name, node.node_status or "RUNNING")
    for node in status.pending_nodes:
        count(node.ray_node_type_name or node.instance_type_name, "pending")
    for node in status.failed_nodes:
        count(node.ray_node_type_name or node.instance_type_name, "failed")
    for launch in status.pending_launches:
        count(launch.ray_node_type_name or launch.instance_type_name, "launching", launch.count)
    demand = [{"bundle": {k: v for k, v in request.bundle.items()}, "count": request.count}
              for summary in status.resource_demands.ray_task_actor_demand
              for request in summary.bundles_by_count]
    return {"nodes": nodes, "pending_demand": demand}


EVENT_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\s+INFO \S+ -- (.*)$", re.M)
QUEUED = re.compile(r"New instance QUEUED \(id=([\w-]+), type=(\w+)")
RUNNING = re.compile(r"Update instance \w+->RAY_RUNNING \(id=([\w-]+), type=(\w+), "
                     r"cloud_instance_id=(\w+)")
REMOVING = re.compile(r"Removing (\d+) nodes of type (\w+) \((\w+)\)")
TERMINATING = re.compile(r"NodeProvider: (\w+): Terminating node")


def autoscaler_events(monitor_log: str) -> list[dict[str, Any]]:
    """Ray's autoscaler (v2) decisions in its ``monitor.log``, with their epoch times:
    ``launch`` (an instance of a worker type queued), ``running`` (its Ray node up),
    ``remove`` (it decided to remove nodes of a type, and why) and ``terminate`` (the provider
    told to end a node)."""
    events = []
    for match in EVENT_LINE.finditer(monitor_log):
        at = time.mktime(time.strptime(match[1], "%Y-%m-%d %H:%M:%S")) + int(match[2]) / 1000
        line = match[3]
        if found := QUEUED.search(line):
            events.append({"at": at, "event": "launch", "instance": found[1],
                           "node_type": found[2]})
        elif found := RUNNING.search(line):
            events.append({"at": at, "event": "running", "instance": found[1],
                           "node_type": found[2], "node_id": found[3]})
        elif found := REMOVING.search(line):
            events.append({"at": at, "event": "remove", "count": int(found[1]),
                           "node_type": found[2], "why": found[3]})
        elif found := TERMINATING.search(line):
            events.append({"at": at, "event": "terminate", "node_id": found[1]})
    return events


def node_launches(events: list[dict[str, Any]], node_type: str = GPU_WORKER_TYPE
                  ) -> list[dict[str, Any]]:
    """Each launch of ``node_type``: when decided, the node it became, seconds to its Ray
    node running, and when the provider was told to terminate it (None while it lives)."""
    launches = []
    for launch in (e for e in events if e["event"] == "launch" and e["node_type"] == node_type):
        up = next((e for e in events if e["event"] == "running"
                   and e["instance"] == launch["instance"]), None)
        node_id = up["node_id"] if up else None
        ended = next((e for e in events if e["event"] == "terminate"
                      and node_id is not None and e["node_id"] == node_id), None)
        launches.append({"decided_at": launch["at"], "node_id": node_id,
                         "node_up_s": round(up["at"] - launch["at"], 1) if up else None,
                         "terminated_at": ended["at"] if ended else None})
    return launches
