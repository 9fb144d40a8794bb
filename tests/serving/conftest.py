"""One real local Ray Serve app on the Piper engine, started once per test session.

The ``server`` and ``client`` fixtures are in tests/conftest.py (tests/serving and tests/clients
share the one app); :func:`serve_piper_app` starts it.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import json

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "test-key-123"
CLUSTER_MARKER = "TEST_RAY_CLUSTER_ID"  # in the environment of every process the cluster starts
APP_NAME = "tts"
# For Ray processes started by this session only (the controller and the proxy read them).
RAY_ENV = {
    # Ray's proxy binds its port with SO_REUSEPORT by default, so a second test session on the
    # same port shares it without an error and the kernel spreads connections over both
    # clusters: requests for an app only this session runs then get 404s from the other one.
    # Off, a taken port fails serve.start instead.
    "SERVE_SOCKET_REUSE_PORT_ENABLED": "0",
    # Ray's 5 s (ready) and 10 s (health) proxy checks miss on a loaded two-core machine; after
    # three misses the controller kills the proxy and serve.start fails.
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30",
}


def production_replica_env() -> dict[str, str]:
    """The Serve settings the shipped config gives every replica (its app's runtime_env), so
    the tests' apps move requests and chunks the way production does."""
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text(encoding="utf-8"))
    return dict(config["applications"][0]["runtime_env"]["env_vars"])


RAY_ENV.update(production_replica_env())


def ray_env() -> dict[str, str]:
    """The environment of a cluster this session starts: :data:`RAY_ENV`, and HAProxy in front
    (as every shipped profile runs) on ports of its own."""
    from harness.service import haproxy_env_of_its_own

    return {**RAY_ENV, **haproxy_env_of_its_own()}


@dataclass
class Server:
    base_url: str
    api_key: str
    metrics_url: str
    voice_store: Path

    @property
    def auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"}

    def synthesizer_stats(self) -> dict[str, Any]:
        from ray import serve

        handle = serve.get_deployment_handle("Synthesizer", app_name=APP_NAME)
        return handle.stats.remote().result()


def wait_ready(base_url: str, what: str, timeout_s: float = 180) -> None:
    """Poll ``/readyz`` until it answers 200 (serve.run returns before every proxy routes)."""
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{base_url}/readyz", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, f"{what} never became ready"
        time.sleep(0.5)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve_piper_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Start the app on a fresh local Ray cluster of its own, yield it, then end the cluster."""
    import ray
    from ray import serve

    from serve_app.app import build_app
    from serve_app.config import ApiConfig, AppArgs, BatchingConfig

    # address="local": always a fresh cluster of our own, never one already running here.
    # Its HTTP port (SERVE_TEST_PORT, else a free one) and Ray's Prometheus export port
    # (scripts/serve fixes it to 8080) are this session's own, so test sessions side by side
    # never collide. Metrics arrive within a second (Ray's default: 10 s).
    port = int(os.environ.get("SERVE_TEST_PORT") or _free_port())
    metrics_port = _free_port()
    env = {**ray_env(), CLUSTER_MARKER: secrets.token_hex(8)}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)  # inherited by the raylet, hence by every Ray worker
    try:
        ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False,
                 log_to_driver=False, _metrics_export_port=metrics_port,
                 _system_config={"metrics_report_interval_ms": 1000})
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    voice_store = tmp_path_factory.mktemp("voices")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = AppArgs(
            engine="piper",
            # Admission by slots: these tests check the API with streams side by side on a machine
            # shared with other work, where measured load would refuse some (admission by work
            # is tested on the CPU profile, tests/serving/test_overload.py)
            engine_options={"intra_op_threads": 2, "max_batch_size": 8, "admission": "slots"},
            # A generous wait so requests fired together surely share a batch.
            batching=BatchingConfig(max_batch_size=8, batch_wait_timeout_s=0.2,
                                    max_concurrent_batches=4),
            api=ApiConfig(api_key=API_KEY, voice_store=str(voice_store)),
        )
        serve.run(build_app(args), name=APP_NAME, route_prefix="/")
        base_url = f"http://127.0.0.1:{port}"
        wait_ready(base_url, "the service", timeout_s=120)
        yield Server(base_url=base_url, api_key=API_KEY,
                     metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
                     voice_store=voice_store)
    finally:
        serve.shutdown()
        ray.shutdown()
        # Ray's HAProxy outlives the cluster (re-parented, in a group of its own) and would keep
        # its ports: end what this session's cluster left behind.
        from harness.local_ray import end_marked_processes

        end_marked_processes(CLUSTER_MARKER, env[CLUSTER_MARKER], grace_s=5.0)


def speak_word_by_word(base_url: str, start: dict[str, Any], text: str,
                       headers: dict[str, str] | None = None) -> tuple[list[dict], bytes]:
    """One WebSocket session on ``/v1/audio/speech/stream``: ``session.start`` with ``start``,
    ``text`` fed a word at a time, then done; returns the JSON events (the last one
    ``response.done`` or ``error``) and the audio bytes."""
    from websockets.sync.client import connect

    url = base_url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    events, audio = [], bytearray()
    with connect(url, additional_headers=headers or {}, max_size=None,
                 open_timeout=60) as session:
        session.send(json.dumps({"type": "session.start", **start}))
        assert json.loads(session.recv(timeout=120))["type"] == "session.started"
        for index, word in enumerate(text.split(" ")):
            session.send(json.dumps({"type": "input_text.delta",
                                     "delta": word if index == 0 else " " + word}))
        session.send(json.dumps({"type": "input_text.done"}))
        while True:
            message = session.recv(timeout=300)
            if isinstance(message, bytes):
                audio.extend(message)
                continue
            events.append(json.loads(message))
            if events[-1]["type"] in ("response.done", "error"):
                return events, bytes(audio)
