"""Autoscaling on a real multi-node Ray cluster: the Synthesizer goes 1 -> 2 -> 1 replicas.

    scripts/cluster_demo [--out docs/cluster-timeline.json]

Starts a Ray head and two worker nodes as separate ``ray start`` processes on this machine (each
worker advertises one ``gpu_like`` resource, which a Synthesizer replica needs), deploys
``serve_config.cluster_demo.yaml`` (Piper CPU engine, fast autoscaling) and drives it:

1. heavy: ``--heavy-users`` concurrent streams, until a second Synthesizer replica has run for
   ``--hold-s`` seconds;
2. trickle: the heavy load stops, ``--trickle-users`` keep streaming while the autoscaler gives
   the second replica back, so a replica is removed while streams are in flight;
3. idle: no load, a few more samples.

Every ``--poll-s`` it samples the Synthesizer's replica states (printed as they change) and writes
the timeline, every stream's outcome and the verdict to ``--out`` as JSON. Exits 0 only when the
replicas went 1 -> >= 2 -> 1 and no stream failed. Every Ray process it started is ended, even
on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from fleet.local_cluster import LocalCluster
from harness.local_ray import free_ports
from harness.service import DEPLOYMENT, replica_states
from loadtest.audio_bytes import AudioCounter
from loadtest.corpus import MEDIUM, SHORT

logger = logging.getLogger("cluster_demo")

ROOT = Path(__file__).resolve().parents[1]
PCM_RATE_HZ = 24000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/cluster_demo",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "serve_config.cluster_demo.yaml")
    parser.add_argument("--out", type=Path, default=None,
                        help="timeline JSON (default artifacts/cluster_demo/<timestamp>.json)")
    parser.add_argument("--heavy-users", type=int, default=4)
    parser.add_argument("--trickle-users", type=int, default=1)
    parser.add_argument("--hold-s", type=float, default=8.0,
                        help="heavy load continues this long once 2 replicas run")
    parser.add_argument("--max-heavy-s", type=float, default=90.0)
    parser.add_argument("--max-trickle-s", type=float, default=60.0)
    parser.add_argument("--idle-s", type=float, default=3.0)
    parser.add_argument("--poll-s", type=float, default=0.5)
    parser.add_argument("--ready-timeout-s", type=float, default=180.0)
    parser.add_argument("--logs", type=Path, default=None,
                        help="copy the cluster's logs here at the end")
    return parser.parse_args(argv)


@dataclass
class StreamResult:
    phase: str
    start_s: float
    total_s: float
    ok: bool
    ttfb_s: float | None = None
    audio_s: float = 0.0
    status: int | None = None
    error: str | None = None


@dataclass
class Recorder:
    """What the demo saw: samples of replica states, phase changes, every stream's outcome."""

    t0: float = field(default_factory=time.monotonic)
    phase: str = "starting"
    samples: list[dict[str, Any]] = field(default_factory=list)
    phases: list[dict[str, Any]] = field(default_factory=list)
    streams: list[StreamResult] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def enter(self, phase: str, users: int) -> None:
        self.phase = phase
        self.phases.append({"phase": phase, "t_s": self.now(), "users": users})
        logger.info("phase %s: %d users", phase, users)

    def add_stream(self, result: StreamResult) -> None:
        with self.lock:
            self.streams.append(result)


class LoadGroup:
    """``users`` threads, each streaming speech back to back until stopped."""

    def __init__(self, base_url: str, users: int, recorder: Recorder, seed: int) -> None:
        self._base_url = base_url
        self._recorder = recorder
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(random.Random(seed + i),),
                                          daemon=True) for i in range(users)]

    def start(self) -> LoadGroup:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, wait: bool = False) -> None:
        """Stop starting streams; those in flight finish (``wait``: until they have)."""
        self._stop.set()
        if wait:
            for thread in self._threads:
                thread.join()

    def _loop(self, rng: random.Random) -> None:
        with httpx.Client(base_url=self._base_url, timeout=120) as client:
            while not self._stop.is_set():
                text = rng.choice(MEDIUM if rng.random() < 0.3 else SHORT)
                self._recorder.add_stream(self._one(client, text))

    def _one(self, client: httpx.Client, text: str) -> StreamResult:
        phase = self._recorder.phase
        start = self._recorder.now()
        started = time.perf_counter()
        audio = AudioCounter("pcm", PCM_RATE_HZ)
        ttfb_s = None
        try:
            with client.stream("POST", "/v1/speech/stream",
                               json={"text": text, "format": "pcm"}) as response:
                if response.status_code != 200:
                    response.read()
                    return StreamResult(phase, start, time.perf_counter() - started, False,
                                        status=response.status_code,
                                        error=response.text[:200])
                for piece in response.iter_raw():
                    if piece and ttfb_s is None:
                        ttfb_s = time.perf_counter() - started
                    audio.feed(piece)
        except httpx.HTTPError as exc:
            return StreamResult(phase, start, time.perf_counter() - started, False,
                                error=f"{type(exc).__name__}: {exc}"[:200])
        ok = audio.audio_s > 0
        return StreamResult(phase, start, round(time.perf_counter() - started, 3), ok,
                            ttfb_s=round(ttfb_s, 3) if ttfb_s else None,
                            audio_s=round(audio.audio_s, 3), status=200,
                            error=None if ok else "no audio")


