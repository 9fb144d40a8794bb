"""What the scenarios on the autoscaling cluster share: the app they serve there (the demo config,
its Ingress kept on the head, its Synthesizer paced and draining as a GPU profile's), its
replicas (two on two GPU-like nodes, where each stream ran), connecting to the cluster, the
options every scenario takes, and the run with its report (:func:`report_run`: the cluster
started and stopped around it, whatever happens, and the JSON written)."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import platform
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from harness.service import git_commit
from fleet.autoscaling_cluster import FRONT, AutoscalingLocalCluster
from fleet.cluster_demo import replica_states, wait_until
from harness.stream_clients import KINDS, StreamOutcome, one_stream
from loadtest.corpus import MEDIUM, SHORT

logger = logging.getLogger(__name__)

# The app on this cluster: serve_config.cluster_demo.yaml (Piper, the Synthesizer on a
# GPU-like node each), with the Ingress kept on the head.
ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIG = ROOT / "serve_config.cluster_demo.yaml"
APP_NAME = "tts"
SYNTHESIZER = "Synthesizer"
GRACEFUL_SHUTDOWN_S = 300  # serve_config.yaml's Synthesizer: the longest stream, 4096 characters
HEALTH_CHECK_TIMEOUT_S = 120  # Serve's default is 30 s
PACED_LEAD_S = 1.0  # the Synthesizer's Piper holds each stream until 1 s before it plays out


def fleet_app_config(port: int, config_path: Path = DEMO_CONFIG) -> dict[str, Any]:
    """The demo config on ``port``, with the Ingress asking for the head's :data:`FRONT`
    resource: a worker node that dies then takes only Synthesizer replicas with it (on a real
    cluster the Ingress goes to the head or a CPU node group); the Synthesizer drains as long as
    a GPU profile's, and holds each stream as long as its audio plays."""
    config = copy.deepcopy(yaml.safe_load(config_path.read_text()))
    config.setdefault("http_options", {})["port"] = port
    [app] = config["applications"]
    # Piper alone finishes a stream in a fraction of its audio on a fast machine: a stream
    # would end before a node is lost or a rollout starts under it, and a load would hold too
    # few streams to ask for a second replica. Each stream is held as long as its audio plays
    # (1 s ahead of its listener), as a GPU engine at load holds it.
    app["args"].setdefault("engine_options", {})["paced_lead_s"] = PACED_LEAD_S
    for deployment in app["deployments"]:
        if deployment["name"] == "Ingress":
            deployment.setdefault("ray_actor_options", {})["resources"] = {FRONT: 1}
            # Ray runs replicas at nice 15: on this 2-core machine, shared with other sessions'
            # test runs (load average 40-60), the one Ingress went unanswered for three 30 s
            # health checks in a row and Serve replaced it, cutting every stream through it.
            deployment["health_check_timeout_s"] = HEALTH_CHECK_TIMEOUT_S
        if deployment["name"] == SYNTHESIZER:
            # As the GPU profiles: a replica leaving waits out the longest stream. The demo's
            # 60 s suits its ~15 s streams; these runs stream a minute of audio, and a draining
            # replica on a busy 2-core machine took longer than 60 s over five of them (it was
            # killed and cut them).
            deployment["graceful_shutdown_timeout_s"] = GRACEFUL_SHUTDOWN_S
    return config


def deployment_config(config: dict[str, Any], name: str) -> dict[str, Any]:
    [app] = config["applications"]
    return next(d for d in app["deployments"] if d["name"] == name)


def synthesizer_actors(app: str = APP_NAME) -> dict[str, dict[str, Any]]:
    """Replica id -> the GCS actor table's entry of every live Synthesizer replica of ``app``."""
    import ray

    found = {}
    for actor in ray._private.state.actors().values():
        name = actor.get("Name") or ""
        if actor.get("State") == "ALIVE" and name.startswith(f"SERVE_REPLICA::{app}#{SYNTHESIZER}#"):
            found[name.rsplit("#", 1)[1]] = actor
    return found


def synthesizer_replica_nodes(app: str = APP_NAME) -> dict[str, str]:
    """Replica id -> node id of every live Synthesizer replica of ``app`` (the GCS actor
    table)."""
    return {replica: actor["Address"]["NodeID"]
            for replica, actor in synthesizer_actors(app).items()}


