"""``serve deploy`` of a changed config while streams run: no stream dropped, no request failed.

    scripts/upgrade_drain [--out docs/benchmarks/upgrade.json]

The cluster of :mod:`fleet.autoscaler_nodes` (Ray's autoscaler, GPU-like worker nodes min 1,
max 2; Ray's HAProxy in front; the Ingress on the head), here with Ray's dashboard, which
``serve deploy`` talks to. The app (``serve_config.cluster_demo.yaml``, Piper) is deployed with
``serve deploy`` and the Synthesizer at two replicas, one per GPU-like node, as a GPU fleet at its
size.

1. ``--streams-per-kind`` long streams over each of plain HTTP, SSE and the WebSocket start;
   once each has its first audio, and while new short requests start over each kind every
   ``--interval-s`` (and keep starting until the rollout is over),
2. ``serve deploy`` submits the config with the Synthesizer's ``ray_actor_options`` changed
   (``num_cpus`` 0.5 -> 0.4: Ray cannot change a running actor's resources, so Serve replaces
   every Synthesizer replica). Serve rolls one replica at a time: the old one takes no new
   requests and finishes its streams (``graceful_shutdown_timeout_s`` bounds the wait; it is
   longer than the longest stream here); its node's ``gpu_like`` is then free for the new
   replica, while the other old replica serves the new requests.
3. It waits until only new replicas run, then starts one more request over each kind (on the
   new version only), and waits until every stream and request has ended.

Required: every stream in flight at the deploy finishes whole (``dropped_streams`` 0), every
request made during the rollout is served (``failed_requests`` 0). ``new_version_serving_s`` is
the time from ``serve deploy`` to the first stream whose first audio came from a new replica
(traced by the Synthesizer's log line for it). JSON with the counts, every stream, the replica
states over time, commit and machine. Exits 0 when both counts are 0.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from fleet.autoscaling_cluster import AutoscalingLocalCluster
from fleet.cluster_demo import replica_states, wait_until
from fleet.local_cluster import RAY
from fleet.scenario import (
    SYNTHESIZER,
    NewRequests,
    add_run_args,
    connect_driver,
    deployment_config,
    log_to_screen,
    report_run,
    stream_replicas,
    synthesizer_replica_nodes,
    two_replica_config,
    until_under_way,
    wait_for_two_replicas,
)
from harness.local_ray import free_ports
from harness.service import haproxy_env_of_its_own
from harness.stream_clients import KINDS, StreamOutcome, count_outcomes, monotonic_clock, one_stream
from loadtest.corpus import LONG


# About three minutes of speech, held as long as it plays (fleet_app_config paces Piper): the
# streams outlast the rollout's first steps, so a replica being replaced still holds some (one
# paragraph's worth, unpaced, ended before Serve stopped its replica on a quiet machine).
# --long-repeats says how many times LONG.
LONG_REPEATS = 3
# Serve's controller's line for each replica it stops (the rollout's), with its local time.
STOPPING = re.compile(r"^\w+ (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) controller \d+ -- "
                      r"Stopping Replica\(id='(\w+)', deployment='Synthesizer'", re.M)
SERVE = str(Path(RAY).parent / "serve")
OLD_CPUS, NEW_CPUS = 0.5, 0.4
# upgrade.json's key for scripts/rollout_new_cluster's run (the rollout to a new cluster),
# kept when this run writes the file.
NEW_CLUSTER_KEY = "new_cluster_rollout"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/upgrade_drain",
                                     description=__doc__.split("\n\n")[0])
    # One per kind: with two, one replica took five of the six and reached its
    # max_ongoing_requests, where WebSocket sessions fail (docs/benchmarks/README.md).
    add_run_args(parser, "upgrade.json", 1, 400.0,
                 "long streams over each of http, sse and ws in flight at the deploy")
    parser.add_argument("--interval-s", type=float, default=10.0,
                        help="a new request over each kind starts this often (the replica "
                             "left serving must carry them below its max_ongoing_requests: "
                             "docs/benchmarks/README.md, 'A node lost')")
    parser.add_argument("--before-deploy-s", type=float, default=None,
                        help="once every long stream has audio, new requests run this long on "
                             "the old version before the deploy (default: --interval-s)")
    parser.add_argument("--deploy-in-process", action="store_true",
                        help="submit the changed config as `serve deploy` does (its schema "
                             "check and REST call) from this process instead of the command")
    parser.add_argument("--long-repeats", type=int, default=LONG_REPEATS,
                        help="a long stream's text is the corpus' long paragraphs this many "
                             "times over (3: about three minutes of speech)")
    parser.add_argument("--rollout-timeout-s", type=float, default=420.0)
    return parser.parse_args(argv)


def serve_deploy(config: dict[str, Any], dashboard_url: str, work: Path, name: str,
                 in_process: bool = False) -> str:
    """``serve deploy`` of ``config`` (a YAML file in ``work``) through the dashboard; its output.
    ``in_process``: what the command does with the file (the schema check, then the one REST
    call to the dashboard), from this process, without starting the command's own Python
    first, which took 6-23 s on a busy two-core machine while the streams ran."""
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    if in_process:
        from ray.dashboard.modules.serve.sdk import ServeSubmissionClient
        from ray.serve.schema import ServeDeploySchema

        schema = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
        ServeSubmissionClient(dashboard_url).deploy_applications(
            schema.model_dump(exclude_unset=True))
        return f"{name}: deploy request sent from the driver"
    done = subprocess.run([SERVE, "deploy", "--address", dashboard_url, str(path)],
                          capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"serve deploy {name} failed: {done.stdout[-1000:]} {done.stderr[-2000:]}")
    return (done.stdout + done.stderr)[-500:]


def new_config(config: dict[str, Any]) -> dict[str, Any]:
    """The same config with the Synthesizer's CPU reservation changed: a change Serve can only
    apply by replacing the Synthesizer's replicas (the Ingress is untouched)."""
    changed = copy.deepcopy(config)
    deployment_config(changed, SYNTHESIZER)["ray_actor_options"]["num_cpus"] = NEW_CPUS
    return changed


