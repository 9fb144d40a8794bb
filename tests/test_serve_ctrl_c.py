"""Ctrl-C ends ``scripts/serve`` cleanly and in seconds: ``scripts/serve_run.py`` (what
``scripts/serve`` runs) on the CPU profile, sent SIGINT as a terminal sends it (to the whole
foreground process group), exits 0 without "Controller failed to shut down within 30.0s".

That message is ``serve run``'s: it waits 30 s for Serve's controller to shut down. Behind
HAProxy, Serve kept a stopping Ingress replica reachable for 30 s (for load balancers to
deregister it) before stopping the Synthesizer, so every Ctrl-C took ~35 s and ended with it;
``scripts/serve_run.py`` now shortens that period on its own local Ray.
"""

from __future__ import annotations

import os
import signal

import pytest

from tests.cpu_profile import CpuProfileService

pytestmark = pytest.mark.slow

SHUTDOWN_TIMED_OUT = "Controller failed to shut down"


def test_ctrl_c_stops_the_service_cleanly_without_serves_shutdown_timeout(
        cpu_service_to_stop: CpuProfileService) -> None:
    """The CPU-profile service of the session (tests/cpu_profile.py: ``scripts/serve_run.py``
    on its own local Ray, as scripts/serve starts it), taken over after the other tests on it
    (tests/conftest.py runs this one last), or started here when run alone; its whole log."""
    import httpx

    service = cpu_service_to_stop
    spoken = httpx.post(f"{service.url}/v1/audio/speech", timeout=120, json={
        "model": "tts-1", "voice": "alloy", "input": "Stop me when I am done."})
    assert spoken.status_code == 200
    os.killpg(service.process.pid, signal.SIGINT)
    returncode = service.process.wait(timeout=300)
    service.end()  # what it left behind, before its log is read
    output = service.log_path.read_text(errors="replace")
    assert returncode == 0, output[-3000:]
    assert "Got KeyboardInterrupt, shutting down" in output
    assert SHUTDOWN_TIMED_OUT not in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
