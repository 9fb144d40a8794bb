"""The head node dies mid-stream on a cluster with GCS fault tolerance in a real Redis: what the
streams in flight, the requests made while it is down, and the cluster after it returns see.

    scripts/head_loss [--out docs/benchmarks/head-loss.json]

A cluster laid out as deploy/kuberay/'s RayServices lay it out, on one machine: a head that runs
no replica (``--num-cpus 0``: Ray's GCS, Serve's controller, the dashboard), a CPU node with the
Ingress (it asks for the ``front`` resource only that node has) and a GPU-like node with the
Synthesizer (Piper, ``serve_config.cluster_demo.yaml`` as the fleet runs pace it). Clients reach
the CPU node's HAProxy only, as KubeRay's serve Service leaves the head out. The head keeps the
cluster's state in a ``redis-server`` started here (Debian's, with a password), through
``RAY_REDIS_ADDRESS`` and ``RAY_external_storage_namespace``, and the workers wait up to 600 s for
their GCS to come back (``RAY_gcs_rpc_server_reconnect_timeout_s``, what KubeRay sets on workers
with gcsFaultToleranceOptions).

1. ``--streams-per-kind`` long streams over each of plain HTTP, SSE and the WebSocket start and
   run until each has its first audio.
2. Every process of the head (GCS, raylet, dashboard, Serve's controller, its proxy and HAProxy)
   is SIGKILLed at once, as when its pod goes.
3. While it is down (``--down-s``), a short request over each kind starts every
   ``--interval-s``: requests made during the outage.
4. A new head starts on the same GCS port, Redis and namespace (KubeRay's new head pod); the
   run waits for every stream to end and for Serve to report the app RUNNING again, then makes
   one more request over each kind.

Required: no stream in flight at the loss is lost (``streams_lost`` 0), no request during the
outage fails (``requests_failed_during_outage`` 0) and the cluster recovers (``recovered``).
JSON with those, ``gcs_down_s``, every stream and request, commit and machine. Exits 0 when all
holds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fleet.autoscaling_cluster import FRONT
from fleet.cluster_demo import deploy_config, wait_until
from fleet.local_cluster import LocalCluster, Node
from fleet.scenario import (
    SYNTHESIZER,
    add_run_args,
    connect_driver,
    deployment_config,
    fleet_app_config,
    log_to_screen,
    report_run,
)
from harness.local_ray import free_ports
from harness.service import APP_NAME, haproxy_env_of_its_own, haproxy_files_in
from harness.stream_clients import KINDS, StreamOutcome, count_outcomes, monotonic_clock, one_stream
from loadtest.corpus import LONG, SHORT

LONG_TEXT = " ".join(LONG)  # about a minute of speech, held as long as it plays
REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
# KubeRay's value for workers under gcsFaultToleranceOptions (DefaultWorkerRayGcsReconnectTimeoutS).
WORKER_GCS_RECONNECT_S = 600


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/head_loss",
                                     description=__doc__.split("\n\n")[0])
    add_run_args(parser, "head-loss.json", 2, 300.0,
                 "long streams over each of http, sse and ws before the loss")
    parser.add_argument("--after-first-audio-s", type=float, default=3.0,
                        help="the head dies this long after every long stream had audio")
    parser.add_argument("--down-s", type=float, default=20.0,
                        help="the head stays down this long before a new one starts")
    parser.add_argument("--interval-s", type=float, default=5.0,
                        help="a short request over each kind this often while it is down")
    parser.add_argument("--recover-timeout-s", type=float, default=240.0)
    return parser.parse_args(argv)


class RedisServer:
    """``redis-server`` on a free port with a password, its data in a folder of its own."""

    def __init__(self, folder: Path) -> None:
        if not Path(REDIS_SERVER).is_file():
            raise RuntimeError("no redis-server: apt-get install redis-server")
        [self.port] = free_ports(1)
        self.password = secrets.token_hex(16)
        self.folder = folder
        self.process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        config = self.folder / "redis.conf"
        config.write_text(f"port {self.port}\nbind 127.0.0.1\nrequirepass {self.password}\n"
                          f"dir {self.folder}\nsave \"\"\nappendonly no\n")
        config.chmod(0o600)
        self.process = subprocess.Popen([REDIS_SERVER, str(config)], start_new_session=True,
                                        stdout=(self.folder / "redis.log").open("w"),
                                        stderr=subprocess.STDOUT)
        if not wait_until(self.answers, 20, 0.2):
            raise RuntimeError(f"redis-server did not answer on {self.address}")

    def _cli(self, *command: str) -> str:
        """``redis-cli`` (Debian's redis-tools, beside the server) against this server."""
        done = subprocess.run([REDIS_CLI, "-p", str(self.port), "--no-auth-warning", *command],
                              env={**os.environ, "REDISCLI_AUTH": self.password},
                              capture_output=True, text=True, timeout=10)
        return done.stdout.strip()

    def answers(self) -> bool:
        return self._cli("ping") == "PONG"

    def keys_in(self, namespace: str) -> int:
        """Keys Ray's GCS wrote under ``namespace`` (its tables' keys carry it)."""
        output = self._cli("--scan", "--pattern", f"*{namespace}*")
        return len(output.splitlines()) if output else 0

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=10)


