"""The MiniCPM-o engine served through Ray Serve returns exactly what the engine produces."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import numpy as np
import pytest
import torch

from serve_app.engines.base import SpeechRequest
from serve_app.engines.minicpmo.engine import EngineOptions, MiniCPMOEngine
from serve_app.engines.minicpmo.model.loader import load_speech_model
from tests.serving.conftest import speak_word_by_word, wait_ready

APP = "minicpmo-tiny"
PREFIX = "/minicpmo"
TEXT = "Hello there. Streaming speech comes out while the text is still arriving."


def engine_options(checkpoint, voices: bool = False) -> dict:
    """``voices``: voice cloning, which needs a checkpoint with the audio encoder (the tiny voice
    checkpoint; the tiny checkpoint has none)."""
    return {"model": str(checkpoint), "device": "cpu", "dtype": "float32", "max_slots": 4,
            "max_chat_slots": 2, "tts_max_positions": 1024, "llm_max_positions": 256,
            "tts_sampling": "greedy", "max_segment_frames": 300, "voices": voices,
            "admission": "slots"}  # the tiny model on a shared CPU is not real-time


@pytest.fixture(scope="module")
def minicpmo_app(server, tiny_checkpoint):
    """A second app on the session's Ray Serve instance: the tiny checkpoint, greedy decoding."""
    from ray import serve

    from serve_app.config import ApiConfig, BatchingConfig
    from serve_app.front.ingress import Ingress
    from serve_app.gpu.synthesizer import Synthesizer

    small = {"num_cpus": 0.05}
    synthesizer = Synthesizer.options(
        name="Synthesizer", ray_actor_options=small,
        user_config=BatchingConfig(max_batch_size=4, batch_wait_timeout_s=0.05).model_dump(),
    ).bind("minicpmo", engine_options(tiny_checkpoint))
    ingress = Ingress.options(ray_actor_options=small).bind(synthesizer, ApiConfig().model_dump())
    serve.run(ingress, name=APP, route_prefix=PREFIX)
    base = f"{server.base_url}{PREFIX}"
    wait_ready(base, "the minicpmo app")
    yield base
    serve.delete(APP)


def engine_pcm(checkpoint, text: str) -> np.ndarray:
    """The engine's own float output for the same request, converted as the encoder does."""
    model = load_speech_model(str(checkpoint), device="cpu", dtype=torch.float32)
    options = engine_options(checkpoint)
    engine = MiniCPMOEngine(model, EngineOptions(**options))
    try:
        async def run():
            (stream,) = engine.submit([SpeechRequest(request_id="direct", text=text, mode="read")])
            return np.concatenate([chunk.samples async for chunk in stream])

        return asyncio.run(run())
    finally:
        engine.close()


def test_http_audio_equals_engine_output(minicpmo_app, tiny_checkpoint):
    response = httpx.post(f"{minicpmo_app}/v1/speech/stream", timeout=300,
                          json={"text": TEXT, "mode": "read", "format": "pcm", "sample_rate": 24000})
    assert response.status_code == 200, response.text
    assert response.headers["x-sample-rate"] == "24000"
    served = np.frombuffer(response.content, dtype="<i2").astype(np.int32)
    direct = engine_pcm(tiny_checkpoint, TEXT)
    expected = np.round(np.clip(direct, -1.0, 1.0) * 32767).astype(np.int32)
    assert len(served) == len(expected) > 4096
    assert np.max(np.abs(served - expected)) <= 1


def test_models_list_names_the_model_not_a_path(minicpmo_app):
    body = httpx.get(f"{minicpmo_app}/v1/models", timeout=30).json()
    ids = [m["id"] for m in body["data"]]
    assert "MiniCPM-o-2_6" in ids
    assert not any("/" in i for i in ids)


