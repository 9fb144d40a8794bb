"""Two Synthesizer replicas admitting by work on GPU-like nodes: while one has no room and the
other has, no stream is refused; a burst past both is refused cleanly while Ray's autoscaler adds
a node, and the new node's replica takes work once it is ready.

    scripts/overload_nodes [--out docs/benchmarks/overload-nodes.json]

The cluster of :mod:`fleet.autoscaler_nodes` (Ray's autoscaler v2 over Ray's fake multi-node
provider, HAProxy in front, the Ingress on the head), GPU-like worker nodes min 2, max 3. The
app is ``serve_config.cluster_demo.yaml`` (Piper) with its Synthesizer admitting by work (engine
options ``admission: work``, :data:`ADMISSION_MARGIN` and :data:`PACED_LEAD_S`, the others
kept; ``--engine-option`` over them) and taking every stream its engine can hold
(``max_ongoing_requests`` as ``build_app`` derives it admitting by work: the engine decides and
refuses at once, Serve queues nothing at the caller), at two replicas, one per node, autoscaling
min 2, max 3 by its shipped policy (``EngineQueuePolicy``); each call traced to its replica in
the replicas' logs.

1. **capacity**: each replica's headroom for read streams when idle, as it reports it to the
   router (``Synthesizer.record_routing_stats``; a cold engine's is its slot prior,
   ``max_batch_size``).
2. **fill**: at once, the streams the two replicas have room for less ``--fill-spare`` (1: one
   replica full, the other one stream short; more than either has room for): none may be
   refused; where each ran.
3. **burst**: Poisson arrivals for ``--burst-s`` at ``--burst-x`` times the rate that keeps the
   two replicas' capacity (read idle again) held: that capacity over how long an engine held a
   fill stream (from its arrival to its last audio; paced, an engine is done with a stream its
   lead before the stream's audio plays out); then waves of ``--wave-s`` at ``--follow-x``
   times that rate until a replica on the node the autoscaler added has served a stream (at
   most ``--new-replica-timeout-s`` after the burst began).

The listeners are the overload benchmark's (``bench/overload/client.py``: each stream's
:class:`~bench.overload.levels.StreamFate`, counted by ``levels.summarize``). Every
``--sample-s`` it records nodes by type and state, replicas by state, each replica's reported
headroom and the pending demand. It writes each phase's figures, the autoscaler's launch, the
third replica's times, the timeline and an ``acceptance`` block (``fleet/overload_figures.py``)
as JSON; exits 0 when every check holds.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.overload.client import offer
from bench.overload.levels import StreamFate, arrivals
from bench.served.config import key_values
from fleet.autoscaler_nodes import Sampler, take_sample
from fleet.autoscaling_cluster import AutoscalingLocalCluster, worker_nodes
from fleet.cluster_demo import deploy_config, wait_until
from fleet.overload_figures import BURST, FILL, FOLLOW, summarize
from fleet.scenario import (
    FIRST_AUDIO,
    SYNTHESIZER,
    add_output_args,
    connect_driver,
    deployment_config,
    fleet_app_config,
    log_to_screen,
    report_run,
    stream_replicas,
    synthesizer_actors,
    synthesizer_replica_nodes,
    timeline_dump,
    trace_synthesizer_calls,
    wait_for_two_replicas,
)
from harness.local_ray import free_ports
from harness.service import haproxy_env_of_its_own

MIN_WORKERS, MAX_WORKERS = 2, 3
# The Synthesizer stands in for a GPU replica: the GPU profiles' margin (serve_config.h200.yaml,
# .a10g, .chat), not the CPU profile's 0.2, which gives one engine a whole machine; here two or
# three engines share two cores with the front and the listeners. At 0.2 each engine admitted
# 13-17 streams (near its cost floor) and most of a burst's admitted streams ran dry
# (docs/benchmarks/history/overload-nodes-margin-0.2-lead-1s-c632a10.json).
ADMISSION_MARGIN = 0.5
# Paced Piper makes a stream's next sentence (~4.5 s of audio) when its listener has this much
# left; a batch of four sentences takes 0.6-1 s here, so at a burst a sentence due behind a
# batch or two runs dry with the fleet runs' 1 s however little the engine's budget is used
# (two replicas, no node added: 87 % of the admitted streams real-time at 1 s, 100 % at 3 s).
PACED_LEAD_S = 3.0
# The fill (7 of 8 slots) is 0.87 occupancy, over the policy's 0.75: a third replica is wanted
# while its streams run (2-4 s). Only the burst's sustained demand is to add the node.
UPSCALE_DELAY_S = 6.0
FILL_SPACING_S = 0.02  # "at once": the fill's arrivals all within one routing report (0.5 s)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/overload_nodes",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--fill-spare", type=int, default=1,
                        help="the fill: the streams the two replicas have room for, less this "
                             "many, at once (1: one replica full, the other one stream short)")
    parser.add_argument("--burst-x", type=float, default=3.0,
                        help="the burst: this many times the rate that keeps the two "
                             "replicas' capacity held")
    parser.add_argument("--burst-s", type=float, default=15.0)
    parser.add_argument("--follow-x", type=float, default=1.5,
                        help="after the burst, until the new replica serves: this many times "
                             "that rate")
    parser.add_argument("--wave-s", type=float, default=5.0)
    parser.add_argument("--new-replica-timeout-s", type=float, default=300.0,
                        help="after the burst began, offer load this long at most for the new "
                             "node's replica to serve a stream")
    parser.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                        help="an engine option over the config's (value read as YAML)")
    parser.add_argument("--upscale-delay-s", type=float, default=UPSCALE_DELAY_S,
                        help="the Synthesizer's (the config's: 1)")
    parser.add_argument("--downscale-delay-s", type=float, default=None,
                        help="the Synthesizer's (default: the config's)")
    parser.add_argument("--give-up-s", type=float, default=300.0,
                        help="the load's streams have all ended this long after it stopped")
    parser.add_argument("--sample-s", type=float, default=1.0)
    add_output_args(parser, "overload-nodes.json")
    return parser.parse_args(argv)


def overload_config(port: int, args: argparse.Namespace) -> dict[str, Any]:
    """The fleet app admitting by work, the Synthesizer at 2 replicas (min 2, max 3)."""
    config = fleet_app_config(port)
    [app] = config["applications"]
    app["args"]["engine_options"].update(
        {"admission": "work", "admission_margin": ADMISSION_MARGIN,
         "paced_lead_s": PACED_LEAD_S, **key_values(args.engine_option)})
    synthesizer = deployment_config(config, SYNTHESIZER)
    # As build_app derives it admitting by work (every stream the engine holds): the demo's 8
    # would queue at the Ingress's handle what the engine would refuse at once.
    synthesizer.pop("max_ongoing_requests", None)
    autoscaling = synthesizer["autoscaling_config"]
    autoscaling.update(min_replicas=MIN_WORKERS, initial_replicas=MIN_WORKERS,
                       max_replicas=MAX_WORKERS)
    for key in ("upscale_delay_s", "downscale_delay_s"):
        if getattr(args, key) is not None:
            autoscaling[key] = getattr(args, key)
    trace_synthesizer_calls(config)
    return config


def replica_headrooms(timeout_s: float = 5.0) -> dict[str, float]:
    """Replica id -> the read streams its engine has room for now, as it reports them to the
    router (its ``record_routing_stats``); a replica that does not answer is left out."""
    import ray

    from serve_app.gpu.routing import HEADROOM  # imports Ray: only once the driver is connected

    asked = {}
    for replica, actor in synthesizer_actors().items():
        try:
            handle = ray.get_actor(actor["Name"], namespace=actor.get("RayNamespace") or "serve")
        except ValueError:
            continue
        asked[replica] = handle.record_routing_stats.remote()
    rooms = {}
    for replica, ref in asked.items():
        try:
            stats = ray.get(ref, timeout=timeout_s)
        except Exception:  # starting, stopping or busy past the timeout
            continue
        if HEADROOM.format(kind="read") in stats:
            rooms[replica] = round(stats[HEADROOM.format(kind="read")], 2)
    return rooms


def with_headrooms(gcs_address: str) -> dict[str, Any]:
    """The autoscaler run's sample (nodes, replicas, demand) and each replica's headroom."""
    return {**take_sample(gcs_address), "headroom": replica_headrooms(timeout_s=2.0)}


def idle_capacity(replicas: int, timeout_s: float = 60.0) -> dict[str, float]:
    """Each replica's headroom once ``replicas`` report it and it stays put for a second (the
    engines idle: the last streams' work given back, their stats pushed)."""
    last: dict[str, float] = {}

    def steady() -> bool:
        nonlocal last
        now = replica_headrooms()
        settled = len(now) >= replicas and now == last
        last = now
        return settled

    if not wait_until(steady, timeout_s, 1.0):
        raise RuntimeError(f"the replicas never reported a steady headroom: {last}")
    return last


