"""Hostile and odd text through the real HTTP app (Piper): audio or a JSON 4xx, never a 5xx.

Schemathesis (test_fuzz_api.py) fuzzes the schema; this fuzzes what is inside the strings.
Every answer is a 200 with audio bytes or a JSON 4xx error; never a 5xx, never an empty 200.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.serving.conftest import Server
from tests.text_cases import ONCE_FAILED, SPEAKS, hostile_text

pytestmark = pytest.mark.slow

EXAMPLES = 30
WAV_HEADER_BYTES = 44
ERROR_KEYS = {"message", "type", "param", "code"}
ROUTES = {
    "/v1/speech/stream": lambda text: {"text": text, "format": "wav"},
    "/v1/audio/speech": lambda text: {"model": "tts-1", "voice": "alloy", "input": text,
                                      "response_format": "wav"},
}


def post_text(client: httpx.Client, path: str, text: str) -> httpx.Response:
    # json.dumps escapes everything to ASCII, lone surrogates too ("\ud800"), as a client may.
    body = json.dumps(ROUTES[path](text)).encode()
    return client.post(path, content=body, headers={"content-type": "application/json"})


def assert_audio_or_json_4xx(response: httpx.Response, text: str) -> str:
    """The answer's kind: "audio" (a 200 with samples) or the 4xx error's code."""
    assert response.status_code < 500, (repr(text), response.status_code, response.text)
    if response.status_code == 200:
        assert response.headers["content-type"] == "audio/wav"
        assert len(response.content) > WAV_HEADER_BYTES, repr(text)
        return "audio"
    assert 400 <= response.status_code < 500
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS and error["message"] and error["code"], response.text
    return error["code"]


# The report that opened issue 16 (scripts/serve, CPU profile), row by row.
REPORTED = [
    ("\u0000\u0001\u0002", 400, "invalid_text"),
    ("Hello\u0000world", 400, "invalid_text"),
    ("\u200b\u200b\u200b", 400, "nothing_to_speak"),
    (" \t\u0007 ", 400, "nothing_to_speak"),
    ("...", 400, "nothing_to_speak"),  # espeak-ng finds nothing to say in it
    ("\U000c4a7e", 400, "nothing_to_speak"),
    *[(text, 200, "audio") for text in SPEAKS],
]


@pytest.mark.parametrize(("text", "status", "kind"), REPORTED,
                         ids=[f"{kind}-{index}" for index, (_, _, kind) in enumerate(REPORTED)])
def test_reported_texts_get_a_json_4xx_or_audio(client: httpx.Client, server: Server,
                                               text: str, status: int, kind: str) -> None:
    steps_before = server.synthesizer_stats()["engine"]["steps"]
    for path in ROUTES:
        response = post_text(client, path, text)
        assert response.status_code == status, response.text
        assert assert_audio_or_json_4xx(response, text) == kind
    if status != 200:  # refused before the engine ran anything
        assert server.synthesizer_stats()["engine"]["steps"] == steps_before


def test_fuzzed_text_gets_audio_or_a_json_4xx_never_a_5xx(client: httpx.Client) -> None:
    kinds: dict[str, int] = {}

    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(text=hostile_text, path=st.sampled_from(sorted(ROUTES)))
    def check(text: str, path: str) -> None:
        kind = assert_audio_or_json_4xx(post_text(client, path, text), text)
        kinds[kind] = kinds.get(kind, 0) + 1

    for text in ONCE_FAILED:
        check = example(text=text, path="/v1/speech/stream")(check)
    check()
    assert kinds.get("audio", 0) >= 1 and sum(kinds.values()) - kinds.get("audio", 0) >= 1
