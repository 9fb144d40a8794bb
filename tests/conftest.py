"""Shared fixtures. Keep fixtures for one area in that area's conftest; only truly shared ones here."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import httpx

    from tests.serving.conftest import Server


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
