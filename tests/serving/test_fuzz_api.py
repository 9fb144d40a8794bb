"""Property-based fuzzing of the HTTP API from its own OpenAPI schema (schemathesis + hypothesis).

Valid and invalid requests for every operation, bounded in count and time: no 5xx, no hang, and
every error is the JSON error object.
"""

from __future__ import annotations

import time

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from tests.serving.conftest import Server

pytestmark = pytest.mark.slow

EXAMPLES = 150
REQUEST_TIMEOUT_S = 60
ERROR_KEYS = {"message", "type", "param", "code"}


def test_fuzzed_requests_never_get_a_5xx_or_hang_and_every_error_is_json(
        server: Server) -> None:
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")
    cases = (schema.as_strategy(GenerationMode.POSITIVE)
             | schema.as_strategy(GenerationMode.NEGATIVE))
    seen: dict[int, int] = {}
    started = time.monotonic()

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def check(case: schemathesis.Case) -> None:
        body = case.body if isinstance(case.body, dict) else None
        for field in ("input", "text"):
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

    check()
    print(f"fuzz: {sum(seen.values())} requests in {time.monotonic() - started:.0f} s, "
          f"statuses {dict(sorted(seen.items()))}")
    assert sum(seen.values()) >= EXAMPLES // 2
    assert any(status >= 400 for status in seen) and 200 in seen
