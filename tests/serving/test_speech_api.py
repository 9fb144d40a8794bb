"""The served product over real HTTP: streaming, formats, exactness, batching, SDK, errors."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

from serve_app.audio import FORMATS, SAMPLE_RATES_HZ, check_format_rate, float_to_pcm16
from serve_app.engines.base import SpeechRequest
from serve_app.engines.piper.piper_engine import PiperEngine
from tests.audio.decoding import decode_audio
from tests.serving.conftest import Server

pytestmark = pytest.mark.slow

FIXED_TEXT = "Hello from the serving stack."
FIXED_SEED = 7
LONG_TEXT = " ".join(f"This is sentence number {n} of a longer text." for n in range(1, 9))
MP3_SLACK_SAMPLES = 3 * 1152
AAC_SLACK_SAMPLES = 2 * 1024  # ADTS keeps the encoder's priming and last-frame padding


@pytest.fixture(scope="module")
def reference_engine() -> PiperEngine:
    engine = PiperEngine.from_options(intra_op_threads=1)
    yield engine
    engine.close()


def engine_output(engine: PiperEngine, text: str, seed: int) -> np.ndarray:
    """The engine's own audio for a request, run in this process."""
    async def run() -> np.ndarray:
        [chunks] = engine.submit([SpeechRequest(request_id="ref", text=text, seed=seed)])
        return np.concatenate([chunk.samples async for chunk in chunks])

    return asyncio.run(run())


def native(client: httpx.Client, **body) -> httpx.Response:
    return client.post("/v1/speech/stream", json={"text": FIXED_TEXT, **body})


@pytest.mark.parametrize("audio_format", ["pcm", "aac"])
def test_body_streams_in_chunks_and_the_first_leaves_before_synthesis_ends(
        server: Server, client: httpx.Client, audio_format: str) -> None:
    completed_before = server.synthesizer_stats()["engine"]["completed"]
    with client.stream("POST", "/v1/speech/stream",
                       json={"text": LONG_TEXT, "format": audio_format, "seed": 1}) as response:
        assert response.status_code == 200
        pieces = response.iter_raw()
        first = next(pieces)
        # The stream is still being synthesized while its first bytes are already here.
        assert server.synthesizer_stats()["engine"]["completed"] == completed_before
        rest = list(pieces)
    assert len(first) > 0 and len(rest) >= 2
    assert server.synthesizer_stats()["engine"]["completed"] == completed_before + 1


def test_headers_carry_request_id_rate_and_format(client: httpx.Client) -> None:
    response = native(client, format="flac", sample_rate=16000)
    assert response.status_code == 200
    assert response.headers["x-sample-rate"] == "16000"
    assert response.headers["x-audio-format"] == "flac"
    assert response.headers["content-type"] == "audio/flac"
    assert len(response.headers["x-request-id"]) >= 8


def test_served_pcm_equals_the_engine_output(client: httpx.Client,
                                             reference_engine: PiperEngine) -> None:
    expected = float_to_pcm16(engine_output(reference_engine, LONG_TEXT, FIXED_SEED))
    response = native(client, text=LONG_TEXT, format="pcm", sample_rate=22050, seed=FIXED_SEED)
    assert response.status_code == 200
    served = np.frombuffer(response.content, dtype="<i2")
    assert len(served) == len(expected)
    # Float rounding of a differently threaded ONNX run may move a sample by one step.
    assert np.max(np.abs(served.astype(np.int32) - expected.astype(np.int32))) <= 2


@pytest.mark.parametrize("audio_format", FORMATS)
def test_every_format_and_rate_decodes_to_the_engine_duration(
        client: httpx.Client, reference_engine: PiperEngine, audio_format: str) -> None:
    native_samples = len(engine_output(reference_engine, FIXED_TEXT, FIXED_SEED))
    for rate in SAMPLE_RATES_HZ:
        response = native(client, format=audio_format, sample_rate=rate, seed=FIXED_SEED)
        if check_format_rate(audio_format, rate) is not None:
            assert response.status_code == 400, (audio_format, rate)
            assert response.json()["error"]["param"] == "sample_rate"
            continue
        assert response.status_code == 200, (audio_format, rate, response.text)
        samples, decoded_rate = decode_audio(response.content, audio_format, rate)
        expected = native_samples * rate / reference_engine.sample_rate_hz
        assert decoded_rate == rate
        if audio_format == "mp3":
            assert expected <= len(samples) <= expected + MP3_SLACK_SAMPLES, rate
        elif audio_format == "aac":
            assert expected <= len(samples) <= expected + AAC_SLACK_SAMPLES, rate
        else:
            assert abs(len(samples) - expected) <= 2, (audio_format, rate)
        assert np.sqrt(np.mean(samples ** 2)) > 0.02