# Serve's line for each call a replica starts (at DEBUG: the Synthesizer's logging_config),
# with the call's request id (the client's x-request-id), and ours for a stream's first audio.
CALL_STARTED = re.compile(r"^\S+ \S+ \S+ \S+ \S+ (\S+) -- Started executing request to method "
                          r"'synthesize'", re.M)
FIRST_AUDIO = re.compile(r"first audio of stream=(\w+)")


def trace_synthesizer_calls(config: dict[str, Any]) -> None:
    """Have Serve log each call a Synthesizer replica starts, with its request id, so a stream
    in flight can be traced to its replica (our own line for it comes at the stream's end)."""
    deployment_config(config, SYNTHESIZER)["logging_config"] = {"log_level": "DEBUG"}


def stream_replicas(logs_dir: Path, patterns: tuple[re.Pattern, ...] = (CALL_STARTED, FIRST_AUDIO),
                    app: str = APP_NAME) -> dict[str, str]:
    """Request id -> Synthesizer replica id, from each replica's log: Serve's line for a
    ``synthesize`` call it started (:func:`trace_synthesizer_calls`) or, at the stream's end,
    ours for its first audio (``synthesizer._log_first_chunk``; ``patterns`` (FIRST_AUDIO,):
    only the streams a replica served audio for); the Synthesizer of ``app``."""
    found = {}
    for path in (logs_dir / "serve").glob(f"replica_{app}_{SYNTHESIZER}_*.log"):
        replica = path.stem.rsplit("_", 1)[1]
        text = path.read_text(errors="replace")
        for pattern in patterns:
            for match in pattern.finditer(text):
                found[match[1]] = replica
    return found


def connect_driver(cluster: AutoscalingLocalCluster) -> None:
    """``ray.init`` on the cluster from this process (its auth token and address first: Ray
    reads ``RAY_AUTH_MODE`` once, at import)."""
    os.environ.update({k: v for k, v in cluster.env.items() if k.startswith("RAY_")})
    import ray

    ray.init(address=cluster.address, namespace="serve", log_to_driver=False,
             configure_logging=False)


def two_replica_config(port: int) -> dict[str, Any]:
    """The fleet app with the Synthesizer at two replicas, one per GPU-like node (the
    autoscaler launches the second node for the second), each call traced in its log."""
    config = fleet_app_config(port)
    synthesizer = deployment_config(config, SYNTHESIZER)
    synthesizer.pop("autoscaling_config")
    synthesizer["num_replicas"] = 2
    trace_synthesizer_calls(config)
    return config


