"""A GPU-like worker node dies mid-stream: what its streams, the others and new requests see.

    scripts/node_loss [--out docs/benchmarks/node-loss.json]

The cluster of :mod:`fleet.autoscaler_nodes` (Ray's autoscaler over the fake multi-node
provider, GPU-like worker nodes min 1, max 2; Ray's HAProxy in front), with the Synthesizer at
two replicas, so the autoscaler launches the second node and each node holds one replica. The
Ingress sits on the head (it asks for the head's ``front`` resource), so losing a worker loses
only Synthesizer replicas.

1. ``--streams-per-kind`` long streams over each of plain HTTP, SSE and the WebSocket start,
   and run until each has its first audio; each is traced to its replica, and so its node, by
   the Synthesizer's log line for its first audio.
2. Every process of the node holding the most streams (raylet, its agents, the replica's
   worker and its engine process) is killed with SIGKILL at once, as when a machine dies.
3. From then on a short request over each kind starts every ``--after-interval-s`` for
   ``--after-s``: requests made after the loss.
4. It waits for every stream to end (at most ``--give-up-s``: a stream still open then hung),
   and for Serve to run two Synthesizer replicas again, one of them new, on a node the
   autoscaler launched in place of the dead one.

Required: every stream on the lost node ends with a clear error (an ``error`` event on SSE and
WebSocket, a cut body on plain HTTP), logged by the Ingress; none ends silently or hangs; the
streams on the other node finish; every request after the loss succeeds; the replica is
replaced. It writes those counts (``streams_started``, ``streams_on_lost_node``,
``ended_with_error_on_lost_node``, ``lost_silently``, ``failed_elsewhere``, ``failed_after_loss``,
``replica_replaced_s``), every stream's outcome, the autoscaler's events, commit and machine as
JSON. Exits 0 when all holds.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any


from fleet.autoscaling_cluster import AutoscalingLocalCluster, node_launches, worker_nodes
from fleet.cluster_demo import deploy_config, replica_states, wait_until
from fleet.scenario import (
    APP_NAME,
    add_run_args,
    connect_driver,
    log_to_screen,
    report_run,
    stream_replicas,
    synthesizer_replica_nodes,
    two_replica_config,
    wait_for_two_replicas,
)
from harness.local_ray import free_ports
from harness.service import haproxy_env_of_its_own
from harness.stream_clients import (
    CLEAR_FAILURES,
    KINDS,
    SILENT,
    StreamOutcome,
    count_outcomes,
    monotonic_clock,
    one_stream,
)
from loadtest.corpus import LONG, SHORT


LONG_TEXT = " ".join(LONG)  # ~1000 characters: about a minute of speech, tens of seconds to make


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/node_loss",
                                     description=__doc__.split("\n\n")[0])
    add_run_args(parser, "node-loss.json", 2, 300.0,
                 "long streams over each of http, sse and ws before the loss")
    parser.add_argument("--after-first-audio-s", type=float, default=3.0,
                        help="the node dies this long after every long stream had audio")
    parser.add_argument("--after-s", type=float, default=30.0,
                        help="requests keep starting this long after the loss")
    parser.add_argument("--after-interval-s", type=float, default=8.0,
                        help="(one replica must carry these with the streams left: at a "
                             "replica's max_ongoing_requests a WebSocket session's text cannot "
                             "reach its replica; docs/benchmarks/README.md, 'A node lost')")
    parser.add_argument("--replace-timeout-s", type=float, default=300.0)
    parser.add_argument("--node-health-check-s", type=float, default=None,
                        help="Ray's GCS checks each node this often and marks it dead after "
                             "three misses, so the autoscaler replaces a lost node sooner "
                             "(default: Ray's own, 3 s and five misses)")
    return parser.parse_args(argv)


def process_names(pids: list[int]) -> list[str]:
    """What each process is (``raylet``, ``ray::ServeReplica:tts:Synthesizer``, ...)."""
    import psutil

    names = []
    for pid in pids:
        try:
            command = psutil.Process(pid).cmdline()
        except psutil.NoSuchProcess:
            continue
        names.append(" ".join(command[:3]) if command and command[0].endswith("python")
                     else Path(command[0]).name if command else "?")
    return sorted(names)


def ingress_error_lines(logs_dir: Path) -> list[str]:
    """The ERROR lines of every Ingress replica's log."""
    lines = []
    for path in (logs_dir / "serve").glob(f"replica_{APP_NAME}_Ingress_*.log"):
        lines += [line for line in path.read_text(errors="replace").splitlines()
                  if line.startswith("ERROR ")]
    return lines