def replica_nodes() -> list[str]:
    """Short ids of the nodes that hold a live Synthesizer replica (one entry per replica)."""
    import ray

    nodes = []
    for actor in ray._private.state.actors().values():  # GCS actor table: no dashboard needed
        name = actor.get("Name") or ""
        if actor.get("State") == "ALIVE" and f"#{DEPLOYMENT}#" in name:
            nodes.append(actor["Address"]["NodeID"][:8])
    return sorted(nodes)


def poll(recorder: Recorder, stop: threading.Event, interval_s: float) -> None:
    last = None
    while not stop.is_set():
        try:
            states, nodes = replica_states(), replica_nodes()
        except Exception as exc:  # a slow controller must not end the demo's record
            logger.warning("status poll failed: %s", exc)
            stop.wait(interval_s)
            continue
        with recorder.lock:
            done = len(recorder.streams)
            failed = sum(not s.ok for s in recorder.streams)
        sample = {"t_s": recorder.now(), "phase": recorder.phase,
                  "running": states.get("RUNNING", 0), "states": states,
                  "replica_nodes": nodes, "streams_done": done, "streams_failed": failed}
        recorder.samples.append(sample)
        if (states, recorder.phase) != last:
            print(f"{sample['t_s']:7.1f} s  {recorder.phase:<8} Synthesizer replicas: "
                  f"{states or '{}'}  on nodes {nodes}  streams done {done}, failed {failed}",
                  flush=True)
            last = (states, recorder.phase)
        stop.wait(interval_s)


