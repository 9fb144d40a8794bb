"""Debian's chromium for the browser tests (driven by Playwright, no browser download)."""

from __future__ import annotations

import os
import shutil

import pytest

# Headless on a machine with no network beyond its own: without the background-networking
# flags chromium keeps trying Google's hosts.
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--autoplay-policy=no-user-gesture-required",
]


def chromium_path() -> str:
    """The chromium binary; a test fails without one in CI (.ci/run installs it), else skips."""
    path = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which(
        "chromium-browser")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (.ci/run installs Debian's chromium)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return path
