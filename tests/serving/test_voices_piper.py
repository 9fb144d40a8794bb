"""Voices on the session's Piper app: the routes answer, Piper refuses to clone, nothing is stored.

(Creating and speaking with voices runs on the MiniCPM-o engine: test_voices_minicpmo.py.)
"""

from __future__ import annotations

import io
import json

import httpx
import numpy as np
import pytest
import soundfile as sf

from tests.serving.conftest import Server

pytestmark = pytest.mark.slow

UNKNOWN_VOICE = "voice_" + "0123456789abcdef01234567"


def wav_clip(seconds: float = 3.0, rate: int = 16000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    samples = 0.3 * np.sin(2 * np.pi * 140 * t) * (0.5 - 0.5 * np.cos(2 * np.pi * 4 * t))
    buffer = io.BytesIO()
    sf.write(buffer, samples.astype(np.float32), rate, format="WAV")
    return buffer.getvalue()


def stored_files(server: Server) -> list[str]:
    return sorted(str(path) for path in server.voice_store.rglob("*"))


def assert_error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    return error


def test_piper_refuses_to_clone_a_voice_naming_its_engine_and_stores_nothing(
        server: Server, client: httpx.Client) -> None:
    before = stored_files(server)
    response = client.post("/v1/audio/voices", data={"name": "Ada", "consent": "true"},
                           files={"audio_sample": ("ada.wav", wav_clip(), "audio/wav")})
    error = assert_error(response, 422, "voice_cloning_unsupported")
    assert "piper" in error["message"]
    assert stored_files(server) == before
    assert client.get("/v1/audio/voices").json() == {"object": "list", "data": []}


def test_uploads_are_held_to_their_media_type_and_size_before_anything_runs(
        server: Server, client: httpx.Client) -> None:
    json_body = client.post("/v1/audio/voices", json={"name": "Ada"})
    assert_error(json_body, 415, "unsupported_media_type")
    oversized = client.post("/v1/audio/voices", data={"name": "Ada", "consent": "true"},
                            files={"audio_sample": ("big.wav", b"\0" * (11 * 1024 * 1024),
                                                    "audio/wav")})
    assert_error(oversized, 413, "request_too_large")
    # A speech body keeps its own, smaller limit.
    speech = client.post("/v1/audio/speech", json={"model": "tts-1", "voice": "alloy",
                                                   "input": "a" * 70_000})
    assert_error(speech, 413, "request_too_large")
    unauthenticated = httpx.get(f"{server.base_url}/v1/audio/voices", timeout=30)
    assert_error(unauthenticated, 401, "invalid_api_key")


def test_an_unknown_voice_id_is_404_on_every_route_before_the_engine_runs(
        server: Server, client: httpx.Client) -> None:
    steps = server.synthesizer_stats()["engine"]["steps"]
    for path, body in (("/v1/audio/speech", {"model": "tts-1", "input": "Hi.",
                                             "voice": UNKNOWN_VOICE}),
                       ("/v1/speech/stream", {"text": "Hi.", "voice": UNKNOWN_VOICE}),
                       ("/v1/speech/stream", {"text": "Hi.", "voice": "voice_../../etc"})):
        error = assert_error(client.post(path, json=body), 404, "voice_not_found")
        assert error["param"] == "voice"
    assert_error(client.get(f"/v1/audio/voices/{UNKNOWN_VOICE}"), 404, "voice_not_found")
    assert_error(client.delete(f"/v1/audio/voices/{UNKNOWN_VOICE}"), 404, "voice_not_found")
    assert server.synthesizer_stats()["engine"]["steps"] == steps
    # The engine's own voices are still listed where they were; stored voices never are.
    voices = client.get("/v1/voices").json()
    assert "joe" in [voice["id"] for voice in voices["data"]]
    assert voices["clones_voices"] is False  # the page shows no voice card


def test_an_unknown_voice_id_ends_a_websocket_session_with_an_error_event(
        server: Server) -> None:
    from websockets.sync.client import connect

    url = server.base_url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    with connect(url, additional_headers=server.auth, open_timeout=60) as socket:
        socket.send(json.dumps({"type": "session.start", "voice": UNKNOWN_VOICE}))
        event = json.loads(socket.recv(timeout=60))
    assert event["type"] == "error" and event["error"]["code"] == "voice_not_found", event
