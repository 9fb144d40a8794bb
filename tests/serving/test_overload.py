"""Overload on the CPU profile as scripts/serve serves it: offered far more than it can speak,
the service refuses the excess at once (a JSON 503 with Retry-After, before any audio; a
WebSocket session at ``session.start``) and speaks every stream it admitted to its end.

How many streams fit depends on the machine, so the tests offer more than admission by work can
ever let in on any machine (a stream's cost never falls below a quarter of the prior's 1/8 of
the budget: 35 streams at most) and count; none asserts a time.
"""

from __future__ import annotations

import time

import httpx
import pytest

from bench.overload.client import offer
from bench.served.crossings import crossing_legs
from tests.cpu_profile import CpuProfileService

pytestmark = pytest.mark.slow

# More than 35 streams at once, within the profile's Synthesizer and Ingress caps (48, 128)
OFFERED = 44


@pytest.mark.timeout(600)
def test_a_burst_over_capacity_is_refused_at_once_and_the_admitted_streams_end_whole(
        cpu_service: CpuProfileService) -> None:
    fates = offer(cpu_service.url, [(0.0, "read")] * OFFERED, processes=1, lead_s=0.2)
    refused = [fate for fate in fates if fate.refused]
    admitted = [fate for fate in fates if fate.admitted]
    assert len(refused) + len(admitted) == OFFERED, [f.error for f in fates]
    assert refused and admitted
    assert all(fate.status == 503 and fate.retry_after for fate in refused)
    assert all("at capacity" in fate.error for fate in refused)
    assert all(fate.whole for fate in admitted)  # none cut after its first byte
    # each stream's way between the replicas can be read back from their log lines: the
    # Ingress's call (its clock) and the Synthesizer's arrival, for a refusal in its answer line
    for outcome in (refused, admitted):
        ids = {fate.request_id for fate in outcome}
        legs = _logged_crossings(cpu_service, ids)
        assert legs["requests"] == len(ids)
        assert legs["to_replica_ms"]["p50"] >= 0.0
    # the refusals took no work: the service has room again once the burst has ended
    with httpx.Client(base_url=cpu_service.url, timeout=120) as client:
        answer = client.post("/v1/speech/stream", json={"text": "Room again.", "format": "pcm"})
    assert answer.status_code == 200 and len(answer.content) > 0


@pytest.mark.timeout(600)
def test_sessions_over_capacity_are_refused_at_start_or_served_to_the_end(
        cpu_service: CpuProfileService) -> None:
    fates = offer(cpu_service.url, [(0.0, "session")] * OFFERED, processes=1, lead_s=0.2)
    refused = [fate for fate in fates if fate.refused]
    accepted = [fate for fate in fates if fate.status == 200]
    assert len(refused) + len(accepted) == OFFERED, [f.error for f in fates]
    assert refused and accepted
    # refused at session.start with the overload error and when to retry; nothing was spoken
    assert all(fate.retry_after and fate.audio_s == 0 for fate in refused)
    # a session once started keeps its place: its later text is never refused for load, and
    # it ends with response.done and its audio (none lost)
    assert all(fate.whole and fate.audio_s > 0 for fate in accepted), [
        fate.error for fate in accepted if not fate.whole]


def _logged_crossings(service: CpuProfileService, request_ids: set) -> dict:
    """The crossings of ``request_ids`` from the service's log, once every one has its lines
    there (Ray copies each replica's lines to the log a moment after they are written)."""
    deadline = time.monotonic() + 60
    while True:
        legs = crossing_legs(service.log_path.read_text(errors="replace"), request_ids) or {}
        if legs.get("requests") == len(request_ids) or time.monotonic() > deadline:
            return legs
        time.sleep(1.0)
