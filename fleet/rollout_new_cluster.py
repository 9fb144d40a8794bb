"""A rollout that keeps capacity: the new version on a cluster of its own, started at the running
size, traffic switched once it all runs, the old one deleted once its streams have ended.

    scripts/rollout_new_cluster [--out docs/benchmarks/upgrade.json]

The production procedure (docs/operations.md, "Upgrading"): KubeRay's ``upgradeStrategy:
NewCluster`` with the RayService written by ``scripts/write_rayservices --gpu-replicas N``, N read
from the running RayCluster: the new cluster starts N GPU pods and its Synthesizer at
``autoscaling_config.initial_replicas`` N, so its application is RUNNING, and KubeRay moves the
serve Service to it, only once N Synthesizers run; the old cluster is deleted
``rayClusterDeletionDelaySeconds`` later, after its streams. Here, on the cluster of
:mod:`fleet.upgrade_drain` (Ray's autoscaler over GPU-like nodes, HAProxy in front, the app
``serve_config.cluster_demo.yaml``), with room for twice the Synthesizers (max 4 nodes):

- *the old cluster* is the app ``tts`` on ``/``, its Synthesizer at two replicas on two nodes
  (scaled out); long streams over plain HTTP, SSE and the WebSocket
  run on it, and a short request over each kind starts every ``--interval-s``, throughout;
- *the new cluster* is the new version (the Synthesizer's ``num_cpus`` changed, as in
  upgrade_drain) as a second application, ``tts-v2`` on ``/v2``, deployed beside the old one
  (``serve deploy`` of both), its Synthesizer autoscaling within the same bounds from
  ``initial_replicas`` N, N the old one's RUNNING replicas read from Serve, as ``--gpu-replicas``
  is read from the RayCluster; no node has room for them, so Ray's autoscaler launches N more;
- *the switch*: new requests go to ``/v2`` (the clients' base URL moves, as the serve Service's
  endpoints do) once Serve reports ``tts-v2`` RUNNING and ``/v2/readyz`` answers through HAProxy
  (as the Service takes a pod once its readiness probe passes; HAProxy learns a new route after
  Serve reports the app); every stream already on ``/`` stays there;
- *the deletion*: once everything on ``/`` has ended, ``serve deploy`` of the new app alone
  deletes the old one, and the autoscaler ends its idle nodes.

Two apps on one Ray cluster stand in for two RayClusters: what the scenario measures is the
new Synthesizers' start (nodes launched, replicas up) and the switch's timing against it, which
the one cluster shows as two would; it does not run KubeRay. Unlike two clusters, the apps share
one HAProxy, which reloads when the new app is added (the local cluster keeps a reloaded-out
HAProxy's streams to their end: ``serve_app/ingress_env.py``). The old app's Synthesizer is held
at two (``num_replicas``, as upgrade_drain's), the size a load had scaled it out to: the scaling
out itself is scripts/autoscaler_nodes' run.

``capacity``: the replicas taking new streams (RUNNING) of the app on the route the clients use,
sampled every second: before the rollout, the fewest from the rollout's start on (through the
switch and the deletion), and at the end. Required: ``during_min`` and ``after`` at least ``before``, every stream in
flight finished whole (``dropped_streams`` 0), every request served (``failed_requests`` 0).
The JSON goes under ``new_cluster_rollout`` in ``--out``, beside upgrade_drain's in-place run.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from fleet.autoscaling_cluster import AutoscalingLocalCluster, worker_nodes
from fleet.cluster_demo import wait_until
from fleet.scenario import (
    APP_NAME,
    DEMO_CONFIG,
    ROOT,
    SYNTHESIZER,
    NewRequests,
    add_run_args,
    connect_driver,
    deployment_config,
    fleet_app_config,
    log_to_screen,
    report_run,
    stream_replicas,
    two_replica_config,
    until_under_way,
    wait_for_two_replicas,
)
from fleet.upgrade_drain import (
    LONG_REPEATS,
    NEW_CLUSTER_KEY,
    OLD_CPUS,
    capacity,
    long_audio_s,
    long_text,
    new_config,
    serve_deploy,
)
from harness.local_ray import free_ports
from harness.service import haproxy_env_of_its_own, replica_states
from harness.stream_clients import KINDS, StreamOutcome, count_outcomes, monotonic_clock, one_stream

NEW_APP, NEW_PREFIX = "tts-v2", "/v2"
# The GPU profile's: the new Synthesizers, started at the running size, are kept while the load
# that had scaled the old ones out may come back (the demo's 5 s would let them go at once).
PRODUCTION_CONFIG = ROOT / "serve_config.yaml"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/rollout_new_cluster",
                                     description=__doc__.split("\n\n")[0])
    add_run_args(parser, "upgrade.json", 1, 400.0,
                 "long streams over each of http, sse and ws in flight at the rollout")
    parser.add_argument("--interval-s", type=float, default=10.0,
                        help="a new request over each kind starts this often")
    parser.add_argument("--before-rollout-s", type=float, default=10.0,
                        help="once every long stream has audio, new requests run this long on "
                             "the old app before the new one is deployed")
    parser.add_argument("--deploy-in-process", action="store_true",
                        help="submit each config as `serve deploy` does from this process")
    parser.add_argument("--long-repeats", type=int, default=LONG_REPEATS,
                        help="a long stream's text is the corpus' long paragraphs this many "
                             "times over (3: about three minutes of speech)")
    parser.add_argument("--switch-timeout-s", type=float, default=420.0,
                        help="the new app must be RUNNING within this")
    parser.add_argument("--nodes-back-timeout-s", type=float, default=120.0,
                        help="after the deletion, wait this long at most for the autoscaler to "
                             "end the old app's idle nodes")
    return parser.parse_args(argv)


def new_cluster_app(old: dict[str, Any], replicas: int) -> dict[str, Any]:
    """The new version (upgrade_drain's change) as an app of its own on :data:`NEW_PREFIX`, its
    Synthesizer autoscaling within the demo's bounds from ``initial_replicas`` ``replicas``, as
    ``write_rayservices --gpu-replicas`` writes it, with the GPU profile's downscale delay."""
    [app] = copy.deepcopy(new_config(old))["applications"]
    app.update(name=NEW_APP, route_prefix=NEW_PREFIX)
    synthesizer = next(d for d in app["deployments"] if d["name"] == SYNTHESIZER)
    synthesizer.pop("num_replicas")
    scaling = copy.deepcopy(deployment_config(fleet_app_config(0, DEMO_CONFIG), SYNTHESIZER)
                            ["autoscaling_config"])
    production = yaml.safe_load(PRODUCTION_CONFIG.read_text())
    scaling["initial_replicas"] = replicas
    scaling["downscale_delay_s"] = deployment_config(production, SYNTHESIZER)[
        "autoscaling_config"]["downscale_delay_s"]
    synthesizer["autoscaling_config"] = scaling
    return app


def with_apps(config: dict[str, Any], *apps: dict[str, Any]) -> dict[str, Any]:
    return {**config, "applications": list(apps)}


def app_status(name: str) -> str | None:
    from ray import serve

    app = serve.status().applications.get(name)
    return None if app is None else str(getattr(app.status, "value", app.status))


def answers_ready(base_url: str) -> bool:
    """The route answers the app's readiness (the new route's requests reach the new app: until
    HAProxy has it, they go to the old app on ``/``, which answers 404)."""
    try:
        return httpx.get(f"{base_url}/readyz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def sample(t_s: float, route: str) -> dict[str, Any]:
    """The route the clients use, each app's status and Synthesizer replicas, the live
    GPU-like nodes."""
    return {"t_s": round(t_s, 1), "route": route,
            "apps": {name: {"status": app_status(name), "synthesizer": replica_states(name)}
                     for name in (APP_NAME, NEW_APP)},
            "worker_nodes": sum(node["alive"] for node in worker_nodes())}


async def keep_sampling(samples: list[dict[str, Any]], clock: Any, route: Any,
                        stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append(await asyncio.to_thread(sample, clock(), route()))
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except TimeoutError:
            pass


async def drive(args: argparse.Namespace, cluster: AutoscalingLocalCluster, urls: dict[str, str],
                deploy: Any, old: dict[str, Any], record: dict[str, Any]) -> None:
    clock = monotonic_clock()
    watched: dict[str, StreamOutcome] = {}
    long_streams = [asyncio.create_task(one_stream(kind, urls["old"], long_text(args), clock,
                                                   args.give_up_s, watched))
                    for _ in range(args.streams_per_kind) for kind in KINDS]
    requests = NewRequests(urls["old"], clock, args.give_up_s, args.interval_s)
    samples: list[dict[str, Any]] = []
    sampled = asyncio.Event()
    sampler = asyncio.create_task(keep_sampling(
        samples, clock, lambda: "new" if requests.base_url == urls["new"] else "old", sampled))
    await until_under_way(watched, len(long_streams), args.give_up_s)
    requester = asyncio.create_task(requests.keep_going())
    await asyncio.sleep(args.before_rollout_s)
    # N: the old app's RUNNING Synthesizers, as --gpu-replicas is read from the RayCluster.
    running = (await asyncio.to_thread(replica_states, APP_NAME)).get("RUNNING", 0)
    [old_app] = old["applications"]
    new_app = new_cluster_app(old, running)
    record.update(replicas_read=running, rollout_t_s=clock(), new_app=new_app)
    await asyncio.to_thread(deploy, with_apps(old, old_app, new_app), "old-and-new")
    deadline = time.monotonic() + args.switch_timeout_s
    if await asyncio.to_thread(wait_until, lambda: app_status(NEW_APP) == "RUNNING",
                               args.switch_timeout_s, 1.0):
        record["new_running_t_s"] = clock()
    if "new_running_t_s" in record and await asyncio.to_thread(
            wait_until, lambda: answers_ready(urls["new"]), deadline - time.monotonic(), 0.5):
        record["switch_t_s"] = clock()
        requests.base_url = urls["new"]
        record["new_replicas_at_switch"] = (await asyncio.to_thread(replica_states, NEW_APP))
        # rayClusterDeletionDelaySeconds: the old app goes once all it holds has ended.
        on_old = [t for t, url in zip(requests.tasks, requests.routes) if url == urls["old"]]
        record["on_old_at_switch"] = sum(not t.done() for t in long_streams + on_old)
        await asyncio.gather(*long_streams, *on_old)
        record["old_idle_t_s"] = clock()
        await asyncio.to_thread(deploy, with_apps(old, new_app), "new-only")
        if await asyncio.to_thread(wait_until, lambda: app_status(APP_NAME) is None, 120, 1.0):
            record["old_deleted_t_s"] = clock()
        # The autoscaler ends the old app's idle nodes; new requests still come meanwhile.
        await asyncio.to_thread(wait_until, lambda: sum(n["alive"] for n in worker_nodes())
                                <= running, args.nodes_back_timeout_s, 2.0)
        await asyncio.sleep(args.interval_s)
    requests.stop()
    await requester
    sampled.set()
    await sampler
    record["long_streams"] = list(await asyncio.gather(*long_streams))
    record["new_requests"] = await requests.outcomes()
    record["request_routes"] = ["new" if url == urls["new"] else "old" for url in requests.routes]
    record["samples"] = samples
    record["placed"] = {**stream_replicas(cluster.logs_dir),
                        **stream_replicas(cluster.logs_dir, app=NEW_APP)}


def serving(sample_: dict[str, Any]) -> int:
    """Replicas taking new streams on the route the clients use in ``sample_``."""
    app = NEW_APP if sample_["route"] == "new" else APP_NAME
    return sample_["apps"][app]["synthesizer"].get("RUNNING", 0)


def timeline(samples: list[dict[str, Any]], start_t: float) -> list[dict[str, Any]]:
    """The samples as they changed (the time aside), on the rollout's clock."""
    folded: list[dict[str, Any]] = []
    for row in samples:
        view = {k: v for k, v in row.items() if k != "t_s"}
        if not folded or {k: v for k, v in folded[-1].items() if k != "t_s"} != view:
            folded.append({"t_s": round(row["t_s"] - start_t, 1), **view})
    return folded


def route_capacity(samples: list[dict[str, Any]], start: float, slots_per_replica: int
                   ) -> dict[str, Any]:
    """upgrade_drain's ``capacity`` on the route the clients use: before (the last sample
    before ``start``), the fewest from ``start`` on, and after (the last)."""
    before = [s for s in samples if s["t_s"] < start]
    return capacity(serving(before[-1]) if before else None,
                    [{"t_s": s["t_s"], "states": {"RUNNING": serving(s)}}
                     for s in timeline([s for s in samples if s["t_s"] >= start], start)],
                    slots_per_replica)


def summarize(record: dict[str, Any], expected_audio_s: float) -> dict[str, Any]:
    start = record["rollout_t_s"]
    switch, deleted = record.get("switch_t_s"), record.get("old_deleted_t_s")
    placed = record["placed"]

    def row(stream: StreamOutcome, route: str) -> dict[str, Any]:
        return {**stream.as_dict(), "route": route, "replica": placed.get(stream.request_id)}

    long_rows = [row(s, "old") for s in record["long_streams"]]
    in_flight = [r for r in long_rows if r["first_audio_s"] is not None
                 and r["first_audio_s"] < start and (r["end_s"] or 1e9) > start]
    dropped = [r for r in in_flight if r["outcome"] != "finished"
               or r["audio_s"] < 0.95 * expected_audio_s]
    new_rows = [row(s, route) for s, route in zip(record["new_requests"], record["request_routes"])]
    failed = [r for r in new_rows if r["outcome"] != "finished"]
    during = [s for s in record["samples"] if s["t_s"] >= start]
    nodes = [s["worker_nodes"] for s in during]

    def since_start(t: float | None) -> float | None:
        return None if t is None else round(t - start, 1)

    return {
        "replicas_read": record["replicas_read"],
        "streams_in_flight_at_rollout": len(in_flight),
        "streams_on_old_at_switch": record.get("on_old_at_switch"),
        "dropped_streams": len(dropped),
        "failed_requests": len(failed),
        "new_running_s": since_start(record.get("new_running_t_s")),
        "switch_s": since_start(switch),
        "new_replicas_at_switch": record.get("new_replicas_at_switch"),
        "old_idle_s": since_start(record.get("old_idle_t_s")),
        "old_deleted_s": since_start(deleted),
        "requests": len(new_rows),
        "requests_during_rollout": sum(start <= r["start_s"] <= (deleted or 1e9) for r in new_rows),
        "requests_by_route": {route: sum(r["route"] == route for r in new_rows)
                              for route in ("old", "new")},
        "worker_nodes": {"before": nodes[0] if nodes else None, "most": max(nodes, default=None),
                         "after": nodes[-1] if nodes else None},
        "long_stream_expected_audio_s": round(expected_audio_s, 2),
        "outcomes_long": count_outcomes(record["long_streams"]),
        "outcomes_new_requests": count_outcomes(record["new_requests"]),
        "errors": sorted({r["error"] or r["outcome"] for r in dropped + failed})[:10],
        "capacity": route_capacity(record["samples"], start, record["slots_per_replica"]),
        "timeline": timeline(during, start),
        "streams": long_rows,
        "new_request_rows": new_rows,
    }


def passed(result: dict[str, Any]) -> bool:
    held = result["capacity"]
    return (result["streams_in_flight_at_rollout"] > 0 and result["dropped_streams"] == 0
            and result["failed_requests"] == 0 and result["old_deleted_s"] is not None
            and result["requests_by_route"]["new"] > 0
            and held["replicas_before"] == result["replicas_read"] > 0
            and held["replicas_during_min"] >= held["replicas_before"]
            and held["replicas_after"] >= held["replicas_before"])


def run(args: argparse.Namespace, cluster: AutoscalingLocalCluster, work: Path
        ) -> dict[str, Any]:
    connect_driver(cluster)
    import ray

    try:
        [port] = free_ports(1)
        urls = {"old": f"http://127.0.0.1:{port}", "new": f"http://127.0.0.1:{port}{NEW_PREFIX}"}
        dashboard_url = f"http://127.0.0.1:{cluster.dashboard_port}"
        old = two_replica_config(port)
        deployment_config(old, SYNTHESIZER)["ray_actor_options"]["num_cpus"] = OLD_CPUS

        def deploy(config: dict[str, Any], name: str) -> str:
            return serve_deploy(config, dashboard_url, work, name, args.deploy_in_process)

        serve_deploy(old, dashboard_url, work, "old")
        wait_for_two_replicas(urls["old"])
        expected_audio_s = long_audio_s(urls["old"], long_text(args))
        [app] = old["applications"]
        record: dict[str, Any] = {
            "slots_per_replica": app["args"]["engine_options"]["max_batch_size"]}
        asyncio.run(drive(args, cluster, urls, deploy, old, record))
        result = summarize(record, expected_audio_s)
        result["new_app"] = {k: record["new_app"][k] for k in ("name", "route_prefix")}
        result["new_synthesizer"] = deployment_config(
            with_apps(old, record["new_app"]), SYNTHESIZER)
        return result
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    log_to_screen()
    args = parse_args(argv)
    # Room for both apps' Synthesizers (2 + 2 nodes); the old app's nodes are ended 30 s idle.
    cluster = AutoscalingLocalCluster(min_workers=1, max_workers=4, idle_timeout_s=30.0,
                                      include_dashboard=True,
                                      extra_env=haproxy_env_of_its_own())
    work = Path(tempfile.mkdtemp(prefix="rollout-new-cluster-"))
    result = report_run(
        "rollout_new_cluster", "a rollout to a new version started at the running size beside "
        "the old one, clients switched once it all runs, the old one deleted after its streams "
        "(two Serve apps on a Ray autoscaler v2 cluster, fake multi-node provider, Piper, one "
        "machine)", cluster, lambda: run(args, cluster, work), passed, args.out, args.logs,
        ("replicas_read", "streams_in_flight_at_rollout", "dropped_streams", "failed_requests",
         "switch_s", "old_deleted_s", "capacity"), under=NEW_CLUSTER_KEY)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