def wait_for_two_replicas(base_url: str, timeout_s: float = 400.0) -> None:
    """Until the app answers ready with two Synthesizer replicas on two nodes running."""
    def ready() -> bool:
        try:
            answered = httpx.get(f"{base_url}/readyz", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False
        return (answered and replica_states() == {"RUNNING": 2}
                and len(set(synthesizer_replica_nodes().values())) == 2)

    if not wait_until(ready, timeout_s, 1.0):
        raise RuntimeError(f"two Synthesizer replicas on two nodes never ran ({base_url})")


class NewRequests:
    """A short request over each of plain HTTP, SSE and the WebSocket every ``interval_s``
    (:meth:`keep_going`, until :meth:`stop`), each to ``base_url`` as it is when it starts: a
    scenario moves it (the switch to a new cluster). ``tasks`` and the ``routes`` they went to,
    in step."""

    def __init__(self, base_url: str, clock: Any, give_up_s: float, interval_s: float) -> None:
        self.base_url, self._clock = base_url, clock
        self._give_up_s, self._interval_s = give_up_s, interval_s
        self.tasks: list[asyncio.Task] = []
        self.routes: list[str] = []
        self._stopped = asyncio.Event()
        self._rounds = 0

    def over_each_kind(self) -> None:
        texts = MEDIUM if self._rounds % 3 == 0 else SHORT
        for kind in KINDS:
            self.tasks.append(asyncio.create_task(one_stream(
                kind, self.base_url, texts[self._rounds % len(texts)], self._clock,
                self._give_up_s)))
            self.routes.append(self.base_url)
        self._rounds += 1

    async def keep_going(self) -> None:
        while not self._stopped.is_set():
            self.over_each_kind()
            try:
                await asyncio.wait_for(self._stopped.wait(), self._interval_s)
            except TimeoutError:
                pass

    def stop(self) -> None:
        self._stopped.set()

    async def outcomes(self) -> list[StreamOutcome]:
        return list(await asyncio.gather(*self.tasks))


async def until_under_way(watched: dict[str, StreamOutcome], streams: int, give_up_s: float
                          ) -> None:
    """Until each of ``streams`` streams has begun (in ``watched``) and has its first audio or
    has ended, or ``give_up_s``."""
    deadline = time.monotonic() + give_up_s
    while time.monotonic() < deadline and not (
            len(watched) == streams
            and all(stream.first_audio_s is not None or stream.end_s is not None
                    for stream in watched.values())):
        await asyncio.sleep(0.5)


def add_run_args(parser: Any, out_name: str, streams_per_kind: int, give_up_s: float,
                 streams_help: str) -> None:
    """The options node_loss and upgrade_drain share: long streams per kind, when a stream has
    hung, where the cluster's logs and the JSON go."""
    parser.add_argument("--streams-per-kind", type=int, default=streams_per_kind,
                        help=streams_help)
    parser.add_argument("--give-up-s", type=float, default=give_up_s,
                        help="a stream still open this long after it started has hung")
    add_output_args(parser, out_name)


def add_output_args(parser: Any, out_name: str) -> None:
    """Where a run copies the cluster's logs (``--logs``) and writes its JSON (``--out``,
    ``docs/benchmarks/<out_name>`` unless told)."""
    parser.add_argument("--logs", type=Path, default=None,
                        help="copy the cluster's logs here at the end")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / out_name)


def log_to_screen() -> None:
    """INFO lines with their time; httpx's per-request lines left out."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)


def machine() -> dict[str, Any]:
    return {"cpu_count": os.cpu_count(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "load_average_1m": round(os.getloadavg()[0], 2)}


def timeline_dump(result: dict[str, Any]) -> str:
    """JSON with one line per timeline sample, so the file reads as a table."""
    head = {k: v for k, v in result.items() if k != "timeline"}
    rows = ",\n".join(f"  {json.dumps(sample)}" for sample in result.get("timeline", []))
    return json.dumps(head, indent=1)[:-2] + f',\n "timeline": [\n{rows}\n ]\n}}\n'


def report_run(script: str, what: str, cluster: AutoscalingLocalCluster,
               run: Callable[[], dict[str, Any]], passed: Callable[[dict[str, Any]], bool],
               out: Path, logs: Path | None, headline: Sequence[str],
               dump: Callable[[dict[str, Any]], str] = lambda r: json.dumps(r, indent=1) + "\n",
               under: str | None = None, keep: Sequence[str] = ()) -> dict[str, Any]:
    """Start the cluster, ``run()`` on it and stop it (every process it started ends, its
    logs copied to ``logs`` first), whatever happens; then write the result with what, the
    command, commit, machine and verdict to ``out`` (``under``: as that key of the JSON object
    already there, the rest kept; ``keep``: those keys of it carried into the new one) and print
    its ``headline`` keys."""
    started = time.time()
    machine_at_start = machine()
    result: dict[str, Any] = {}
    error = None
    try:
        cluster.start()
        result = run()
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        logger.exception("the run failed")
    finally:
        cluster.stop(keep_logs_in=logs)
    result = {"what": what, "command": " ".join([f"scripts/{script}", *sys.argv[1:]]),
              "git_commit": git_commit(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "machine": {**machine_at_start,
                          "load_average_1m_end": round(os.getloadavg()[0], 2)},
              "run_s": round(time.time() - started), "error": error, **result}
    result["passed"] = error is None and passed(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    held = json.loads(out.read_text()) if out.exists() and (under or keep) else {}
    if under is None:
        out.write_text(dump({**result, **{k: held[k] for k in keep if k in held}}))
    else:
        out.write_text(dump({**held, under: result}))
    print(json.dumps({k: result.get(k) for k in ("passed", "error", *headline)}),
          f"wrote {out}", flush=True)
    return result
