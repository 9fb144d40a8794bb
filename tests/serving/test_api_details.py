"""API details of issue 38, over real HTTP and WebSocket against the session's app: event
durations that match the bytes, the OpenAI route's own field names in refusals, JSON bodies that
cannot be parsed, and unknown voices answered with every name a request may use."""

from __future__ import annotations

import base64
import json

import httpx
import pytest
from websockets.sync.client import connect

from serve_app.config import ApiConfig
from tests.serving.conftest import Server

pytestmark = pytest.mark.slow

TEXT = "Durations follow the bytes. A second sentence, with a comma, makes more chunks."
OPENAI = {"model": "tts-1", "voice": "alloy", "input": TEXT}
ERROR_KEYS = {"message", "type", "param", "code"}
ALIASES = ApiConfig().voice_aliases


def sse_events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[len("data:"):]) for line in response.text.splitlines()
            if line.startswith("data:")]


def check_durations(chunks: list[tuple[bytes, float, float]], rate_hz: int) -> None:
    """Each chunk's duration is its pcm bytes' length at the rate, offsets add up, and the
    stream's last audio (the resampler's tail) is counted as well."""
    offset_samples = 0
    for data, offset_s, duration_s in chunks:
        samples = len(data) // 2
        assert duration_s == pytest.approx(samples / rate_hz, abs=1e-6), (samples, duration_s)
        assert offset_s == pytest.approx(offset_samples / rate_hz, abs=1e-6)
        offset_samples += samples
    assert chunks and offset_samples > 0
    data, _, duration_s = chunks[-1]
    assert data and duration_s > 0  # never a 0.0 on audio


def test_sse_durations_match_the_bytes_sent(client: httpx.Client) -> None:
    # Piper speaks at 22050 Hz; the OpenAI route's pcm is 24 kHz: every chunk is resampled.
    response = client.post("/v1/audio/speech",
                           json={**OPENAI, "response_format": "pcm", "stream_format": "sse"})
    assert response.status_code == 200, response.text
    *deltas, done = sse_events(response)
    assert done["type"] == "speech.audio.done"
    chunks = [(base64.b64decode(event["audio"]), event["audio_offset_s"], event["duration_s"])
              for event in deltas]
    check_durations(chunks, 24000)
    assert deltas[-1]["text"] == ""  # the tail: audio the resampler held back


def test_websocket_durations_match_the_bytes_sent(server: Server) -> None:
    url = server.base_url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    chunks = []
    with connect(url, additional_headers=server.auth, max_size=None, open_timeout=60) as ws:
        ws.send(json.dumps({"type": "session.start", "response_format": "pcm",
                            "sample_rate": 16000}))
        assert json.loads(ws.recv(timeout=120))["type"] == "session.started"
        ws.send(json.dumps({"type": "input_text.delta", "delta": TEXT}))
        ws.send(json.dumps({"type": "input_text.done"}))
        while True:
            event = json.loads(ws.recv(timeout=120))
            if event["type"] != "audio.chunk":
                break
            data = ws.recv(timeout=120) if event["bytes"] else b""
            assert isinstance(data, bytes) and len(data) == event["bytes"]
            chunks.append((data, event["audio_offset_s"], event["duration_s"]))
    assert event["type"] == "response.done", event
    check_durations(chunks, 16000)


@pytest.mark.parametrize(("text", "code"), [
    ("", "nothing_to_speak"),  # the text rule (in the ingress)
    ("...", "nothing_to_speak"),  # the engine's validate: espeak-ng finds nothing to say
    ("a" * 4097, "text_too_long"),
])
def test_the_openai_route_names_its_own_field(client: httpx.Client, text: str,
                                              code: str) -> None:
    for extra in ({}, {"stream_format": "sse"}):
        response = client.post("/v1/audio/speech", json={**OPENAI, "input": text, **extra})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"]) == ("input", code), error
        assert error["message"].startswith("input "), error
    native = client.post("/v1/speech/stream", json={"text": text})
    assert native.status_code == 400
    assert native.json()["error"]["param"] == "text"


@pytest.mark.parametrize("body", [
    b'{"model": "tts-1", "voice": "alloy", "input": "caf\xe9"}',  # latin-1, not UTF-8
    b"\xff\xfe\x00garbage",
    b"[" * 20000 + b"]" * 20000,
    b'{"text":' + b'{"a":' * 8000 + b"1" + b"}" * 8001,  # within max_body_bytes
], ids=["latin-1", "binary", "deep-array", "deep-object"])
def test_unparsable_json_is_400_invalid_json(server: Server, client: httpx.Client,
                                             body: bytes) -> None:
    steps_before = server.synthesizer_stats()["engine"]["steps"]
    for path in ("/v1/audio/speech", "/v1/speech/stream"):
        response = client.post(path, content=body, headers={"content-type": "application/json"})
        assert response.status_code == 400, (path, response.text)
        error = response.json()["error"]
        assert set(error) == ERROR_KEYS and error["code"] == "invalid_json", error
    assert server.synthesizer_stats()["engine"]["steps"] == steps_before


def test_a_deeply_nested_websocket_message_is_an_invalid_json_event(server: Server) -> None:
    url = server.base_url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    with connect(url, additional_headers=server.auth, max_size=None, open_timeout=60) as ws:
        ws.send("[" * 20000 + "]" * 20000)
        event = json.loads(ws.recv(timeout=60))
        assert event["type"] == "error" and event["error"]["code"] == "invalid_json", event
        # The session goes on.
        ws.send(json.dumps({"type": "session.start", "response_format": "pcm"}))
        assert json.loads(ws.recv(timeout=120))["type"] == "session.started"
        ws.send(json.dumps({"type": "cancel"}))


def check_unknown_voice(error: dict) -> None:
    assert (error["param"], error["code"]) == ("voice", "unknown_voice"), error
    message = error["message"]
    assert "'nobody'" in message and "joe" in message, message
    assert all(alias in message for alias in ALIASES), message


def test_an_unknown_voice_lists_the_engine_voices_and_the_openai_names(
        server: Server, client: httpx.Client) -> None:
    steps_before = server.synthesizer_stats()["engine"]["steps"]
    for path, body in (("/v1/speech/stream", {"text": TEXT, "voice": "nobody"}),
                       ("/v1/audio/speech", {**OPENAI, "voice": "nobody"})):
        response = client.post(path, json=body)
        assert response.status_code == 400, response.text
        check_unknown_voice(response.json()["error"])
    url = server.base_url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    with connect(url, additional_headers=server.auth, max_size=None, open_timeout=60) as ws:
        ws.send(json.dumps({"type": "session.start", "voice": "nobody"}))
        event = json.loads(ws.recv(timeout=60))
        assert event["type"] == "error", event
        check_unknown_voice(event["error"])
    # Refused before the engine ran anything; the names it lists all speak.
    assert server.synthesizer_stats()["engine"]["steps"] == steps_before
    for voice in ("joe", "default", ALIASES[0]):
        assert client.post("/v1/speech/stream",
                           json={"text": "Hi.", "voice": voice}).status_code == 200, voice
