"""Shared fixtures. Keep fixtures for one area in that area's conftest; only truly shared ones here."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import httpx

    from tests.cpu_profile import CpuProfile, CpuProfileService
    from tests.serving.conftest import Server


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests on the CPU profile as scripts/serve serves it (tests/cpu_profile.py) go last,
    in their order, the one that stops it at the very end: one service serves them all, and it
    runs only while they do, not beside the rest of the suite."""
    def rank(item: pytest.Item) -> int:
        names = getattr(item, "fixturenames", ())
        return 2 if "cpu_service_to_stop" in names else 1 if "cpu_service" in names else 0

    items.sort(key=rank)  # stable: every other test keeps its place


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The golden tiny MiniCPM-o checkpoint in the official layout, rebuilt by our generator."""
    from tests.golden.checkpoint import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-minicpmo"))


@pytest.fixture(scope="session")
def voice_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny voice-cloning checkpoint (with the audio encoder), rebuilt by our generator."""
    from tests.golden_voice.checkpoint import build_voice_checkpoint

    return build_voice_checkpoint(tmp_path_factory.mktemp("tiny-minicpmo-voice"))


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The app on the Piper engine, on a local Ray cluster of the session's own, over real HTTP
    (tests/serving/conftest.py:serve_piper_app); tests/serving and tests/clients share it."""
    from tests.serving.conftest import serve_piper_app

    yield from serve_piper_app(tmp_path_factory)


@pytest.fixture()
def client(server: Server) -> Iterator[httpx.Client]:
    import httpx

    with httpx.Client(base_url=server.base_url, headers=server.auth, timeout=120) as client:
        yield client


@pytest.fixture(scope="session")
def cpu_profile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CpuProfile]:
    """The session's one CPU-profile service, as scripts/serve serves it (tests/cpu_profile.py)."""
    from tests.cpu_profile import CpuProfile

    profile = CpuProfile(tmp_path_factory.mktemp("cpu-profile"))
    try:
        yield profile
    finally:
        profile.close()


@pytest.fixture()
def cpu_service(cpu_profile: CpuProfile) -> CpuProfileService:
    """The CPU profile served (started by the first test that asks), for requests only."""
    return cpu_profile.service()


@pytest.fixture()
def cpu_service_to_stop(cpu_profile: CpuProfile) -> Iterator[CpuProfileService]:
    """The CPU profile served, handed over to a test that stops it; ended afterwards whatever
    the test did."""
    service = cpu_profile.take()
    try:
        yield service
    finally:
        service.end()