def wait_until(predicate: Any, timeout_s: float, interval_s: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return False


def running(recorder: Recorder) -> int:
    return recorder.samples[-1]["running"] if recorder.samples else 0


def settled_at_one(recorder: Recorder) -> bool:
    return bool(recorder.samples) and recorder.samples[-1]["states"] == {"RUNNING": 1}


def deploy(config_path: Path, port: int) -> None:
    """What ``serve deploy`` does, from this driver: start Serve and submit the config."""
    config_dict = yaml.safe_load(config_path.read_text())
    config_dict.setdefault("http_options", {})["port"] = port
    deploy_config(config_dict)


def deploy_config(config_dict: dict[str, Any]) -> None:
    """Start Serve (its HTTP options from the config) and submit the config's applications."""
    from ray.serve._private.api import serve_start
    from ray.serve.config import gRPCOptions
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(config_dict)
    client = serve_start(http_options=config.http_options.model_dump(),
                         proxy_location=config.proxy_location,
                         grpc_options=gRPCOptions(**config.grpc_options.model_dump()))
    client.deploy_apps(config)


def verdict(recorder: Recorder) -> dict[str, Any]:
    running_series = [s["running"] for s in recorder.samples]
    peak = max(running_series, default=0)
    peak_at = running_series.index(peak) if running_series else 0
    started_at_one = bool(running_series) and running_series[0] == 1
    back_to_one = any(s["states"] == {"RUNNING": 1} for s in recorder.samples[peak_at:])
    failures = [asdict(s) for s in recorder.streams if not s.ok]
    checks = {
        "started_with_1_replica": started_at_one,
        "scaled_up_to_at_least_2": peak >= 2,
        "scaled_back_to_1": peak >= 2 and back_to_one,
        "no_failed_streams": not failures and bool(recorder.streams),
    }
    return {"passed": all(checks.values()), "checks": checks, "peak_replicas": peak,
            "failures": failures[:10]}


def phase_stats(recorder: Recorder) -> dict[str, Any]:
    stats = {}
    for phase in ("heavy", "trickle"):
        streams = [s for s in recorder.streams if s.phase == phase]
        ttfbs = sorted(s.ttfb_s for s in streams if s.ttfb_s is not None)
        stats[phase] = {
            "streams": len(streams), "failed": sum(not s.ok for s in streams),
            "audio_s": round(sum(s.audio_s for s in streams), 1),
            "ttfb_p50_s": ttfbs[len(ttfbs) // 2] if ttfbs else None,
            "ttfb_max_s": ttfbs[-1] if ttfbs else None,
        }
    return stats


def run(args: argparse.Namespace, cluster: LocalCluster, recorder: Recorder) -> None:
    # Before Ray is imported: it reads RAY_AUTH_MODE (token) once, at import.
    os.environ.update({k: v for k, v in cluster.env.items() if k.startswith("RAY_")})
    import ray

    ray.init(address=cluster.address, namespace="serve", log_to_driver=False,
             configure_logging=False)
    if not wait_until(lambda: sum(n["Alive"] for n in ray.nodes()) >= 3, 60):
        raise RuntimeError("the worker nodes never joined")
    [port] = free_ports(1)
    base_url = f"http://127.0.0.1:{port}"
    recorder.enter("deploying", 0)
    deploy(args.config, port)

    def ready() -> bool:
        try:
            return httpx.get(f"{base_url}/readyz", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    if not wait_until(ready, args.ready_timeout_s, 0.5):
        raise RuntimeError(f"the app never became ready at {base_url}")

    stop_polling = threading.Event()
    poller = threading.Thread(target=poll, args=(recorder, stop_polling, args.poll_s),
                              daemon=True)
    poller.start()
    try:
        wait_until(lambda: settled_at_one(recorder), 30)
        recorder.enter("heavy", args.heavy_users + args.trickle_users)
        trickle = LoadGroup(base_url, args.trickle_users, recorder, seed=1000).start()
        heavy = LoadGroup(base_url, args.heavy_users, recorder, seed=0).start()
        if wait_until(lambda: running(recorder) >= 2, args.max_heavy_s):
            time.sleep(args.hold_s)
        recorder.enter("trickle", args.trickle_users)
        heavy.stop()
        # Down to one replica, and nothing left starting or stopping.
        wait_until(lambda: settled_at_one(recorder), args.max_trickle_s)
        recorder.enter("idle", 0)
        trickle.stop(wait=True)
        heavy.stop(wait=True)
        time.sleep(args.idle_s)
    finally:
        stop_polling.set()
        poller.join()
        ray.shutdown()


def _dump(result: dict[str, Any]) -> str:
    """JSON with one line per timeline sample, so the file reads as a table."""
    head = {k: v for k, v in result.items() if k != "timeline"}
    rows = ",\n".join(f"  {json.dumps(sample)}" for sample in result["timeline"])
    return json.dumps(head, indent=1)[:-2] + f',\n "timeline": [\n{rows}\n ]\n}}\n'


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    out = args.out or (ROOT / "artifacts" / "cluster_demo"
                       / f"{time.strftime('%Y%m%d-%H%M%S')}.json")
    recorder = Recorder()
    load_at_start = round(os.getloadavg()[0], 2)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cluster = LocalCluster(head_cpus=1, worker_cpus=1,
                           worker_resources=[{"gpu_like": 1.0}, {"gpu_like": 1.0}])
    error = None
    try:
        cluster.start()
        logger.info("cluster up: head + %d workers at %s (%.0f s)", len(cluster.nodes) - 1,
                    cluster.address, recorder.now())
        run(args, cluster, recorder)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        logger.exception("demo failed")
    finally:
        cluster.stop(keep_logs_in=args.logs)
    result = {
        "what": "Synthesizer replicas on a head + 2 worker Ray cluster (one machine) under load",
        "config": str(args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT)
                      else args.config),
        "nodes": [node.name for node in cluster.nodes],
        "load": {"heavy_users": args.heavy_users, "trickle_users": args.trickle_users},
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cpu_count": os.cpu_count(),
        # The machine's 1-minute load average: other work on it slows every phase down.
        "load_average_1m": {"start": load_at_start, "end": round(os.getloadavg()[0], 2)},
        **verdict(recorder),
        "error": error,
        "phases": recorder.phases,
        "phase_stats": phase_stats(recorder),
        "timeline": recorder.samples,
    }
    if error:
        result["passed"] = False
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(_dump(result))
    print(f"cluster_demo: {'PASSED' if result['passed'] else 'FAILED'} {result['checks']} "
          f"peak {result['peak_replicas']} replicas; streams {phase_stats(recorder)}; "
          f"wrote {out}", flush=True)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