class Waves:
    """Waves of the overload benchmark's listeners (``bench/overload/client.py:offer``, in this
    process: one thread a wave), every stream's fate kept with its phase and its arrival on the
    epoch clock."""

    def __init__(self, base_url: str) -> None:
        self.streams: list[tuple[str, float, StreamFate]] = []
        self._base_url = base_url
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def offer(self, phase: str, schedule: list[tuple[float, str]], lead_s: float = 0.5
              ) -> float:
        """Start ``schedule`` (seconds after ``lead_s`` from now, kind); when it starts."""
        starts_at = time.time() + lead_s

        def listen() -> None:
            fates = offer(self._base_url, schedule, processes=1, lead_s=lead_s)
            with self._lock:
                self.streams += [(phase, starts_at + fate.at_s, fate) for fate in fates]

        thread = threading.Thread(target=listen, name=f"{phase}-wave", daemon=True)
        thread.start()
        self._threads.append(thread)
        return starts_at

    def wait(self, timeout_s: float) -> bool:
        """Until every wave's streams have ended (at most ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)

    def of(self, *phases: str) -> list[StreamFate]:
        with self._lock:
            return [fate for phase, _, fate in self.streams if phase in phases]


def new_replica_served(logs_dir: Path, first: set[str]) -> bool:
    """Whether a replica other than the ``first`` two has served audio for a stream."""
    return any(replica not in first
               for replica in stream_replicas(logs_dir, (FIRST_AUDIO,)).values())


def drive(args: argparse.Namespace, cluster: AutoscalingLocalCluster, waves: Waves,
          record: dict[str, Any]) -> None:
    """The fill, then the burst and the load after it, into ``record``."""
    first = set(record["first_replicas"])
    idle = idle_capacity(len(first))
    fill = sum(math.floor(room) for room in idle.values()) - args.fill_spare
    record.update(capacity_idle=idle, fill_streams=fill)
    print(f"capacity by replica {idle}: the fill offers {fill} streams at once", flush=True)
    record["fill_at"] = waves.offer(FILL, [(i * FILL_SPACING_S, "read") for i in range(fill)])
    waves.wait(args.give_up_s)
    whole = [f for f in waves.of(FILL) if f.whole and f.last_audio_s is not None]
    if not whole:
        raise RuntimeError("no fill stream ended whole: nothing to pace the burst by")
    # An engine holds a stream from its admission to its last audio (paced: its lead before
    # the audio plays out): the rate that keeps the replicas' capacity held is capacity / that.
    held_s = statistics.median(f.last_audio_s for f in whole)
    idle = idle_capacity(len(first))
    capacity = round(sum(idle.values()), 2)
    record.update(capacity_before_burst=idle, held_s=round(held_s, 2),
                  audio_s=round(max(f.audio_s for f in whole), 2))
    burst = arrivals("read", {"read": capacity}, args.burst_x, args.burst_s, held_s)
    print(f"capacity by replica {idle}, each stream held {held_s:.1f} s: the burst offers "
          f"{len(burst)} streams over {args.burst_s:g} s", flush=True)
    record["burst_at"] = waves.offer(BURST, burst)
    time.sleep(args.burst_s)
    deadline = record["burst_at"] + args.new_replica_timeout_s
    wave = 0
    while time.time() < deadline and not new_replica_served(cluster.logs_dir, first):
        wave += 1
        waves.offer(FOLLOW, arrivals("read", {"read": capacity}, args.follow_x, args.wave_s,
                                       held_s, seed=wave))
        wait_until(lambda: new_replica_served(cluster.logs_dir, first), args.wave_s, 1.0)
    record["load_stopped_at"] = time.time()
    record["replica_nodes_at_end_of_load"] = synthesizer_replica_nodes()
    if not waves.wait(args.give_up_s):
        raise RuntimeError(f"streams still open {args.give_up_s:g} s after the load stopped")


def run(args: argparse.Namespace, cluster: AutoscalingLocalCluster) -> dict[str, Any]:
    connect_driver(cluster)
    import ray

    try:
        if not wait_until(lambda: sum(n["alive"] for n in worker_nodes()) >= MIN_WORKERS, 180):
            raise RuntimeError("the autoscaler never launched the minimum GPU-like nodes")
        [port] = free_ports(1)
        base_url = f"http://127.0.0.1:{port}"
        config = overload_config(port, args)
        deploy_config(config)
        wait_for_two_replicas(base_url)
        record: dict[str, Any] = {"first_replicas": synthesizer_replica_nodes()}
        waves = Waves(base_url)
        sampler = Sampler(cluster.address, args.sample_s, take=with_headrooms).start()
        try:
            drive(args, cluster, waves, record)
        finally:
            sampler.stop()
        return {**summarize(record, waves.streams, sampler.samples, cluster.autoscaler_events(),
                            stream_replicas(cluster.logs_dir)),
                "load": {k: getattr(args, k) for k in ("fill_spare", "burst_x", "burst_s",
                                                         "follow_x", "wave_s")},
                "served_config": config}
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    log_to_screen()
    args = parse_args(argv)
    cluster = AutoscalingLocalCluster(min_workers=MIN_WORKERS, max_workers=MAX_WORKERS,
                                      idle_timeout_s=60.0, extra_env=haproxy_env_of_its_own())
    result = report_run(
        "overload_nodes", "two Synthesizer replicas admitting by work (Piper) on GPU-like nodes "
        "of Ray's autoscaler (v2, fake multi-node provider, one machine): more streams at once "
        "than one replica holds, then a burst past both while the autoscaler adds a node",
        cluster, lambda: run(args, cluster),
        lambda result: bool(result.get("acceptance")) and all(result["acceptance"].values()),
        args.out, args.logs, ("acceptance",), dump=timeline_dump)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
