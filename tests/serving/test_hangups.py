"""Client hang-ups against the real app (HAProxy in front): a client that leaves mid-stream is
the client's choice, not a server error (issue 38).

40 HTTP requests closed after their first body byte and 10 WebSocket sessions that send
``cancel`` and close at once must leave no 5xx in ``ray_tts_errors_total``, no ERROR line in the
app's replica logs, no "Task exception was never retrieved", every hang-up logged at INFO as
``outcome=disconnected``, and the engine with no active stream.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from websockets.sync.client import connect

from tests.serving.conftest import APP_NAME, Server
from tests.serving.test_metrics import Samples, scrape, settled

pytestmark = pytest.mark.slow

# A short first sentence: the engine makes a stream's first piece (the hang-up's first byte) in
# one step, whose time grows with the piece; twelve long sentences after it are never heard.
LONG_TEXT = "Hello. " + " ".join(
    f"This is sentence number {n} of a text the client never hears out." for n in range(1, 13))
HANGUPS = 40
SOCKET_CANCELS = 10
UNRETRIEVED = "Task exception was never retrieved"
# Routes and formats the hang-ups cycle through: raw bytes, an encoded format, SSE events.
REQUESTS = (
    ("/v1/speech/stream", {"text": LONG_TEXT, "format": "pcm"}),
    ("/v1/speech/stream", {"text": LONG_TEXT, "format": "wav", "sample_rate": 16000}),
    ("/v1/audio/speech", {"model": "gpt-4o-mini-tts", "voice": "alloy", "input": LONG_TEXT,
                          "response_format": "mp3"}),
    ("/v1/audio/speech", {"model": "gpt-4o-mini-tts", "voice": "alloy", "input": LONG_TEXT,
                          "response_format": "pcm", "stream_format": "sse"}),
)


def log_files() -> list[Path]:
    import ray

    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    return [Path(path) for path in glob.glob(str(logs / "**" / "*"), recursive=True)
            if os.path.isfile(path) and not path.endswith((".pb", ".gz"))]


def log_sizes() -> dict[Path, int]:
    return {path: path.stat().st_size for path in log_files()}


def new_log_text(before: dict[Path, int]) -> dict[Path, str]:
    """What every log file of the session gained since ``before``."""
    text = {}
    for path in log_files():
        with open(path, "rb") as file:
            file.seek(before.get(path, 0))
            text[path] = file.read().decode("utf-8", errors="replace")
    return text


def server_errors(samples: dict[str, Samples]) -> float:
    return sum(value for labels, value in samples.get("ray_tts_errors_total", [])
               if labels.get("status", "").startswith("5"))


def hang_up(server: Server, index: int) -> str:
    """One request read up to its first body byte, then the connection closed (every other
    one reset at once); returns its request id."""
    path, body = REQUESTS[index % len(REQUESTS)]
    request_id = f"hangup-{index}-{time.monotonic_ns()}"
    data = json.dumps(body).encode()
    address = urlsplit(server.base_url)
    head = (f"POST {path} HTTP/1.1\r\nHost: {address.netloc}\r\n"
            f"Authorization: Bearer {server.api_key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nX-Request-Id: {request_id}\r\n\r\n").encode()
    with socket.create_connection((address.hostname, address.port), timeout=120) as conn:
        conn.sendall(head + data)
        received = b""
        while b"\r\n\r\n" not in received:
            piece = conn.recv(65536)
            assert piece, f"{request_id}: closed before the headers"
            received += piece
        headers, _, body_start = received.partition(b"\r\n\r\n")
        assert headers.startswith(b"HTTP/1.1 200"), headers
        if not body_start:
            assert conn.recv(1), f"{request_id}: no body byte"
        if index % 2:  # RST instead of FIN
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    return request_id


def cancel_and_close(server: Server, index: int) -> None:
    """A WebSocket session that gets its first audio, sends ``cancel`` and closes at once
    without waiting for ``response.cancelled`` (every other one drops the TCP connection)."""
    url = server.base_url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    with connect(url, additional_headers=server.auth, max_size=None, open_timeout=60) as ws:
        ws.send(json.dumps({"type": "session.start", "response_format": "pcm"}))
        assert json.loads(ws.recv(timeout=120))["type"] == "session.started"
        ws.send(json.dumps({"type": "input_text.delta", "delta": LONG_TEXT}))
        ws.send(json.dumps({"type": "input_text.done"}))
        first = json.loads(ws.recv(timeout=120))
        assert first["type"] == "audio.chunk", first
        ws.send(json.dumps({"type": "cancel"}))
        if index % 2:
            ws.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            ws.socket.close()


def test_hang_ups_are_the_clients_choice_not_server_errors(server: Server) -> None:
    settled(server, "ray_tts_errors_total")
    errors_before = server_errors(scrape(server))
    aborted_before = server.synthesizer_stats()["engine"]["aborted"]
    logs_before = log_sizes()

    with ThreadPoolExecutor(4) as pool:
        request_ids = list(pool.map(lambda index: hang_up(server, index), range(HANGUPS)))
        list(pool.map(lambda index: cancel_and_close(server, index), range(SOCKET_CANCELS)))

    deadline = time.monotonic() + 60
    while (stats := server.synthesizer_stats()["engine"])["active_streams"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)
    # Every hang-up came before its stream's end: each was aborted in the engine.
    assert stats["aborted"] >= aborted_before + HANGUPS + SOCKET_CANCELS, stats
    assert stats["queued_streams"] == 0, stats

    # Every hang-up's log line, at INFO, says the client left.
    deadline = time.monotonic() + 30
    while True:
        logs = new_log_text(logs_before)
        lines = {request_id: [line for path, text in logs.items()
                              if f"replica_{APP_NAME}_Ingress" in path.name
                              for line in text.splitlines() if f"id={request_id} " in line]
                 for request_id in request_ids}
        if all(lines.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for request_id, found in lines.items():
        assert len(found) == 1, (request_id, found)
        assert found[0].startswith("INFO") and "outcome=disconnected" in found[0], found[0]

    time.sleep(2)  # asyncio reports an unretrieved task exception when the task is collected
    logs = new_log_text(logs_before)
    # The app's replicas (Ingress: HTTP, WebSocket; Synthesizer). With HAProxy in front the
    # Ingress replicas serve HTTP themselves, so Serve's "Request failed due to unexpected
    # error" would be logged there too.
    app_logs = {path: text for path, text in logs.items()
                if path.name.startswith(f"replica_{APP_NAME}_")}
    bad = [f"{path.name}: {line}" for path, text in app_logs.items()
           for line in text.splitlines() if line.startswith("ERROR") or "Traceback" in line]
    assert not bad, "\n".join(bad[:20])
    unretrieved = [path.name for path, text in logs.items() if UNRETRIEVED in text]
    assert not unretrieved, unretrieved

    samples = settled(server, "ray_tts_errors_total")
    assert server_errors(samples) == errors_before, [
        (labels, value) for labels, value in samples.get("ray_tts_errors_total", [])]