async def drive(args: argparse.Namespace, cluster: AutoscalingLocalCluster, base_url: str,
                dashboard_url: str, config: dict[str, Any], work: Path,
                record: dict[str, Any]) -> None:
    clock = monotonic_clock()
    record["t0_epoch"] = time.time() - clock()
    old_replicas = set(synthesizer_replica_nodes())
    record["old_replicas"] = sorted(old_replicas)
    watched: dict[str, StreamOutcome] = {}
    long_streams = [asyncio.create_task(one_stream(kind, base_url, long_text(args), clock,
                                                   args.give_up_s, watched))
                    for _ in range(args.streams_per_kind) for kind in KINDS]
    states: list[dict[str, Any]] = []
    requests = NewRequests(base_url, clock, args.give_up_s, args.interval_s)
    # Every long stream under way (its first audio in) before the deploy; new requests (a
    # request over each kind every --interval-s until the rollout is over) on the old version
    # first.
    await until_under_way(watched, len(long_streams), args.give_up_s)
    requester = asyncio.create_task(requests.keep_going())
    await asyncio.sleep(args.interval_s if args.before_deploy_s is None else args.before_deploy_s)
    before, _ = sample_states([], clock(), old_replicas)
    record["serving_before_deploy"] = before.get("RUNNING", 0)  # the capacity before
    record["deploy_t_s"] = clock()
    record["in_flight_at_deploy"] = sum(not t.done() for t in long_streams)
    record["deploy_output"] = await asyncio.to_thread(
        serve_deploy, new_config(config), dashboard_url, work, "new", args.deploy_in_process)
    record["deploy_returned_t_s"] = clock()

    def rolled_out() -> bool:
        state, now = sample_states(states, clock(), old_replicas)
        return (state == {"RUNNING": 2} and len(now) == 2
                and not set(now) & old_replicas)

    over = await asyncio.to_thread(wait_until, rolled_out, args.rollout_timeout_s, 1.0)
    record["rollout_over_t_s"] = clock() if over else None
    requests.stop()
    await requester
    # A request over each kind on the new version only (outcomes() waits for them).
    requests.over_each_kind()
    record["long_streams"] = list(await asyncio.gather(*long_streams))
    record["new_requests"] = await requests.outcomes()
    record["replica_states"] = states
    record["placed"] = stream_replicas(cluster.logs_dir)
    record["stopped_at"] = replicas_stopped_at(cluster.logs_dir)


