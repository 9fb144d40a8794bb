"""The service's front door: Ray's HAProxy listens on the HTTP port and passes connections to
the Ingress replicas (each serving HTTP itself), so Serve's Python proxy is off the data path."""

from __future__ import annotations

from urllib.parse import urlparse

import httpx
import psutil
import pytest

from tests.serving.conftest import Server

pytestmark = pytest.mark.slow


def listener(port: int) -> psutil.Process:
    for connection in psutil.net_connections(kind="tcp"):
        if connection.status == psutil.CONN_LISTEN and connection.laddr.port == port:
            return psutil.Process(connection.pid)
    raise AssertionError(f"nothing listens on port {port}")


def test_haproxy_listens_on_the_service_port_and_streams_pass_through_it(server: Server) -> None:
    process = listener(urlparse(server.base_url).port)
    assert process.name() == "haproxy", process.cmdline()
    # A streamed reply through it: chunked audio, the service's own headers and request id.
    with httpx.stream("POST", f"{server.base_url}/v1/speech/stream", headers=server.auth,
                      json={"text": "Through the front door.", "format": "pcm"},
                      timeout=120) as response:
        body = b"".join(response.iter_bytes())
    assert response.status_code == 200
    assert response.headers["x-audio-format"] == "pcm"
    assert response.headers.get("x-request-id")
    assert len(body) > 4800 and len(body) % 2 == 0  # > 0.1 s of 24 kHz s16le
