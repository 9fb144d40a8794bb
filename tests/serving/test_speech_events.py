"""OpenAI's SSE speech stream and ``instructions`` on the Piper app, over real HTTP."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import openai
import pytest

from tests.serving.conftest import Server

pytestmark = pytest.mark.slow

TEXT = "Server sent events carry the audio. A second sentence makes a second chunk."
SEED = 11
BODY = {"model": "gpt-4o-mini-tts", "voice": "alloy", "input": TEXT, "response_format": "pcm",
        "seed": SEED}


def parse_sse(lines) -> list[dict]:
    """The JSON events of an SSE body (its ``data:`` lines)."""
    return [json.loads(line[len("data:"):]) for line in lines if line.startswith("data:")]


def check_events(events: list[dict]) -> bytes:
    """Deltas then one closing done with usage; offsets follow durations. Returns the audio."""
    *deltas, done = events
    assert deltas and all(event["type"] == "speech.audio.delta" for event in deltas)
    assert done["type"] == "speech.audio.done"
    usage = done["usage"]
    assert usage["input_tokens"] == len(TEXT)  # piper has no tokenizer: characters
    assert usage["output_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    offset = 0.0
    for event in deltas:
        assert event["audio_offset_s"] == pytest.approx(offset, abs=1e-5)
        offset += event["duration_s"]
    audio = b"".join(base64.b64decode(event["audio"]) for event in deltas)
    # pcm at 24 kHz: the durations add up to the audio sent (the engine runs at 22.05 kHz).
    assert len(audio) // 2 == pytest.approx(offset * 24000, abs=48)
    return audio


def test_sse_over_raw_http_is_the_same_pcm_as_the_audio_stream(client: httpx.Client) -> None:
    with client.stream("POST", "/v1/audio/speech", json={**BODY, "stream_format": "sse"}) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(reply.iter_lines())
    sse_audio = np.frombuffer(check_events(events), dtype="<i2").astype(np.int32)
    plain = client.post("/v1/audio/speech", json={**BODY, "stream_format": "audio"})
    assert plain.status_code == 200 and plain.headers["content-type"] == "audio/pcm"
    audio = np.frombuffer(plain.content, dtype="<i2").astype(np.int32)
    assert len(sse_audio) == len(audio) > 24000
    # Float rounding of a differently batched ONNX run may move a sample by a step or two.
    assert np.max(np.abs(sse_audio - audio)) <= 2


def test_sse_through_the_openai_sdk_streaming_call(server: Server) -> None:
    sdk = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key)
    with sdk.audio.speech.with_streaming_response.create(
            model="gpt-4o-mini-tts", voice="nova", input=TEXT, response_format="wav",
            stream_format="sse", extra_body={"seed": SEED}) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(reply.iter_lines())
    audio = check_events(events)
    assert audio[:4] == b"RIFF" and len(audio) > 44 + 24000


def test_errors_before_the_first_event_are_json(client: httpx.Client) -> None:
    for body, status, param in (({"voice": "nobody"}, 400, "voice"),
                                ({"model": "none"}, 404, "model"),
                                ({"stream_format": "frames"}, 400, "stream_format")):
        reply = client.post("/v1/audio/speech", json={**BODY, "stream_format": "sse", **body})
        assert reply.status_code == status, reply.text
        assert reply.headers["content-type"].startswith("application/json")
        assert reply.json()["error"]["param"] == param


@pytest.mark.parametrize("stream_format", ["audio", "sse"])
def test_piper_refuses_instructions_with_a_400_naming_the_parameter(
        client: httpx.Client, stream_format: str) -> None:
    reply = client.post("/v1/audio/speech", json={**BODY, "stream_format": stream_format,
                                                   "instructions": "Speak like a pirate."})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "instructions" and error["code"] == "unsupported_parameter"
    assert "instructions" in error["message"]
    native = client.post("/v1/speech/stream", json={"text": TEXT, "instructions": "Whisper."})
    assert native.status_code == 400 and native.json()["error"]["param"] == "instructions"
    # Empty instructions are no instructions.
    assert client.post("/v1/audio/speech", json={**BODY, "instructions": ""}).status_code == 200


def test_nul_characters_are_refused_before_any_engine_sees_them(client: httpx.Client) -> None:
    for field, value in (("input", "Hello\x00there."), ("instructions", "Loud\x00ly.")):
        reply = client.post("/v1/audio/speech", json={**BODY, field: value})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == field, reply.text


def test_instructions_longer_than_the_limit_are_refused(client: httpx.Client) -> None:
    reply = client.post("/v1/audio/speech", json={**BODY, "instructions": "x" * 1001})
    assert reply.status_code == 400
    assert reply.json()["error"] | {"message": None} == {
        "message": None, "type": "invalid_request_error", "param": "instructions",
        "code": "string_too_long"}


def sse_events(client: httpx.Client, **fields) -> list[dict]:
    with client.stream("POST", "/v1/audio/speech",
                       json={**BODY, "stream_format": "sse", **fields}) as reply:
        assert reply.status_code == 200, reply.read()
        return parse_sse(reply.iter_lines())


def test_word_timestamps_ride_on_the_deltas_where_their_audio_starts(
        client: httpx.Client) -> None:
    from serve_app.engines.words import split_words

    events = sse_events(client, timestamp_granularities=["word"])
    audio = check_events(events)
    deltas = events[:-1]
    words = [word for event in deltas for word in event["words"]]
    assert [word["word"] for word in words] == split_words(TEXT)
    for event in deltas:
        for word in event["words"]:
            assert (event["audio_offset_s"] - 1e-3 <= word["start"]
                    < event["audio_offset_s"] + event["duration_s"] + 1e-3)  # 3 decimals
    assert all(a["end"] <= b["start"] for a, b in zip(words, words[1:]))
    assert all(w["start"] < w["end"] <= len(audio) / 2 / 24000 + 1e-3 for w in words)
    # Off (the default), no event has the key, and the audio is the same.
    plain = sse_events(client)
    assert all("words" not in event for event in plain)
    sse_audio = np.frombuffer(check_events(plain), dtype="<i2").astype(np.int32)
    assert np.max(np.abs(sse_audio - np.frombuffer(audio, dtype="<i2"))) <= 2


@pytest.mark.parametrize("fields, param", [
    ({"timestamp_granularities": ["segment"], "stream_format": "sse"}, "timestamp_granularities"),
    ({"timestamp_granularities": "word", "stream_format": "sse"}, "timestamp_granularities"),
    ({"timestamp_granularities": ["word"]}, "timestamp_granularities"),  # audio: nowhere to go
])
def test_bad_timestamp_granularities_are_a_400_naming_it(
        client: httpx.Client, fields: dict, param: str) -> None:
    reply = client.post("/v1/audio/speech", json={**BODY, **fields})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and "word" in error["message"], error


def test_every_openai_voice_name_is_accepted_marin_and_cedar_included(
        client: httpx.Client) -> None:
    listed = {voice["id"] for voice in client.get("/v1/voices").json()["data"]}
    assert {"marin", "cedar"} <= listed
    for voice in ("marin", "cedar"):
        reply = client.post("/v1/audio/speech", json={**BODY, "voice": voice, "input": "Hi."})
        assert reply.status_code == 200 and len(reply.content) > 2400, reply.text