def sample_states(states: list[dict[str, Any]], t_s: float, old_replicas: set[str]
                  ) -> tuple[dict[str, int], dict[str, Any]]:
    """One sample of the Synthesizer's replicas (by state, and old or new) into ``states``."""
    now = synthesizer_replica_nodes()
    state = replica_states()
    states.append({"t_s": t_s, "states": state,
                   "replicas": {r: ("new" if r not in old_replicas else "old") for r in now}})
    return state, now


def capacity(before: int | None, states: list[dict[str, Any]], slots_per_replica: int
             ) -> dict[str, Any]:
    """Replicas taking new streams (RUNNING; a STOPPING one only finishes its own): ``before``
    the deploy, the fewest in ``states`` (sampled from the deploy until the rollout was over)
    and after (the last), and the streams they hold at ``slots_per_replica`` each."""
    serving = [(state["t_s"], state["states"].get("RUNNING", 0)) for state in states]
    during = [n for _, n in serving]
    result = {"replicas_before": before,
              "replicas_during_min": min(during, default=None),
              "replicas_after": during[-1] if during else None,
              "slots_per_replica": slots_per_replica,
              "serving_replicas": [{"t_s": t, "running": n} for t, n in serving]}
    for key in ("before", "during_min", "after"):
        replicas = result[f"replicas_{key}"]
        result[f"streams_{key}"] = None if replicas is None else replicas * slots_per_replica
    return result


def long_text(args: argparse.Namespace) -> str:
    return " ".join(LONG * args.long_repeats)


def replicas_stopped_at(logs_dir: Path) -> dict[str, float]:
    """Synthesizer replica id -> when Serve's controller began stopping it (epoch seconds)."""
    stopped = {}
    for path in (logs_dir / "serve").glob("controller_*.log"):
        for match in STOPPING.finditer(path.read_text(errors="replace")):
            at = time.mktime(time.strptime(match[1], "%Y-%m-%d %H:%M:%S")) + int(match[2]) / 1000
            stopped.setdefault(match[3], at)
    return stopped


def summarize(record: dict[str, Any], expected_audio_s: float) -> dict[str, Any]:
    deploy_t = record["deploy_t_s"]
    old = set(record["old_replicas"])
    placed = record["placed"]

    def row(stream: StreamOutcome) -> dict[str, Any]:
        replica = placed.get(stream.request_id)
        return {**stream.as_dict(), "replica": replica,
                "version": None if replica is None else ("old" if replica in old else "new")}

    long_rows = [row(s) for s in record["long_streams"]]
    in_flight = [r for r in long_rows if r["first_audio_s"] is not None
                 and r["first_audio_s"] < deploy_t and (r["end_s"] or 1e9) > deploy_t]
    dropped = [r for r in in_flight if r["outcome"] != "finished"
               or r["audio_s"] < 0.95 * expected_audio_s]
    # In flight when Serve began stopping their replica: the ones its drain had to finish.
    stopped_at = record["stopped_at"]
    drained = [r for r in in_flight if r["replica"] in stopped_at and r["end_s"] is not None
               and record["t0_epoch"] + r["end_s"] > stopped_at[r["replica"]]]
    new_rows = [row(s) for s in record["new_requests"]]
    failed = [r for r in new_rows if r["outcome"] != "finished"]
    first_new = min((r["first_audio_s"] for r in new_rows + long_rows
                     if r["version"] == "new" and r["first_audio_s"] is not None), default=None)
    during = [r for r in new_rows if r["start_s"] >= deploy_t
              and (record["rollout_over_t_s"] is None or r["start_s"] <= record["rollout_over_t_s"])]
    return {
        "streams_in_flight_at_upgrade": len(in_flight),
        "streams_in_flight_when_their_replica_stopped": len(drained),
        "dropped_streams": len(dropped),
        "failed_requests": len(failed),
        "new_version_serving_s": round(first_new - deploy_t, 1) if first_new else None,
        "rollout_s": (round(record["rollout_over_t_s"] - deploy_t, 1)
                      if record["rollout_over_t_s"] else None),
        "requests_during_rollout": len(during),
        "requests": len(new_rows),
        "requests_by_version": {v: sum(r["version"] == v for r in new_rows)
                                for v in ("old", "new", None)},
        "longest_in_flight_stream_s": max((r["end_s"] - r["start_s"] for r in in_flight
                                           if r["end_s"] is not None), default=None),
        "in_flight_streams_ended_after_deploy_s": sorted(
            round(r["end_s"] - deploy_t, 1) for r in in_flight if r["end_s"] is not None),
        "long_stream_expected_audio_s": round(expected_audio_s, 2),
        "outcomes_long": count_outcomes(record["long_streams"]),
        "outcomes_new_requests": count_outcomes(record["new_requests"]),
        "errors": sorted({r["error"] or r["outcome"] for r in dropped + failed})[:10],
        "deploy_returned_s": round(record["deploy_returned_t_s"] - deploy_t, 1),
        "replica_states": fold_states(record["replica_states"], deploy_t),
        "capacity": capacity(record["serving_before_deploy"],
                             fold_states(record["replica_states"], deploy_t),
                             record["slots_per_replica"]),
        "streams": long_rows,
        "new_request_rows": new_rows,
    }


