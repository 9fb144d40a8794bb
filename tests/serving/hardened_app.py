"""The "hardened" application of tests/serving/test_reliability.py: its arguments (small limits,
keys from a file and an environment variable, the engine's fault injection), its deployment
beside the session's app, and the HTTP helpers its tests read it with."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from serve_app.config import ApiConfig, AppArgs, BatchingConfig

APP = "hardened"
PREFIX = "/hardened"
FILE_KEYS = ["file-key-a", "file-key-b", "file-key-c", "file-key-d"]
ENV_KEY = "env-key-e"
KEYS_ENV = "TTS_HARDENED_TEST_KEYS"
FAIL, CRASH, STALL, SLOW = "FAIL-NOW", "CRASH-NOW", "STALL-NOW", "SLOW-NOW"
LONG_TEXT = " ".join(f"This is sentence number {n} of a longer text." for n in range(1, 9))
# Several chunks, and short enough to finish well within MAX_STREAM_S on a busy machine.
TEXT = "Hello from the serving stack. This second sentence is a little longer. And a third."
MAX_AUDIO_S = 30.0
MAX_STREAM_S = 16.0
# Generous for a busy two-core machine; SLOW's delay stays well below the chunk timeout.
FIRST_CHUNK_TIMEOUT_S = 12.0
CHUNK_TIMEOUT_S = 10.0
SLOW_DELAY_S = 4.0
BODY_TIMEOUT_S = 2.0
SYNTH_MAX_ONGOING = 4
SYNTH_MAX_QUEUED = 2
MAX_STREAMS = 8


def hardened_args(keys_file: Path) -> AppArgs:
    return AppArgs(
        engine="piper",
        engine_options={"intra_op_threads": 1, "max_batch_size": 8, "first_piece_phonemes": 50,
                        "admission": "slots",
                        "fault_injection": {"fail_request_text": FAIL,
                                            "crash_process_text": CRASH,
                                            "stall_request_text": STALL,
                                            "delay_request_text": SLOW,
                                            "delay_s": SLOW_DELAY_S}},
        batching=BatchingConfig(max_batch_size=8, batch_wait_timeout_s=0.01,
                                max_concurrent_batches=4),
        api=ApiConfig(api_keys_file=str(keys_file), api_keys_env=KEYS_ENV,
                      max_streams_per_key=2, max_streams=MAX_STREAMS, max_audio_s=MAX_AUDIO_S,
                      max_stream_s=MAX_STREAM_S, first_chunk_timeout_s=FIRST_CHUNK_TIMEOUT_S,
                      chunk_timeout_s=CHUNK_TIMEOUT_S, body_timeout_s=BODY_TIMEOUT_S,
                      drain_timeout_s=30),
    )


def deploy(args: AppArgs, synth_replicas: int = 1) -> None:
    """build_app's graph, with small CPU shares and tight queues, the env key on the ingress.

    Deploying it again with another replica count only scales the synthesizer.
    """
    from ray import serve

    from serve_app.front.ingress import Ingress
    from serve_app.gpu.synthesizer import Synthesizer

    api = args.api
    synthesizer = Synthesizer.options(
        num_replicas=synth_replicas, max_ongoing_requests=SYNTH_MAX_ONGOING,
        max_queued_requests=SYNTH_MAX_QUEUED, graceful_shutdown_timeout_s=30,
        ray_actor_options={"num_cpus": 0.2}, user_config=args.batching.model_dump(),
    ).bind(args.engine, args.engine_kwargs(), first_chunk_timeout_s=api.first_chunk_timeout_s,
           chunk_timeout_s=api.chunk_timeout_s, drain_timeout_s=api.drain_timeout_s)
    ingress = Ingress.options(
        graceful_shutdown_timeout_s=30,
        ray_actor_options={"num_cpus": 0.05,
                           "runtime_env": {"env_vars": {KEYS_ENV: ENV_KEY}}},
    ).bind(synthesizer, api.model_dump())
    serve.run(ingress, name=APP, route_prefix=PREFIX)


@dataclass
class Hardened:
    base_url: str
    args: AppArgs
    reference_pcm: dict[str, bytes] = field(default_factory=dict)

    def client(self, key: str = FILE_KEYS[0], timeout: float = 60) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=timeout,
                            headers={"authorization": f"Bearer {key}"})

    def handle(self):
        from ray import serve

        return serve.get_deployment_handle("Synthesizer", app_name=APP)

    def engine(self) -> dict:
        return self.handle().stats.remote().result()["engine"]

    def settled_engine(self, timeout_s: float = 15) -> dict:
        """The engine's counters once no stream runs and they stay put for a few pushes (the
        replica's copy is pushed every 0.1 s, so an earlier test's abort may still be on its
        way)."""
        deadline = time.monotonic() + timeout_s
        last = self.engine()
        while True:
            time.sleep(0.3)
            stats = self.engine()
            idle = stats["active_streams"] == 0 and stats["queued_streams"] == 0
            if (idle and stats == last) or time.monotonic() > deadline:
                return stats
            last = stats

    def wait_engine(self, predicate, timeout_s: float = 15) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.engine()
            if predicate(stats) or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)


def speak(client: httpx.Client, text: str, **body) -> httpx.Response:
    return client.post("/v1/speech/stream", json={"text": text, "format": "pcm", **body})


@dataclass
class StreamResult:
    status: int | None = None
    body: bytes = b""
    error: str | None = None  # how the body ended, if not cleanly
    json: dict | None = None
    headers: dict = field(default_factory=dict)
    elapsed_s: float = 0.0
    text: str = ""  # the start of a refusal's body, as sent (JSON or not)


def stream_all(client: httpx.Client, text: str, first_chunk: threading.Event | None = None,
               **body) -> StreamResult:
    """Read a whole streamed reply; a cut body is reported, not raised."""
    result = StreamResult()
    started = time.monotonic()
    try:
        with client.stream("POST", "/v1/speech/stream",
                           json={"text": text, "format": "pcm", **body}) as response:
            result.status = response.status_code
            result.headers = dict(response.headers)
            if response.status_code != 200:
                response.read()
                result.text = response.text[:300]
                if response.headers.get("content-type", "").startswith("application/json"):
                    result.json = response.json()
                return result
            for piece in response.iter_raw():
                result.body += piece
                if first_chunk is not None:
                    first_chunk.set()
    except httpx.HTTPError as exc:  # a body cut short: RemoteProtocolError
        result.error = type(exc).__name__
    finally:
        result.elapsed_s = time.monotonic() - started
        if first_chunk is not None:
            first_chunk.set()
    return result


def assert_json_error(response_or_result, status: int, code: str | None = None) -> dict:
    if isinstance(response_or_result, StreamResult):
        got, payload, headers = (response_or_result.status, response_or_result.json,
                                 response_or_result.headers)
        assert payload is not None, ("not JSON", got, response_or_result.text)
    else:
        got, headers = response_or_result.status_code, response_or_result.headers
        assert headers["content-type"].startswith("application/json")
        payload = response_or_result.json()
    assert got == status, (got, payload)
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code, error
    if status in (429, 503):
        assert int(headers["retry-after"]) >= 1
    return error


def reference(app: Hardened, text: str) -> bytes:
    """The stream's PCM when served alone (seeded, so reproducible)."""
    if text not in app.reference_pcm:
        with app.client() as client:
            response = speak(client, text, seed=3)
        assert response.status_code == 200
        app.reference_pcm[text] = response.content
    return app.reference_pcm[text]


def assert_same_audio(served: bytes, expected: bytes) -> None:
    assert len(served) == len(expected)
    a = np.frombuffer(served, "<i2").astype(np.int32)
    b = np.frombuffer(expected, "<i2").astype(np.int32)
    # A row batched with others matches it run alone within about 1e-4 of full scale, and in
    # its last padded samples within 1e-3 (the engine's own bound, test_piper_engine.py's
    # test_batched_rows_match_single_runs): which streams share a batch depends on timing.
    assert np.max(np.abs(a - b)) <= 1e-3 * 32768