async def requests_after_loss(base_url: str, clock: Any, after_s: float, interval_s: float,
                              give_up_s: float) -> list[StreamOutcome]:
    """A short request over each kind every ``interval_s`` for ``after_s``; their outcomes."""
    tasks = []
    started = time.monotonic()
    index = 0
    while time.monotonic() - started < after_s:
        for kind in KINDS:
            text = SHORT[index % len(SHORT)]
            tasks.append(asyncio.create_task(one_stream(kind, base_url, text, clock, give_up_s)))
        index += 1
        await asyncio.sleep(interval_s)
    return list(await asyncio.gather(*tasks))


async def under_way(cluster: AutoscalingLocalCluster, watched: dict[str, StreamOutcome],
                    tasks: list[asyncio.Task], timeout_s: float) -> dict[str, str]:
    """Until every stream has its first audio and is traced to its replica (Serve's log line
    for the call), or one has ended; request id -> replica."""
    deadline = time.monotonic() + timeout_s
    placed: dict[str, str] = {}
    while time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        placed = {i: r for i, r in stream_replicas(cluster.logs_dir).items() if i in watched}
        begun = len(watched) == len(tasks) and all(
            s.first_audio_s is not None for s in watched.values())
        if (begun and len(placed) == len(tasks)) or any(t.done() for t in tasks):
            break
    return placed


async def drive(args: argparse.Namespace, cluster: AutoscalingLocalCluster, base_url: str,
                record: dict[str, Any]) -> None:
    clock = monotonic_clock()
    record["t0_epoch"] = time.time() - clock()
    watched: dict[str, StreamOutcome] = {}
    long_streams: list[asyncio.Task] = []
    replicas_before = synthesizer_replica_nodes()
    counts: dict[str, int] = {}
    # Streams on both nodes: Serve routes each to the less busy of two replicas, so a round can
    # land on one; then another round starts (at most three).
    for _round in range(3):
        long_streams += [asyncio.create_task(one_stream(kind, base_url, LONG_TEXT, clock,
                                                        args.give_up_s, watched))
                         for _ in range(args.streams_per_kind) for kind in KINDS]
        placed = await under_way(cluster, watched, long_streams, args.give_up_s)
        counts = {}
        for replica in placed.values():
            node = replicas_before.get(replica)
            if node:
                counts[node] = counts.get(node, 0) + 1
        if len(counts) >= 2:
            break
    await asyncio.sleep(args.after_first_audio_s)
    if any(t.done() for t in long_streams):
        raise RuntimeError("a long stream ended before the loss: make them longer")
    victim = max(counts, key=counts.get)
    record["replicas_before"] = {r: n[-5:] for r, n in replicas_before.items()}
    record["lost_node"] = victim
    kill_t = clock()
    record["kill_t_s"] = kill_t
    record["killed"] = process_names(cluster.node_pids(victim))
    cluster.kill_node(victim)
    after = asyncio.create_task(requests_after_loss(base_url, clock, args.after_s,
                                                    args.after_interval_s, args.give_up_s))
    record["long_streams"] = list(await asyncio.gather(*long_streams))
    record["after_loss"] = await after
    record["placed"] = stream_replicas(cluster.logs_dir)


def replaced(replicas_before: dict[str, str], lost_node: str) -> bool:
    now = synthesizer_replica_nodes()
    states = replica_states()
    new = [r for r in now if r not in replicas_before]
    return (states.get("RUNNING", 0) >= 2 and bool(new)
            and all(node != lost_node for node in now.values()))


