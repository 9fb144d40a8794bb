"""What the service answers without a client library, for the client tests to compare with."""

from __future__ import annotations

import functools
import time
from typing import Any

import httpx

from tests.serving.conftest import Server

OPENAI_PCM_RATE_HZ = 24000
SENTENCE = "Hello from the serving stack, spoken through a voice agent framework."
# Long enough that the engine is still synthesizing when the listener cuts in after the first
# audio (about two minutes of speech; a few seconds of first audio at most).
LONG_TEXT = " ".join(f"This is sentence number {n} of an answer the listener cuts into."
                     for n in range(1, 31))
# Piper draws its phoneme lengths with noise (no seed here), so two runs of one text differ by
# a few percent; a client that lost or repeated audio would be far outside this.
DURATION_BAND = (0.8, 1.25)


@functools.cache
def served_speech_s(base_url: str, api_key: str, text: str, voice: str) -> float:
    """Seconds of speech ``POST /v1/audio/speech`` gives for ``text`` in ``voice`` (pcm)."""
    response = httpx.post(f"{base_url}/v1/audio/speech", timeout=120,
                          headers={"authorization": f"Bearer {api_key}"},
                          json={"model": "tts-1", "voice": voice, "input": text,
                                "response_format": "pcm"})
    assert response.status_code == 200, response.text
    return len(response.content) / 2 / OPENAI_PCM_RATE_HZ


def assert_sounds_like_the_service(server: Server, seconds: float, text: str, voice: str) -> None:
    """``seconds`` of audio a client got for ``text`` are what the service gives for it."""
    reference = served_speech_s(server.base_url, server.api_key, text, voice)
    low, high = DURATION_BAND
    assert low * reference <= seconds <= high * reference, (seconds, reference)


def engine_stats(server: Server) -> dict[str, Any]:
    return server.synthesizer_stats()["engine"]


def settled_engine_stats(server: Server, timeout_s: float = 60) -> dict[str, Any]:
    """The engine's counters once it holds no stream (a stream whose client left is aborted
    within a step or two)."""
    deadline = time.monotonic() + timeout_s
    while (stats := engine_stats(server))["active_streams"] or stats["queued_streams"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)
    return stats


def assert_cut_short_by_the_client(server: Server, before: dict[str, Any]) -> None:
    """The one stream since ``before`` ended because its client closed it mid-synthesis: the
    engine aborted it rather than completing it."""
    after = settled_engine_stats(server)
    assert after["aborted"] == before["aborted"] + 1, (before, after)
    assert after["completed"] == before["completed"], (before, after)
