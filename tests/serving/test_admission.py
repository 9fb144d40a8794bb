"""``@serve.batch`` admits; it does not hold streams: with one batch of one request at a time,
requests started one after another all stream at once."""

from __future__ import annotations

import time
from contextlib import ExitStack

import httpx
import pytest

APP = "admission"
PREFIX = "/admission"
STREAMS = 3


@pytest.fixture(scope="module")
def long_stream_app(server, tiny_checkpoint):
    """The tiny MiniCPM-o checkpoint with fixed 60 s streams (many seconds of wall time each),
    behind the tightest batching knobs: one batch of one request at a time. Admission by slots:
    what is asserted is that batches do not hold streams, and on a loaded machine the tiny
    engine's measured step could make admission by work refuse the third stream."""
    from ray import serve

    from serve_app.config import ApiConfig, BatchingConfig
    from serve_app.front.ingress import Ingress
    from serve_app.gpu.synthesizer import Synthesizer

    small = {"num_cpus": 0.05}
    options = {"model": str(tiny_checkpoint), "device": "cpu", "dtype": "float32",
               "max_slots": 4, "max_chat_slots": 1, "tts_max_positions": 4096,
               "llm_max_positions": 256, "tts_sampling": "greedy", "max_segment_frames": 3600,
               "benchmark": {"audio_seconds": 60}, "admission": "slots"}
    synthesizer = Synthesizer.options(
        name="Synthesizer", ray_actor_options=small, max_ongoing_requests=8,
        user_config=BatchingConfig(max_batch_size=1, batch_wait_timeout_s=0.0,
                                   max_concurrent_batches=1).model_dump(),
    ).bind("minicpmo", options)
    ingress = Ingress.options(ray_actor_options=small).bind(synthesizer, ApiConfig().model_dump())
    serve.run(ingress, name=APP, route_prefix=PREFIX)
    base = f"{server.base_url}{PREFIX}"
    deadline = time.monotonic() + 180
    while httpx.get(f"{base}/readyz", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "admission app never became ready"
        time.sleep(0.5)
    yield base
    serve.delete(APP)


def engine_stats() -> dict:
    from ray import serve

    handle = serve.get_deployment_handle("Synthesizer", app_name=APP)
    return handle.stats.remote().result()["engine"]


def test_requests_started_one_after_another_all_stream_at_once(long_stream_app) -> None:
    body = {"text": "Hello there.", "mode": "read", "format": "pcm"}
    readers = []  # kept: a dropped reader closes its connection, which aborts its stream
    with httpx.Client(timeout=120) as client, ExitStack() as streams:
        for _ in range(STREAMS):
            response = streams.enter_context(
                client.stream("POST", f"{long_stream_app}/v1/speech/stream", json=body))
            assert response.status_code == 200, response.read()
            # Its first audio, before the next request starts: the earlier streams still run
            # (each lasts many seconds), so all of them hold engine slots now.
            readers.append(response.iter_bytes())
            assert next(readers[-1])
        running = engine_stats()
        assert running["active_streams"] == STREAMS, running
        assert running["max_batch_size_seen"] == STREAMS
    # Every client went away mid-stream: each engine slot is freed, nothing is left running.
    deadline = time.monotonic() + 60
    while (stats := engine_stats())["active_streams"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)
    assert stats["aborted"] >= STREAMS


def test_models_list_says_benchmark_mode(long_stream_app) -> None:
    models = httpx.get(f"{long_stream_app}/v1/models", timeout=30).json()["data"]
    assert all(model["benchmark_mode"]["audio_seconds"] == 60 for model in models)
