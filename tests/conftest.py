"""Shared fixtures. Keep fixtures for one area in that area's conftest; only truly shared ones here."""

from __future__ import annotations

from pathlib import Path

import pytest


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
