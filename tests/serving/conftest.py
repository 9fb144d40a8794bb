"""One real local Ray Serve app on the Piper engine, started once per test session."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

# SERVE_TEST_PORT lets two test runs share a machine.
PORT = int(os.environ.get("SERVE_TEST_PORT", "8765"))
API_KEY = "test-key-123"
APP_NAME = "tts"


@dataclass
class Server:
    base_url: str
    api_key: str
    metrics_url: str

    @property
    def auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"}

    def synthesizer_stats(self) -> dict[str, Any]:
        from ray import serve

        handle = serve.get_deployment_handle("Synthesizer", app_name=APP_NAME)
        return handle.stats.remote().result()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="session")
def server() -> Server:
    import ray
    from ray import serve

    from serve_app.app import build_app
    from serve_app.config import ApiConfig, AppArgs, BatchingConfig

    # address="local": always a fresh cluster of our own, never one already running here.
    # Ray's Prometheus export port (scripts/serve fixes it to 8080): a free one, so test
    # sessions side by side never collide. Metrics arrive within a second (Ray's default: 10 s).
    metrics_port = _free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False,
             log_to_driver=False, _metrics_export_port=metrics_port,
             _system_config={"metrics_report_interval_ms": 1000})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        args = AppArgs(
            engine="piper",
            engine_options={"intra_op_threads": 2, "max_batch_size": 8},
            # A generous wait so requests fired together surely share a batch.
            batching=BatchingConfig(max_batch_size=8, batch_wait_timeout_s=0.2,
                                    max_concurrent_batches=4),
            api=ApiConfig(api_key=API_KEY),
        )
        serve.run(build_app(args), name=APP_NAME, route_prefix="/")
        base_url = f"http://127.0.0.1:{PORT}"
        deadline = time.monotonic() + 120
        while httpx.get(f"{base_url}/readyz", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "service never became ready"
            time.sleep(0.5)
        yield Server(base_url=base_url, api_key=API_KEY,
                     metrics_url=f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture()
def client(server: Server) -> httpx.Client:
    with httpx.Client(base_url=server.base_url, headers=server.auth, timeout=120) as client:
        yield client
