"""Property-based fuzzing of the HTTP API from its own OpenAPI schema (schemathesis + hypothesis).

Valid and invalid requests for every operation, bounded in count and time: no 5xx, no hang, and
every error is the JSON error object. The schema holds ``instructions``, ``stream_format`` and
``seed``, so they are fuzzed too; an SSE reply must be a well-formed event stream.
"""

from __future__ import annotations

import json
import time

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, example, given, settings
from schemathesis import GenerationMode

from serve_app.engines.base import InvalidRequestError
from serve_app.engines.text_rule import check_text
from tests.serving.conftest import Server

pytestmark = pytest.mark.slow

EXAMPLES = 150
SPEECH_EXAMPLES = 40
REQUEST_TIMEOUT_S = 60
ERROR_KEYS = {"message", "type", "param", "code"}


def check_sse(content_type: str, text: str) -> None:
    """An SSE reply: deltas, then one done with usage or one error event, nothing after."""
    assert content_type.startswith("text/event-stream"), content_type
    events = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
    *deltas, last = events
    assert all(event["type"] == "speech.audio.delta" for event in deltas), events
    assert last["type"] in ("speech.audio.done", "error"), last
    if last["type"] == "speech.audio.done":
        assert set(last["usage"]) == {"input_tokens", "output_tokens", "total_tokens"}
    else:
        assert set(last["error"]) == ERROR_KEYS


def test_fuzzed_requests_never_get_a_5xx_or_hang_and_every_error_is_json(
        server: Server) -> None:
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")
    cases = (schema.as_strategy(GenerationMode.POSITIVE)
             | schema.as_strategy(GenerationMode.NEGATIVE))
    seen: dict[int | str, int] = {}
    started = time.monotonic()

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def check(case: schemathesis.Case) -> None:
        body = case.body if isinstance(case.body, dict) else None
        for field in ("input", "text", "instructions"):
            # Long valid texts only cost synthesis time; length limits have their own tests.
            if body is not None and isinstance(body.get(field), str):
                body[field] = body[field][:200]
        response = case.call(headers=server.auth, timeout=REQUEST_TIMEOUT_S)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500, (case.method, case.path, case.body, response.text)
        if response.status_code >= 400:
            assert response.headers["content-type"][0].startswith("application/json"), \
                response.headers
            assert set(response.json()["error"]) == ERROR_KEYS, response.text
        elif body is not None and body.get("stream_format") == "sse":
            check_sse(response.headers["content-type"][0], response.text)
            seen["sse"] = seen.get("sse", 0) + 1

    check()
    sse = seen.pop("sse", 0)
    print(f"fuzz: {sum(seen.values())} requests in {time.monotonic() - started:.0f} s, "
          f"statuses {dict(sorted(seen.items()))}, {sse} SSE streams")
    assert sum(seen.values()) >= EXAMPLES // 2
    assert any(status >= 400 for status in seen) and 200 in seen


def test_fuzzed_openai_speech_fields_sse_and_instructions(server: Server) -> None:
    """OpenAI bodies from the schema with a served model and voice, so the new fields
    (``stream_format``, ``instructions``, ``seed``, formats) reach the engine: piper refuses
    instructions with a 400, everything else streams, SSE replies are well-formed."""
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")
    operation = schema["/v1/audio/speech"]["POST"]
    seen: dict[str, int] = {}

    def served(case: schemathesis.Case) -> schemathesis.Case:
        case.body = {**case.body, "model": "tts-1", "voice": "alloy",
                     "input": case.body["input"][:100]}
        if len(case.body.get("instructions") or "") % 2:
            del case.body["instructions"]  # half the cases without: those must stream
        if case.body.get("stream_format") != "sse":
            # word times travel in SSE events; their 400 without SSE is test_speech_events'
            case.body.pop("timestamp_granularities", None)
        return case

    def explicit(**fields: object) -> schemathesis.Case:
        return operation.Case(body={"model": "tts-1", "voice": "alloy",
                                    "input": "A sentence to speak.", **fields},
                              media_type="application/json")

    # Which cases the generator draws depends on Hypothesis' state of the whole session (one
    # order of the suite drew no case with instructions): each branch is also given once.
    @settings(max_examples=SPEECH_EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @example(case=explicit(instructions="Speak slowly."))
    @example(case=explicit(stream_format="sse", response_format="pcm"))
    @example(case=explicit(response_format="wav"))
    @given(case=operation.as_strategy(GenerationMode.POSITIVE).map(served))
    def check(case: schemathesis.Case) -> None:
        response = case.call(headers=server.auth, timeout=REQUEST_TIMEOUT_S)
        content_type = response.headers["content-type"][0]
        if case.body.get("instructions"):
            assert response.status_code == 400, response.text
            param = response.json()["error"]["param"]
            if param == "input":  # an input the text rule refuses is refused first
                with pytest.raises(InvalidRequestError):
                    check_text(case.body["input"], param="input")
                return
            assert param == "instructions", response.text
            seen["refused"] = seen.get("refused", 0) + 1
            return
        if response.status_code == 400:  # e.g. an input with nothing speakable
            assert set(response.json()["error"]) == ERROR_KEYS, response.text
            return
        assert response.status_code == 200, (case.body, response.text)
        if case.body.get("stream_format") == "sse":
            check_sse(content_type, response.text)
            seen["sse"] = seen.get("sse", 0) + 1
        else:
            assert content_type.startswith("audio/"), content_type
            seen["audio"] = seen.get("audio", 0) + 1

    check()
    print(f"speech fuzz: {seen}")
    assert seen.get("refused") and seen.get("sse") and seen.get("audio"), seen