def fold_states(states: list[dict[str, Any]], deploy_t: float) -> list[dict[str, Any]]:
    """The replica states as they changed, on the deploy's clock."""
    folded = []
    for state in states:
        view = (state["states"], sorted(state["replicas"].values()))
        if not folded or folded[-1]["view"] != view:
            folded.append({"t_s": round(state["t_s"] - deploy_t, 1), "view": view})
    return [{"t_s": f["t_s"], "states": f["view"][0], "replicas": f["view"][1]} for f in folded]


def passed(result: dict[str, Any]) -> bool:
    return (result["streams_in_flight_at_upgrade"] > 0 and result["dropped_streams"] == 0
            and result["failed_requests"] == 0 and result["requests_during_rollout"] > 0
            and result["rollout_s"] is not None)


def long_audio_s(base_url: str, text: str) -> float:
    received = 0
    with httpx.stream("POST", f"{base_url}/v1/speech/stream", timeout=600,
                      json={"text": text, "format": "pcm"}) as reply:
        reply.raise_for_status()
        for piece in reply.iter_raw():
            received += len(piece)
    return received / (2 * 24000)


def run(args: argparse.Namespace, cluster: AutoscalingLocalCluster, work: Path
        ) -> dict[str, Any]:
    connect_driver(cluster)
    import ray

    try:
        [port] = free_ports(1)
        base_url = f"http://127.0.0.1:{port}"
        dashboard_url = f"http://127.0.0.1:{cluster.dashboard_port}"
        config = two_replica_config(port)
        deployment_config(config, SYNTHESIZER)["ray_actor_options"]["num_cpus"] = OLD_CPUS
        serve_deploy(config, dashboard_url, work, "old")
        wait_for_two_replicas(base_url)
        expected_audio_s = long_audio_s(base_url, long_text(args))
        [app] = config["applications"]
        record: dict[str, Any] = {
            "slots_per_replica": app["args"]["engine_options"]["max_batch_size"]}
        asyncio.run(drive(args, cluster, base_url, dashboard_url, config, work, record))
        result = summarize(record, expected_audio_s)
        result["graceful_shutdown_timeout_s"] = deployment_config(
            config, SYNTHESIZER).get("graceful_shutdown_timeout_s")
        result["change"] = (f"Synthesizer ray_actor_options.num_cpus {OLD_CPUS} -> {NEW_CPUS} "
                            "(serve deploy)")
        result["served_config"] = config
        return result
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    log_to_screen()
    args = parse_args(argv)
    cluster = AutoscalingLocalCluster(min_workers=1, max_workers=2, idle_timeout_s=60.0,
                                      include_dashboard=True,
                                      extra_env=haproxy_env_of_its_own())
    work = Path(tempfile.mkdtemp(prefix="upgrade-drain-"))
    result = report_run(
        "upgrade_drain", "serve deploy of a config that replaces both Synthesizer replicas "
        "while streams run (Ray autoscaler v2 cluster, fake multi-node provider, Piper, one "
        "machine)", cluster, lambda: run(args, cluster, work), passed, args.out, args.logs,
        ("streams_in_flight_at_upgrade", "dropped_streams", "failed_requests",
         "new_version_serving_s", "rollout_s", "requests_during_rollout"),
        keep=(NEW_CLUSTER_KEY,))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