class FaultTolerantCluster(LocalCluster):
    """A head with no CPUs and its state in Redis, a ``front`` node and a ``gpu_like`` node,
    each with an HAProxy of its own (ports, config and socket files), as pods each have."""

    def __init__(self, redis: RedisServer) -> None:
        super().__init__(head_cpus=0, worker_cpus=1,
                         worker_resources=[{FRONT: 1.0}, {"gpu_like": 1.0}],
                         include_dashboard=False)
        self.redis = redis
        self.namespace = f"tts-{self.cluster_id}"
        self.http_ports = dict(zip(("head", "worker1", "worker2"), free_ports(3)))
        self.head_starts = 0

    def _node_env(self, name: str) -> dict[str, str]:
        env = {**haproxy_env_of_its_own(), **haproxy_files_in(self.temp_dir / f"haproxy-{name}")}
        if name == "head":
            return {**env, "RAY_REDIS_ADDRESS": self.redis.address,
                    "RAY_external_storage_namespace": self.namespace}
        return {**env, "RAY_SERVE_WORKER_PROXY_HTTP_PORT": str(self.http_ports[name]),
                "RAY_gcs_rpc_server_reconnect_timeout_s": str(WORKER_GCS_RECONNECT_S)}

    def _head_extra_args(self) -> list[str]:
        return ["--redis-password", self.redis.password]

    def _start_head(self) -> None:
        """The first head picks free ports; a later one takes the same GCS port (the head
        Service's address), as a new head pod does."""
        self.head_starts += 1
        if self.head_starts == 1:
            super()._start_head()
            return
        gcs_port = self.gcs_port
        (node_manager, object_manager, client_server, self.dashboard_port, agent_http,
         agent_grpc, runtime_env_agent, metrics) = free_ports(8)
        self._launch("head", [
            "--head", "--port", str(gcs_port), "--temp-dir", str(self.temp_dir),
            "--num-cpus", str(self.head_cpus), "--include-dashboard", "false",
            "--dashboard-port", str(self.dashboard_port),
            "--ray-client-server-port", str(client_server),
            *self._node_ports(node_manager, object_manager, agent_http, agent_grpc,
                              runtime_env_agent, metrics),
            *self._head_extra_args()])

    def head(self) -> Node:
        return next(node for node in self.nodes if node.name == "head")

    def kill_head(self) -> int:
        """SIGKILL the head's ``ray start`` and every process under it at once."""
        import psutil

        head = self.head()
        try:
            processes = [psutil.Process(head.process.pid),
                         *psutil.Process(head.process.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            processes = []
        for process in processes:
            try:
                process.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        head.process.wait()
        self.nodes.remove(head)
        head.log_path.rename(head.log_path.with_suffix(f".lost-{head.process.pid}.log"))
        return len(processes)

    def restart_head(self) -> None:
        # A new head pod starts on a fresh filesystem: the old head's record of the cluster it
        # started goes (`ray start --head` refuses a port that record names while local
        # processes, here the workers', still point at it).
        from ray._private.utils import get_ray_address_file

        Path(get_ray_address_file(str(self.temp_dir))).unlink(missing_ok=True)
        self._start_head()
        # the head first in the list, as start() left it (stop() ends workers first)
        self.nodes.insert(0, self.nodes.pop())


def head_loss_config(port: int) -> dict[str, Any]:
    """The fleet app with a proxy on every node, one Synthesizer and one Ingress."""
    config = fleet_app_config(port)
    config["proxy_location"] = "EveryNode"
    synthesizer = deployment_config(config, SYNTHESIZER)
    synthesizer.pop("autoscaling_config", None)
    synthesizer["num_replicas"] = 1
    return config


async def requests_while_down(base_url: str, clock: Any, down_s: float, interval_s: float,
                              give_up_s: float) -> list[StreamOutcome]:
    tasks, index, started = [], 0, time.monotonic()
    while time.monotonic() - started < down_s:
        for kind in KINDS:
            text = SHORT[index % len(SHORT)]
            tasks.append(asyncio.create_task(one_stream(kind, base_url, text, clock, give_up_s)))
        index += 1
        await asyncio.sleep(interval_s)
    return list(await asyncio.gather(*tasks))


async def drive(args: argparse.Namespace, cluster: FaultTolerantCluster, base_url: str,
                record: dict[str, Any]) -> None:
    clock = monotonic_clock()
    watched: dict[str, StreamOutcome] = {}
    streams = [asyncio.create_task(one_stream(kind, base_url, LONG_TEXT, clock, args.give_up_s,
                                              watched))
               for _ in range(args.streams_per_kind) for kind in KINDS]
    deadline = time.monotonic() + args.give_up_s
    while time.monotonic() < deadline and not (
            len(watched) == len(streams)
            and all(s.first_audio_s is not None for s in watched.values())):
        if any(task.done() for task in streams):
            break
        await asyncio.sleep(0.2)
    await asyncio.sleep(args.after_first_audio_s)
    if any(task.done() for task in streams):
        raise RuntimeError("a long stream ended before the loss: make them longer")
    record["kill_t_s"] = clock()
    record["head_processes_killed"] = cluster.kill_head()
    during = await requests_while_down(base_url, clock, args.down_s, args.interval_s,
                                       args.give_up_s)
    record["restart_t_s"] = clock()
    await asyncio.get_running_loop().run_in_executor(None, cluster.restart_head)
    record["gcs_back_t_s"] = clock()
    record["during_outage"] = during
    record["long_streams"] = list(await asyncio.gather(*streams))
    record["clock"] = clock


def app_running() -> bool:
    from ray import serve

    try:
        app = serve.status().applications.get(APP_NAME)
    except Exception:  # the controller is still coming back
        return False
    return app is not None and str(getattr(app.status, "value", app.status)) == "RUNNING"


def run(args: argparse.Namespace, cluster: FaultTolerantCluster) -> dict[str, Any]:
    base_url = f"http://127.0.0.1:{cluster.http_ports['worker1']}"
    config = head_loss_config(cluster.http_ports["head"])
    connect_driver(cluster)  # before Ray's import: it reads the auth mode once
    import ray

    deploy_config(config)
    if not wait_until(lambda: app_running() and answers(base_url), 300, 1.0):
        raise RuntimeError(f"the app never answered on the CPU node's HAProxy ({base_url})")
    record: dict[str, Any] = {"redis_keys_before": cluster.redis.keys_in(cluster.namespace)}
    # The driver leaves first: a driver loses its own process once its GCS is gone too long.
    ray.shutdown()
    asyncio.run(drive(args, cluster, base_url, record))
    clock = record.pop("clock")
    connect_driver(cluster)
    try:
        recovered = wait_until(lambda: app_running() and answers(base_url),
                               args.recover_timeout_s, 1.0)
        record["recovered_t_s"] = round(clock(), 1) if recovered else None
        after = asyncio.run(requests_while_down(base_url, clock, 0.1, 0.1, args.give_up_s))
    finally:
        ray.shutdown()
    return summarize(record, after, recovered)


def answers(base_url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{base_url}/readyz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def summarize(record: dict[str, Any], after: list[StreamOutcome],
              recovered: bool) -> dict[str, Any]:
    kill_t = record["kill_t_s"]
    streams = record["long_streams"]
    during = record["during_outage"]
    return {
        "streams_in_flight": len(streams),
        "streams_lost": sum(s.outcome != "finished" for s in streams),
        "requests_during_outage": len(during),
        "requests_failed_during_outage": sum(s.outcome != "finished" for s in during),
        "gcs_down_s": round(record["gcs_back_t_s"] - kill_t, 1),
        "recovered": bool(recovered) and all(s.outcome == "finished" for s in after),
        "recovered_s": (round(record["recovered_t_s"] - kill_t, 1)
                        if record.get("recovered_t_s") is not None else None),
        "streams_ended_after_restart": sum(
            s.end_s is not None and s.end_s > record["gcs_back_t_s"] for s in streams),
        "head_processes_killed": record["head_processes_killed"],
        "redis_keys_before": record["redis_keys_before"],
        "outcomes": count_outcomes(streams),
        "streams": [s.as_dict() for s in streams],
        "during_outage": [s.as_dict() for s in during],
        "after_recovery": [s.as_dict() for s in after],
    }


def passed(result: dict[str, Any]) -> bool:
    return (result.get("streams_lost") == 0 and result.get("streams_in_flight", 0) > 0
            and result.get("requests_failed_during_outage") == 0
            and result.get("requests_during_outage", 0) > 0 and result.get("recovered") is True)


def main(argv: list[str] | None = None) -> int:
    log_to_screen()
    args = parse_args(argv)
    redis = RedisServer(Path(f"/tmp/redis-{secrets.token_hex(4)}"))
    redis.start()
    try:
        cluster = FaultTolerantCluster(redis)
        result = report_run(
            "head_loss", "the head node SIGKILLed mid-stream and restarted, GCS fault tolerance "
            "in a real redis-server (Piper, a head without replicas, a CPU and a GPU-like node, "
            "one machine)", cluster, lambda: run(args, cluster), passed, args.out, args.logs,
            ("streams_lost", "requests_failed_during_outage", "gcs_down_s", "recovered",
             "recovered_s"))
    finally:
        redis.stop()
        shutil.rmtree(redis.folder, ignore_errors=True)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
