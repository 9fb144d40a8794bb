"""A real multi-node Ray cluster on one machine: a head and worker nodes, each its own `ray start`.

Every node is a separate ``ray start --block`` process with its own ports, all of them chosen
free up front (never Ray's defaults, which a second cluster on the machine would collide with),
sharing one private temp dir, so ``ray.init()`` elsewhere on the machine never finds this cluster.
The cluster uses token authentication with a token made for this run alone. Every process it
starts carries a marker in its environment; :meth:`LocalCluster.stop` ends exactly those (never
``ray stop``, which would end every Ray on the machine).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from harness.local_ray import end_marked_processes, free_ports

logger = logging.getLogger(__name__)

MARKER_ENV = "LOCAL_RAY_CLUSTER_ID"
RAY = str(Path(sys.executable).parent / "ray")
STARTED_LINE = "Ray runtime started"
START_ATTEMPTS = 5
# On SIGTERM, `ray start --block` first drains its node, for up to this setting's seconds (30 by
# default), so that a load balancer can move traffic off a node that leaves a cluster which goes
# on. :meth:`LocalCluster.stop` ends the whole cluster at once, so nothing can take over: the head
# waited out the drain until the SIGKILL 10 s later, on every stop. 0: Ray's immediate teardown.
SIGTERM_DRAIN_SETTING = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"


def _kill_group(process: subprocess.Popen, sig: int) -> None:
    """Signal the process group a launcher started with ``start_new_session``."""
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class Node:
    name: str
    process: subprocess.Popen
    log_path: Path


@dataclass
class LocalCluster:
    """Head plus ``len(worker_resources)`` workers; use as a context manager (stops on exit)."""

    head_cpus: int = 1
    worker_cpus: int = 1
    worker_resources: list[dict[str, float]] = field(
        default_factory=lambda: [{"gpu_like": 1.0}, {"gpu_like": 1.0}])
    object_store_bytes: int = 100 * 1024 * 1024
    start_timeout_s: float = 180.0
    include_dashboard: bool = False  # `serve deploy` talks to it; else it only costs CPU
    nodes: list[Node] = field(default_factory=list)

    def __post_init__(self) -> None:
        # A caller may pick the marker (LOCAL_RAY_CLUSTER_ID) to clean up after a killed run.
        self.cluster_id = os.environ.get(MARKER_ENV) or secrets.token_hex(8)
        # Short path: Ray's socket paths live under it and Unix sockets allow ~107 bytes.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="rc-", dir="/tmp"))
        self.token_path = self.temp_dir / "auth_token"
        self.token_path.write_text(secrets.token_hex(32))
        self.token_path.chmod(0o600)
        self.gcs_port = 0
        self.dashboard_port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def env(self) -> dict[str, str]:
        """Environment for this cluster's processes and for a driver that joins it."""
        return {
            **os.environ,
            MARKER_ENV: self.cluster_id,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(self.token_path),
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_ADDRESS": self.address,
            SIGTERM_DRAIN_SETTING: "0",
        }

    def start(self) -> LocalCluster:
        try:
            self._start_head()
            for index, resources in enumerate(self.worker_resources, start=1):
                self._start_worker(index, resources)
        except BaseException:
            kept = Path(tempfile.gettempdir()) / f"rc-failed-{self.cluster_id}"
            self.stop(keep_logs_in=kept)
            logger.error("the cluster did not start; its logs are in %s", kept)
            raise
        return self

    def _start_head(self) -> None:
        def args() -> list[str]:
            (self.gcs_port, node_manager, object_manager, client_server, self.dashboard_port,
             agent_http, agent_grpc, runtime_env_agent, metrics) = free_ports(9)
            return [
                "--head", "--port", str(self.gcs_port), "--temp-dir", str(self.temp_dir),
                "--num-cpus", str(self.head_cpus),
                "--include-dashboard", str(self.include_dashboard).lower(),
                "--dashboard-port", str(self.dashboard_port),
                "--ray-client-server-port", str(client_server),
                *self._node_ports(node_manager, object_manager, agent_http, agent_grpc,
                                  runtime_env_agent, metrics),
                *self._head_extra_args(),
            ]

        self._start_node("head", args)

    def _head_extra_args(self) -> list[str]:
        """More ``ray start`` options for the head (a subclass's; called once its ports are
        chosen)."""
        return []

    def _node_env(self, name: str) -> dict[str, str]:
        """More environment for one node's processes (a subclass's: ``head``, ``worker1``...)."""
        return {}

    def _start_worker(self, index: int, resources: dict[str, float]) -> None:
        def args() -> list[str]:
            return ["--address", self.address, "--num-cpus", str(self.worker_cpus),
                    "--resources", json.dumps(resources), *self._node_ports(*free_ports(6))]

        self._start_node(f"worker{index}", args)

    def _start_node(self, name: str, args: Callable[[], list[str]]) -> None:
        # A raylet aborts when its dashboard agent has not reported its port within ~15 s, and
        # `ray start` when the raylet has not registered within 30 s (both fixed in Ray 2.60):
        # a machine busy with other work misses those deadlines now and then, so retry.
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                self._launch(name, args())
                return
            except RuntimeError:
                if attempt == START_ATTEMPTS:
                    raise
                logger.warning("ray node %s failed to start (attempt %d); retrying", name,
                               attempt)

    def _node_ports(self, node_manager: int, object_manager: int, agent_http: int,
                    agent_grpc: int, runtime_env_agent: int, metrics: int) -> list[str]:
        return [
            "--node-manager-port", str(node_manager),
            "--object-manager-port", str(object_manager),
            "--dashboard-agent-listen-port", str(agent_http),
            "--dashboard-agent-grpc-port", str(agent_grpc),
            "--runtime-env-agent-port", str(runtime_env_agent),
            "--metrics-export-port", str(metrics),
            "--object-store-memory", str(self.object_store_bytes),
            "--disable-usage-stats",
            "--include-log-monitor", "false",  # nobody reads worker logs live: save the CPU
        ]

    def _launch(self, name: str, args: list[str], attempts: int = 2) -> None:
        """Start node ``name``; a ``ray start`` that gives up by itself is tried once more (on a
        2-core box at load average 18 one gave up: "the raylet failed to startup or the GCS has
        become overloaded")."""
        for attempt in range(attempts, 0, -1):
            try:
                self._launch_once(name, args)
                return
            except RuntimeError:
                if attempt == 1:
                    raise
                logger.warning("ray node %s did not start; trying once more", name)

    def _launch_once(self, name: str, args: list[str]) -> None:
        log_path = self.temp_dir / f"{name}.log"
        env = {**self.env, **self._node_env(name)}
        if name == "head":
            env.pop("RAY_ADDRESS")
        with log_path.open("w") as log:
            # Own session: its process group is ours to signal, nobody else's.
            process = subprocess.Popen([RAY, "start", "--block", *args], stdout=log,
                                       stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while STARTED_LINE not in log_path.read_text(errors="replace"):
            if process.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-2000:]
                _kill_group(process, signal.SIGKILL)
                process.wait()
                log_path.rename(log_path.with_suffix(f".failed-{process.pid}.log"))
                raise RuntimeError(f"ray node {name} did not start:\n{tail}")
            time.sleep(0.3)
        self.nodes.append(Node(name, process, log_path))
        logger.info("ray node %s started (pid %d)", name, process.pid)

    def stop(self, keep_logs_in: Path | None = None) -> None:
        """End every process this cluster started (workers first), then remove its temp dir
        (its node and session logs copied to ``keep_logs_in`` first, if given)."""
        for node in reversed(self.nodes):
            _kill_group(node.process, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for node in self.nodes:
            try:
                node.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for node in self.nodes:
            _kill_group(node.process, signal.SIGKILL)
            node.process.wait()
        # Actor workers run in sessions of their own; the marker finds them all.
        end_marked_processes(MARKER_ENV, self.cluster_id, grace_s=5.0)
        if keep_logs_in is not None:
            self.copy_logs(keep_logs_in)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def copy_logs(self, destination: Path) -> None:
        destination.mkdir(parents=True, exist_ok=True)
        for node in self.nodes:
            shutil.copy(node.log_path, destination / node.log_path.name)
        session_logs = self.temp_dir / "session_latest" / "logs"
        if session_logs.is_dir():
            shutil.copytree(session_logs, destination / "session", dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("*.sock", "events", "export_events"))

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
