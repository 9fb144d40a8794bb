"""Ray's own autoscaler adds a GPU-like worker node under load and removes it again.

    scripts/autoscaler_nodes [--out docs/benchmarks/autoscaler-nodes.json]

One machine, one ``ray start --head`` running Ray's autoscaler (v2) over Ray's fake multi-node
provider (:mod:`fleet.autoscaling_cluster`): a worker node type with one ``gpu_like``
resource (the stand-in for a GPU), min 1 and max 2 nodes, idle nodes removed after
``--idle-timeout-s``. Nothing else starts a node. The app is ``serve_config.cluster_demo.yaml``
(Piper; the Synthesizer asks for ``gpu_like: 1`` where a GPU profile asks for ``num_gpus: 1``,
and scales by its own policy, ``serve_app.gpu.autoscaling:EngineQueuePolicy``), Ray's HAProxy in
front, the Ingress kept on the head.

Locust (``ScheduledListener``) replays Poisson arrivals of one read text whose rate follows
bench_autoscale's ramp: up to the rate that holds ``--peak-streams`` real-time streams, held,
then down to ``--low-streams``. When the Synthesizer's policy wants a second replica, Serve
starts one that no node can place; its resource demand makes the autoscaler launch a second
GPU-like node; after the load, Serve removes the replica and the autoscaler terminates the idle
node. Every ``--sample-s`` it records nodes by type and state, Synthesizer replicas by state
and node, the pending resource demand, and (from the streams) those in flight and TTFB p50/p99
of the streams started in the last 10 s. It writes the JSON (``launched_by``, ``nodes_went``,
``replicas_went``, streams failed and cut, ``node_up_s``, ``replica_serving_s``,
``node_terminated``, the timeline, commit and machine) and a PNG next to it. Exits 0 when the
nodes went up and down by the autoscaler with no stream failed or cut.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.autoscale.load import arrivals_s, target_streams
from bench.served.arrivals import READ_TEXT, replay_schedule
from bench.served.served_logs import percentile
from fleet.autoscaling_cluster import (
    GPU_WORKER_TYPE,
    HEAD_NODE_ID,
    PROVIDER,
    AutoscalingLocalCluster,
    autoscaler_view,
    node_launches,
    worker_nodes,
)
from fleet.cluster_demo import deploy_config, replica_states, wait_until
from fleet.scenario import (
    SYNTHESIZER,
    add_output_args,
    connect_driver,
    deployment_config,
    fleet_app_config,
    log_to_screen,
    report_run,
    synthesizer_replica_nodes,
    timeline_dump,
)
from harness.local_ray import free_ports
from harness.service import haproxy_env_of_its_own

logger = logging.getLogger("autoscaler_nodes")

TTFB_WINDOW_S = 10.0
CUT_SHARE = 0.95  # a stream with less than this share of the text's audio was cut


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/autoscaler_nodes",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--peak-streams", type=int, default=8,
                        help="the ramp's peak, as real-time streams of the text (Little's law)")
    parser.add_argument("--low-streams", type=int, default=1)
    parser.add_argument("--ramp-up-s", type=float, default=20.0)
    parser.add_argument("--hold-s", type=float, default=60.0)
    parser.add_argument("--ramp-down-s", type=float, default=10.0)
    parser.add_argument("--low-s", type=float, default=40.0)
    parser.add_argument("--upscale-delay-s", type=float, default=2.0)
    parser.add_argument("--downscale-delay-s", type=float, default=10.0)
    parser.add_argument("--idle-timeout-s", type=float, default=15.0,
                        help="the autoscaler removes a worker node idle this long")
    parser.add_argument("--settle-timeout-s", type=float, default=120.0,
                        help="after the load, wait this long at most for the node's removal")
    parser.add_argument("--sample-s", type=float, default=2.0)
    add_output_args(parser, "autoscaler-nodes.json")
    return parser.parse_args(argv)


def first_stream_audio_s(base_url: str, body: dict[str, Any]) -> float:
    """Seconds of audio in one whole stream of ``body`` (pcm 24 kHz)."""
    received = 0
    with httpx.stream("POST", f"{base_url}/v1/speech/stream", json=body, timeout=300) as reply:
        reply.raise_for_status()
        for piece in reply.iter_raw():
            received += len(piece)
    return received / (2 * body["sample_rate"])


class Sampler:
    """Nodes, replicas and demand every ``interval_s`` (``take``: :func:`take_sample`, or one
    that adds to it), in a thread, on the epoch clock."""

    def __init__(self, gcs_address: str, interval_s: float,
                 take: Callable[[str], dict[str, Any]] | None = None) -> None:
        self.samples: list[dict[str, Any]] = []
        self._gcs_address = gcs_address
        self._interval_s = interval_s
        self._take = take or take_sample
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        last = None
        while not self._stop.is_set():
            sample = self._take(self._gcs_address)
            self.samples.append(sample)
            shown = (sample.get("gpu_like_nodes"), sample.get("replicas"),
                     len(sample.get("pending_demand") or []))
            if shown != last:
                print(f"{time.strftime('%H:%M:%S')} GPU-like nodes {sample.get('nodes')} "
                      f"Synthesizer {sample.get('replicas')} pending demand "
                      f"{sample.get('pending_demand')}", flush=True)
                last = shown
            self._stop.wait(self._interval_s)


def take_sample(gcs_address: str) -> dict[str, Any]:
    sample: dict[str, Any] = {"at": time.time()}
    try:
        view = autoscaler_view(gcs_address)
        nodes = worker_nodes()
        replica_nodes = synthesizer_replica_nodes()
        sample.update({
            "nodes": {("head" if t.endswith(HEAD_NODE_ID) else t): states
                      for t, states in view["nodes"].items()},
            "gpu_like_nodes": sum(n["alive"] for n in nodes),
            "worker_nodes_alive": sorted(n["short_id"] for n in nodes if n["alive"]),
            "worker_nodes_dead": sorted(n["short_id"] for n in nodes if not n["alive"]),
            "replicas": replica_states(),
            "replica_nodes": sorted(node[-5:] for node in replica_nodes.values()),
            "pending_demand": view["pending_demand"]})
    except Exception as exc:  # a slow GCS or controller must not end the record
        sample["error"] = f"{type(exc).__name__}: {exc}"[:200]
    return sample


def node_gone_in_a_sample(samples: list[dict[str, Any]], since: float) -> bool:
    """Whether a sample taken after ``since`` counts one GPU-like node alive and a dead one."""
    return any(s["at"] > since and s.get("gpu_like_nodes") == 1 and s.get("worker_nodes_dead")
               for s in samples)


def went(values: list[int]) -> list[int]:
    """Values in order with repeats folded: [1, 2, 1] for a full cycle."""
    folded: list[int] = []
    for value in values:
        if not folded or folded[-1] != value:
            folded.append(value)
    return folded


def with_streams(samples: list[dict[str, Any]], rows: list[dict[str, Any]], t0: float
                 ) -> list[dict[str, Any]]:
    """The samples on the load's clock, each with the streams in flight then and TTFB p50/p99
    of the streams that started in the :data:`TTFB_WINDOW_S` before it."""
    timeline = []
    for sample in samples:
        at = sample["at"]
        in_flight = sum(1 for r in rows if r["start"] <= at < r["start"] + (r["total_s"] or 0))
        ttfbs = [r["ttfb_s"] * 1000 for r in rows
                 if r.get("ttfb_s") and at - TTFB_WINDOW_S <= r["start"] < at]
        row = {"t_s": round(at - t0, 1), **{k: v for k, v in sample.items() if k != "at"},
               "streams_in_flight": in_flight, "streams_started_10s": len(ttfbs),
               "ttfb_ms_p50": percentile(ttfbs, 50), "ttfb_ms_p99": percentile(ttfbs, 99)}
        timeline.append(row)
    return timeline


def replica_serving_s(samples: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """(when Serve first asked for a second Synthesizer replica, seconds until it served):
    from the first sample with two replicas in any state to the first with two RUNNING."""
    asked = next((s["at"] for s in samples if sum((s.get("replicas") or {}).values()) >= 2), None)
    serving = next((s["at"] for s in samples if asked is not None and s["at"] >= asked
                    and (s.get("replicas") or {}).get("RUNNING", 0) >= 2), None)
    return asked, (round(serving - asked, 1) if asked is not None and serving is not None
                   else None)


def summarize(samples: list[dict[str, Any]], rows: list[dict[str, Any]], events: list[dict],
              t0: float, expected_audio_s: float) -> dict[str, Any]:
    failed = [r for r in rows if not r.get("ok")]
    cut = [r for r in rows if r.get("ok") and r["audio_s"] < CUT_SHARE * expected_audio_s]
    launches = node_launches(events)
    asked, serving_s = replica_serving_s(samples)
    # The launch the load caused: the first one decided after Serve asked for a replica.
    scale_out = next((launch for launch in launches
                      if asked is not None and launch["decided_at"] >= asked - 5), None)
    good = [s for s in samples if "error" not in s]
    nodes_went = went([s["gpu_like_nodes"] for s in good])
    # Scale-in removes whichever node Serve emptied (the first one, as often as not): the
    # autoscaler terminated a GPU-like node after the scale-out, and Ray shows it dead.
    removed = next((launch for launch in launches if scale_out and launch["terminated_at"]
                    and launch["terminated_at"] > scale_out["decided_at"]), None)
    terminated = bool(removed) and any(removed["node_id"][-5:] in s["worker_nodes_dead"]
                                       for s in good)
    return {
        "launched_by": "ray-autoscaler",
        "nodes_went": nodes_went,
        "replicas_went": went([(s["replicas"] or {}).get("RUNNING", 0) for s in good
                              if (s["replicas"] or {}).get("RUNNING", 0)]),
        "streams": len(rows), "failed_streams": len(failed), "cut_streams": len(cut),
        "errors": sorted({r.get("error") or "" for r in failed})[:5],
        "node_up_s": scale_out["node_up_s"] if scale_out else None,
        "replica_serving_s": serving_s,
        "node_terminated": terminated,
        "scale_out_node": scale_out["node_id"][-5:] if scale_out and scale_out["node_id"]
        else None,
        "terminated_node": removed["node_id"][-5:] if removed else None,
        "node_launches": [{**launch, "decided_t_s": round(launch["decided_at"] - t0, 1),
                           "terminated_t_s": (round(launch["terminated_at"] - t0, 1)
                                              if launch["terminated_at"] else None)}
                          for launch in launches],
        "serve_asked_second_replica_t_s": round(asked - t0, 1) if asked else None,
        "autoscaler_events": [{**{k: v for k, v in e.items() if k != "at"},
                               "t_s": round(e["at"] - t0, 1)} for e in events],
        "ttfb_ms_p50": percentile([r["ttfb_s"] * 1000 for r in rows if r.get("ttfb_s")], 50),
        "ttfb_ms_p99": percentile([r["ttfb_s"] * 1000 for r in rows if r.get("ttfb_s")], 99),
        "expected_audio_s": round(expected_audio_s, 2),
    }


def passed(result: dict[str, Any]) -> bool:
    return (max(result["nodes_went"] or [0]) >= 2 and result["nodes_went"][-1:] == [1]
            and result["node_terminated"] and result["failed_streams"] == 0
            and result["cut_streams"] == 0 and result["streams"] > 0)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["timeline"] if "error" not in r]
    t = [r["t_s"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    top.step(t, [r["gpu_like_nodes"] for r in rows], where="post", lw=2.5,
             label="GPU-like worker nodes (alive)")
    top.step(t, [(r["replicas"] or {}).get("RUNNING", 0) for r in rows], where="post",
             label="Synthesizer replicas running")
    top.step(t, [sum(d["count"] for d in r["pending_demand"]) for r in rows], where="post",
             linestyle="--", label="pending resource demand (bundles)")
    for launch in result["node_launches"]:
        top.axvline(launch["decided_t_s"], color="green", linestyle=":", lw=1)
        if launch["terminated_t_s"] is not None:
            top.axvline(launch["terminated_t_s"], color="red", linestyle=":", lw=1)
    top.set(ylabel="count", title="Ray autoscaler (fake multi-node provider): launch (green) "
            "and terminate (red) decisions")
    top.legend(loc="upper right", fontsize=8)
    bottom.plot(t, [r["streams_in_flight"] for r in rows], "k-", label="streams in flight")
    bottom.plot(t, [round(target_streams(x, argparse.Namespace(**result["load"])), 1)
                    for x in t], "k:", label="offered (real-time streams)")
    bottom.set(xlabel="seconds since the load started", ylabel="streams")
    ttfb = bottom.twinx()
    for q, style in (("p50", "b.-"), ("p99", "r.-")):
        ttfb.plot(t, [r[f"ttfb_ms_{q}"] for r in rows], style, label=f"TTFB {q} (ms)")
    ttfb.set_ylabel("TTFB (ms)")
    bottom.legend(loc="upper left", fontsize=8)
    ttfb.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def run(args: argparse.Namespace, cluster: AutoscalingLocalCluster, work: Path
        ) -> dict[str, Any]:
    connect_driver(cluster)
    import ray

    if not wait_until(lambda: any(n["alive"] for n in worker_nodes()), 120):
        raise RuntimeError("the autoscaler never launched the minimum GPU-like node")
    [port] = free_ports(1)
    base_url = f"http://127.0.0.1:{port}"
    config = fleet_app_config(port)
    synthesizer = deployment_config(config, SYNTHESIZER)
    synthesizer["autoscaling_config"].update(upscale_delay_s=args.upscale_delay_s,
                                             downscale_delay_s=args.downscale_delay_s)
    deploy_config(config)

    def ready() -> bool:
        try:
            return httpx.get(f"{base_url}/readyz", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    if not wait_until(ready, 300):
        raise RuntimeError(f"the app never became ready at {base_url}")
    body = {"text": READ_TEXT, "mode": "read", "format": "pcm", "sample_rate": 24000}
    expected_audio_s = first_stream_audio_s(base_url, body)
    load = argparse.Namespace(
        peak_streams=args.peak_streams, low_streams=args.low_streams, ramp_up_s=args.ramp_up_s,
        hold_s=args.hold_s, ramp_down_s=args.ramp_down_s, low_s=args.low_s,
        audio_seconds=expected_audio_s)
    times = arrivals_s(load)
    sampler = Sampler(cluster.address, args.sample_s).start()
    try:
        t0 = time.time() + 5.0
        print(f"load: {len(times)} streams of {expected_audio_s:.1f} s of audio over "
              f"{times[-1]:.0f} s, peak {args.peak_streams}", flush=True)
        locust, rows = replay_schedule(base_url, work, "autoscaler-nodes", t0, body,
                                       "/v1/speech/stream read", times, expected_audio_s,
                                       stop_timeout_s=120, timeout_margin_s=300)
        if locust.returncode not in (0, 1):
            logger.warning("locust exited %d: %s", locust.returncode, locust.stderr[-2000:])

        def settled() -> bool:  # a GPU-like node launched under load, one terminated since
            launches = node_launches(cluster.autoscaler_events())
            return len(launches) >= 2 and any(
                launch["terminated_at"] and launch["terminated_at"] > launches[1]["decided_at"]
                for launch in launches)

        if wait_until(settled, args.settle_timeout_s, 0.5):
            # Until a sample taken since shows the removal (the timeline ends with it).
            since = time.time()
            wait_until(lambda: node_gone_in_a_sample(sampler.samples, since),
                       4 * args.sample_s, 0.25)
    finally:
        sampler.stop()
        ray.shutdown()
    events = cluster.autoscaler_events()
    result = summarize(sampler.samples, rows, events, t0, expected_audio_s)
    result["load"] = vars(load)
    result["timeline"] = with_streams(sampler.samples, rows, t0)
    result["served_config"] = config
    return result


def main(argv: list[str] | None = None) -> int:
    log_to_screen()
    args = parse_args(argv)
    cluster = AutoscalingLocalCluster(min_workers=1, max_workers=2,
                                      idle_timeout_s=args.idle_timeout_s,
                                      extra_env=haproxy_env_of_its_own())
    work = Path(tempfile.mkdtemp(prefix="autoscaler-nodes-"))

    def run_here() -> dict[str, Any]:
        return {"cluster": {"worker_type": GPU_WORKER_TYPE, "min_workers": 1, "max_workers": 2,
                            "idle_timeout_s": args.idle_timeout_s, "autoscaler": "v2",
                            "provider": PROVIDER}, **run(args, cluster, work)}

    result = report_run(
        "autoscaler_nodes", "Ray's autoscaler (v2, fake multi-node provider) adds and removes "
        "a GPU-like worker node as the Synthesizer scales under a Locust ramp (Piper, one "
        "machine)", cluster, run_here, passed, args.out, args.logs,
        ("nodes_went", "replicas_went", "streams", "failed_streams", "cut_streams",
         "node_up_s", "replica_serving_s", "node_terminated"), dump=timeline_dump)
    if result.get("timeline") and "node_launches" in result:
        plot(result, args.out.with_suffix(".png"))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
