"""A client's side of ``WS /v1/audio/speech/stream`` for the tests of the real app (synchronous
``websockets``), an app run beside the session's, and a streamed-input request opened on a
Synthesizer replica through its handle.
"""

from __future__ import annotations

import json
from typing import Any

from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from tests.serving.conftest import Server, wait_ready

ROUTE = "/v1/audio/speech/stream"
RECEIVE_TIMEOUT_S = 120


def open_socket(server: Server, headers: dict[str, str] | None = None) -> ClientConnection:
    url = server.base_url.replace("http://", "ws://") + ROUTE
    return connect(url, additional_headers=server.auth if headers is None else headers,
                   max_size=None, open_timeout=60)


def send(socket: ClientConnection, kind: str, **fields: Any) -> None:
    socket.send(json.dumps({"type": kind, **fields}))


def receive_event(socket: ClientConnection) -> dict[str, Any]:
    """The next JSON event (binary frames before it are skipped)."""
    while True:
        message = socket.recv(timeout=RECEIVE_TIMEOUT_S)
        if isinstance(message, str):
            return json.loads(message)


def start(socket: ClientConnection, **fields: Any) -> dict[str, Any]:
    send(socket, "session.start", response_format="pcm", sample_rate=24000, **fields)
    started = receive_event(socket)
    assert started["type"] == "session.started", started
    return started


def drain(socket: ClientConnection) -> tuple[list[dict[str, Any]], bytes]:
    """Every event and all audio until the server closes the socket."""
    events, audio = [], bytearray()
    try:
        while True:
            message = socket.recv(timeout=RECEIVE_TIMEOUT_S)
            if isinstance(message, bytes):
                audio.extend(message)
            else:
                events.append(json.loads(message))
    except ConnectionClosed:
        pass
    return events, bytes(audio)


def serve_beside(server: Server, ingress, name: str, prefix: str, what: str) -> Server:
    """``ingress`` run as the app ``name`` under ``prefix``, beside the session's app, with its
    keys: once it answers."""
    from ray import serve

    serve.run(ingress, name=name, route_prefix=prefix)
    app = Server(base_url=f"{server.base_url}{prefix}", api_key=server.api_key,
                 metrics_url=server.metrics_url, voice_store=server.voice_store)
    wait_ready(app.base_url, what)
    return app


def open_streamed(handle, request_id: str):
    """A streamed-input request opened on some replica through the handle: its TextInputOpen
    and the rest of its stream."""
    from serve_app.engines.base import SpeechRequest
    from serve_app.messages import TextInputOpen

    stream = handle.synthesize.options(stream=True).remote(
        SpeechRequest(request_id=request_id, text="", text_input="streamed"))
    first = next(stream)
    assert isinstance(first, TextInputOpen), first
    return first, stream