def summarize(record: dict[str, Any], ingress_errors: list[str]) -> dict[str, Any]:
    lost_node = record["lost_node"]
    before = record["replicas_before_full"]
    placed = record["placed"]
    kill_t = record["kill_t_s"]
    rows = []
    for stream in record["long_streams"]:
        replica = placed.get(stream.request_id)
        node = before.get(replica) if replica else None
        began = (stream.first_audio_s is not None and stream.first_audio_s < kill_t
                 and (stream.end_s is None or stream.end_s > kill_t))  # in flight at the loss
        rows.append({**stream.as_dict(), "replica": replica,
                     "node": node[-5:] if node else None,
                     "on_lost_node": node == lost_node, "began_before_loss": began,
                     "logged_by_ingress": any(
                         stream.request_id in line
                         or (stream.session_id is not None and stream.session_id in line)
                         for line in ingress_errors)})
    started = [r for r in rows if r["began_before_loss"]]
    on_lost = [r for r in started if r["on_lost_node"]]
    elsewhere = [r for r in started if not r["on_lost_node"]]
    after = [s.as_dict() for s in record["after_loss"]]
    return {
        "streams_started": len(rows),
        "streams_in_flight_at_loss": len(started),
        "streams_on_lost_node": len(on_lost),
        "ended_with_error_on_lost_node": sum(r["outcome"] in CLEAR_FAILURES for r in on_lost),
        "logged_on_lost_node": sum(r["logged_by_ingress"] for r in on_lost),
        "lost_silently": sum(r["outcome"] in SILENT for r in rows),
        "failed_elsewhere": sum(r["outcome"] != "finished" for r in elsewhere),
        "finished_elsewhere": sum(r["outcome"] == "finished" for r in elsewhere),
        "requests_after_loss": len(after),
        "failed_after_loss": sum(r["outcome"] != "finished" for r in after),
        "replica_replaced_s": record.get("replica_replaced_s"),
        "outcomes_on_lost_node_by_kind": {
            kind: count_outcomes([s for s in record["long_streams"] if s.kind == kind
                                  and placed.get(s.request_id)
                                  and before.get(placed[s.request_id]) == lost_node])
            for kind in KINDS},
        "unplaced_streams": sum(r["replica"] is None for r in rows),
        "longest_error_wait_s": max((r["end_s"] - kill_t for r in on_lost
                                     if r["end_s"] is not None), default=None),
        "streams": rows,
        "after_loss": after,
    }


def passed(result: dict[str, Any]) -> bool:
    return (result["streams_on_lost_node"] > 0
            and result["streams_started"] > result["streams_on_lost_node"]
            and result["ended_with_error_on_lost_node"] == result["streams_on_lost_node"]
            and result["lost_silently"] == 0 and result["failed_elsewhere"] == 0
            and result["failed_after_loss"] == 0 and result["requests_after_loss"] > 0
            and result["replica_replaced_s"] is not None)


def run(args: argparse.Namespace, cluster: AutoscalingLocalCluster) -> dict[str, Any]:
    connect_driver(cluster)
    import ray

    try:
        [port] = free_ports(1)
        base_url = f"http://127.0.0.1:{port}"
        config = two_replica_config(port)
        deploy_config(config)
        wait_for_two_replicas(base_url)
        record: dict[str, Any] = {"replicas_before_full": synthesizer_replica_nodes()}
        asyncio.run(drive(args, cluster, base_url, record))
        lost_at = record["t0_epoch"] + record["kill_t_s"]
        if wait_until(lambda: replaced(record["replicas_before_full"], record["lost_node"]),
                      args.replace_timeout_s, 1.0):
            record["replica_replaced_s"] = round(time.time() - lost_at, 1)
        record["replicas_after"] = {r: n[-5:] for r, n in synthesizer_replica_nodes().items()}
        result = summarize(record, ingress_error_lines(cluster.logs_dir))
        result.update({
            "lost_node": record["lost_node"][-5:], "killed_processes": record["killed"],
            "replicas_before": record["replicas_before"],
            "replicas_after": record["replicas_after"],
            "worker_nodes_after": [(n["short_id"], n["alive"]) for n in worker_nodes()],
            "node_launches": [{**launch, "decided_t_s": round(launch["decided_at"] - lost_at, 1)}
                              for launch in node_launches(cluster.autoscaler_events())],
            "served_config": config})
        return result
    finally:
        ray.shutdown()


def node_health_check_env(args: argparse.Namespace) -> dict[str, str]:
    """Ray's settings for how soon its GCS marks a node that stopped answering dead."""
    if args.node_health_check_s is None:
        return {}
    return {"RAY_health_check_period_ms": str(round(args.node_health_check_s * 1000)),
            "RAY_health_check_failure_threshold": "3"}


def main(argv: list[str] | None = None) -> int:
    log_to_screen()
    args = parse_args(argv)
    cluster = AutoscalingLocalCluster(min_workers=1, max_workers=2, idle_timeout_s=60.0,
                                      extra_env={**haproxy_env_of_its_own(),
                                                 **node_health_check_env(args)})
    result = report_run(
        "node_loss", "a GPU-like worker node SIGKILLed while streams run on it and on the other "
        "node (Ray autoscaler v2, fake multi-node provider, Piper, one machine)", cluster,
        lambda: run(args, cluster), passed, args.out, args.logs,
        ("streams_started", "streams_on_lost_node", "ended_with_error_on_lost_node",
         "logged_on_lost_node", "lost_silently", "failed_elsewhere", "failed_after_loss",
         "replica_replaced_s"))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