def test_chat_mode_streams_an_answer(minicpmo_app):
    response = httpx.post(f"{minicpmo_app}/v1/speech/stream", timeout=300,
                          json={"text": "Say something.", "mode": "chat", "format": "wav",
                                "sample_rate": 16000, "seed": 7})
    assert response.status_code == 200, response.text
    assert response.content[:4] == b"RIFF" and len(response.content) > 44 + 16000 // 4


def test_bad_input_is_a_json_4xx_and_the_app_keeps_serving(minicpmo_app):
    for body in ({"text": "?!... \U0001F600", "mode": "read"}, {"text": "hi", "voice": "nobody"}):
        response = httpx.post(f"{minicpmo_app}/v1/speech/stream", json=body, timeout=60)
        assert 400 <= response.status_code < 500, response.text
        assert "error" in response.json()
    ok = httpx.post(f"{minicpmo_app}/v1/speech/stream", timeout=300,
                    json={"text": "Still here.", "mode": "read", "format": "pcm"})
    assert ok.status_code == 200 and len(ok.content) > 0


def sse_events(minicpmo_app, **body) -> list[dict]:
    request = {"model": "tts-1", "voice": "alloy", "input": TEXT, "response_format": "pcm",
               "stream_format": "sse", **body}
    with httpx.stream("POST", f"{minicpmo_app}/v1/audio/speech", json=request,
                      timeout=300) as reply:
        assert reply.status_code == 200, reply.read()
        return [json.loads(line[5:]) for line in reply.iter_lines() if line.startswith("data:")]


def test_sse_chunks_carry_their_text_and_instructions_shape_the_voice(minicpmo_app):
    plain = sse_events(minicpmo_app)
    # (On the tiny random model some instructions move the speaker embedding too little to
    # change a greedy code; this one changes the audio, see tests/engines/minicpmo.)
    directed = sse_events(minicpmo_app,
                          instructions="Speak slowly, in a warm and cheerful voice.")
    for events in (plain, directed):
        *deltas, done = events
        assert {event["type"] for event in deltas} == {"speech.audio.delta"}
        assert done["type"] == "speech.audio.done"
        # The chunks' texts, in order, are the text read (the tiny model's random weights may
        # end the audio before the text's end).
        spoken = "".join(event["text"] for event in deltas)
        assert spoken and TEXT.startswith(spoken)
        assert deltas[0]["text"].startswith("Hello")
    # The instructions' tokens are counted, and (greedy decoding) they change the audio.
    assert directed[-1]["usage"]["input_tokens"] > plain[-1]["usage"]["input_tokens"] > 0
    audio = [b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
             for events in (plain, directed)]
    assert audio[0] != audio[1]


def test_websocket_text_fed_word_by_word_is_spoken_with_its_captions(minicpmo_app):
    events, audio = speak_word_by_word(
        minicpmo_app, {"response_format": "pcm",
                       "instructions": "Speak slowly, in a warm and cheerful voice."}, TEXT)
    assert events[-1]["type"] == "response.done", events[-1]
    chunks = [e for e in events if e["type"] == "audio.chunk"]
    spoken = "".join(c["text"] for c in chunks)
    assert spoken and TEXT.startswith(spoken)
    assert sum(c["bytes"] for c in chunks) == len(audio) > 4096
    assert events[-1]["usage"]["input_tokens"] > 0


def test_sse_word_timestamps_on_minicpmo_follow_the_released_text(minicpmo_app):
    from serve_app.engines.words import split_words

    *deltas, done = sse_events(minicpmo_app, timestamp_granularities=["word"])
    assert done["type"] == "speech.audio.done"
    words = [word for event in deltas for word in event["words"]]
    assert words and [w["word"] for w in words] == split_words(TEXT)[:len(words)]
    for event in deltas:
        for word in event["words"]:
            assert (event["audio_offset_s"] - 1e-3 <= word["start"]
                    < event["audio_offset_s"] + event["duration_s"] + 1e-3)  # 3 decimals
    assert all(a["end"] <= b["start"] for a, b in zip(words, words[1:]))