def test_eight_concurrent_requests_complete_and_share_batches(server: Server) -> None:
    def one(index: int) -> httpx.Response:
        with httpx.Client(base_url=server.base_url, headers=server.auth, timeout=300) as c:
            return c.post("/v1/audio/speech", json={
                "model": "tts-1", "voice": "alloy", "response_format": "wav",
                "input": f"Concurrent request number {index} is speaking now."})

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(one, range(8)))
    for response in responses:
        assert response.status_code == 200
        samples, rate = decode_audio(response.content, "wav", 24000)
        assert rate == 24000 and len(samples) > rate
    assert server.synthesizer_stats()["max_batch_size_formed"] > 1


def test_openai_pcm_is_24khz_mp3_the_default_and_aac_adts(client: httpx.Client,
                                                 reference_engine: PiperEngine) -> None:
    body = {"model": "tts-1", "voice": "alloy", "input": FIXED_TEXT}
    mp3 = client.post("/v1/audio/speech", json=body)
    assert mp3.status_code == 200 and mp3.headers["content-type"] == "audio/mpeg"
    _, rate = decode_audio(mp3.content, "mp3", 24000)
    assert rate == 24000
    pcm = client.post("/v1/audio/speech", json={**body, "response_format": "pcm"})
    assert pcm.status_code == 200 and pcm.headers["x-sample-rate"] == "24000"
    aac = client.post("/v1/audio/speech", json={**body, "response_format": "aac"})
    assert aac.status_code == 200 and aac.headers["content-type"] == "audio/aac"
    assert aac.content[:2] == b"\xff\xf1"  # ADTS: MPEG-4 AAC, no CRC
    samples, rate = decode_audio(aac.content, "aac", 24000)
    assert rate == 24000 and len(samples) > rate // 2


def test_openai_sdk_client_works_streaming_too(server: Server) -> None:
    sdk = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key)
    whole = sdk.audio.speech.create(model="tts-1", voice="alloy", input=FIXED_TEXT,
                                    response_format="wav")
    samples, rate = decode_audio(whole.content, "wav", 24000)
    assert rate == 24000 and len(samples) > rate // 2
    with sdk.audio.speech.with_streaming_response.create(
            model="tts-1", voice="nova", input=LONG_TEXT, response_format="pcm",
            speed=1.5) as response:
        pieces = list(response.iter_bytes())
    assert len(pieces) >= 1 and sum(len(p) for p in pieces) > 24000 * 2
    assert "tts-1" in [model.id for model in sdk.models.list()]
    with pytest.raises(openai.BadRequestError):
        sdk.audio.speech.create(model="tts-1", voice="alloy", input="  ")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong").audio.speech.create(
            model="tts-1", voice="alloy", input=FIXED_TEXT)


def test_discovery_and_health_routes(client: httpx.Client) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").status_code == 200
    models = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert {"tts-1", "piper-en_US-joe-medium"} <= set(models)
    voices = client.get("/v1/voices").json()
    assert {"joe", "alloy"} <= {v["id"] for v in voices["data"]}
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/audio/speech", "/v1/speech/stream", "/v1/models", "/v1/voices"} <= set(paths)


OPENAI_OK = {"model": "tts-1", "voice": "alloy", "input": "Hi there."}

BAD_REQUESTS = [
    # (name, path, body or raw bytes, headers, status, param)
    ("empty input", "/v1/audio/speech", {**OPENAI_OK, "input": ""}, {}, 400, "input"),
    ("whitespace input", "/v1/audio/speech", {**OPENAI_OK, "input": " \n\t "}, {}, 400, "input"),
    ("too long", "/v1/audio/speech", {**OPENAI_OK, "input": "a" * 4097}, {}, 400, "input"),
    ("missing input", "/v1/audio/speech", {"model": "tts-1", "voice": "alloy"}, {}, 400, "input"),
    ("unknown voice", "/v1/audio/speech", {**OPENAI_OK, "voice": "nobody"}, {}, 400, "voice"),
    ("unknown format", "/v1/audio/speech", {**OPENAI_OK, "response_format": "m4a"}, {}, 400,
     "response_format"),
    ("unknown model", "/v1/audio/speech", {**OPENAI_OK, "model": "tts-9"}, {}, 404, "model"),
    ("speed too low", "/v1/audio/speech", {**OPENAI_OK, "speed": 0.1}, {}, 400, "speed"),
    ("speed too high", "/v1/audio/speech", {**OPENAI_OK, "speed": 4.5}, {}, 400, "speed"),
    ("malformed json", "/v1/audio/speech", b'{"model": "tts-1", "input": ', {}, 400, None),
    ("json array", "/v1/audio/speech", b"[1, 2]", {}, 400, None),
    ("wrong content type", "/v1/audio/speech", json.dumps(OPENAI_OK).encode(),
     {"content-type": "text/plain"}, 415, None),
    ("oversized body", "/v1/audio/speech", {**OPENAI_OK, "input": "a" * 70_000}, {}, 413, None),
    ("no api key", "/v1/audio/speech", OPENAI_OK, {"authorization": ""}, 401, None),
    ("chat on piper", "/v1/speech/stream", {"text": "Hi.", "mode": "chat"}, {}, 422, "mode"),
    ("bad sample rate", "/v1/speech/stream", {"text": "Hi.", "sample_rate": 12345}, {}, 400,
     "sample_rate"),
    ("opus at 44.1 kHz", "/v1/speech/stream",
     {"text": "Hi.", "format": "opus", "sample_rate": 44100}, {}, 400, "sample_rate"),
    ("unknown field", "/v1/speech/stream", {"text": "Hi.", "volume": 3}, {}, 400, "volume"),
    ("unknown route", "/v1/nothing", OPENAI_OK, {}, 404, None),
]


@pytest.mark.parametrize(("name", "path", "body", "headers", "status", "param"), BAD_REQUESTS,
                         ids=[case[0] for case in BAD_REQUESTS])
def test_bad_input_gets_a_clean_json_error_and_the_server_keeps_serving(
        client: httpx.Client, server: Server, name: str, path: str, body, headers: dict,
        status: int, param: str | None) -> None:
    steps_before = server.synthesizer_stats()["engine"]["steps"]
    if isinstance(body, bytes):
        response = client.post(path, content=body,
                               headers={"content-type": "application/json", **headers})
    else:
        response = client.post(path, json=body, headers=headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param
    for leak in ("Traceback", "File \"", ".py", "/work/", "site-packages", server.api_key):
        assert leak not in response.text
    # Rejected before the engine ran anything.
    assert server.synthesizer_stats()["engine"]["steps"] == steps_before
    assert client.post("/v1/audio/speech", json={**OPENAI_OK, "response_format": "pcm"}
                       ).status_code == 200


def test_method_not_allowed_is_json(client: httpx.Client) -> None:
    response = client.get("/v1/audio/speech")
    assert response.status_code == 405
    assert response.json()["error"]["code"] == "method_not_allowed"


def test_client_disconnect_aborts_the_engine_stream(server: Server,
                                                    client: httpx.Client) -> None:
    aborted_before = server.synthesizer_stats()["engine"]["aborted"]
    with client.stream("POST", "/v1/speech/stream",
                       json={"text": LONG_TEXT * 3, "format": "pcm"}) as response:
        next(response.iter_raw())
    # Closing the response drops the connection; the abort then travels through Ray.
    for _ in range(600):
        if server.synthesizer_stats()["engine"]["aborted"] > aborted_before:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert server.synthesizer_stats()["engine"]["aborted"] == aborted_before + 1


def test_batching_knobs_change_live_through_reconfigure(server: Server,
                                                        client: httpx.Client) -> None:
    from ray import serve

    handle = serve.get_deployment_handle("Synthesizer", app_name="tts")
    original = server.synthesizer_stats()["batching"]
    completed = server.synthesizer_stats()["engine"]["completed"]
    try:
        for knobs in ({**original, "max_batch_size": 3, "batch_wait_timeout_s": 0.0},
                      {**original, "max_concurrent_batches": 2}):
            handle.reconfigure.remote(knobs).result()
            assert server.synthesizer_stats()["batching"] == knobs
            assert client.post("/v1/audio/speech", json=OPENAI_OK).status_code == 200
    finally:
        handle.reconfigure.remote(original).result()
    # Same replica throughout: its counters kept counting.
    assert server.synthesizer_stats()["engine"]["completed"] == completed + 2
